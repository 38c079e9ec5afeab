"""Sandgate's own limits: request rates, secret call budgets and connection counts.

Pure bookkeeping, no I/O: the addon asks and raises what these return. Every limit here is per
process (a replica counts its own traffic). Memory stays bounded: buckets and budgets are kept
per identity and per secret the loaded policy names, connections per open client connection.

- `TokenBucket`: `rate` tokens a second up to `burst`; a request takes one. When empty, the
  wait until the next token is the Retry-After (whole seconds, rounded up, at least 1).
- `WindowBudget`: `calls` per fixed window of `per` seconds, the window starting at the first
  call after the previous one ended. Spent only when a secret is actually injected.
- `ConnectionCounter`: client connections in total and per identity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sandgate.errors import Code, LimitExceeded
from sandgate.policy.model import IdentityLimits, SecretBudget

# Defaults of `sandgate run` (the "Limits" table of docs/operations.md).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_IDENTITY = 256
DEFAULT_HEADER_TIMEOUT = 30.0
DEFAULT_IDLE_TIMEOUT = 300.0
DEFAULT_UPSTREAM_CONNECT_TIMEOUT = 10.0
DEFAULT_UPSTREAM_READ_TIMEOUT = 120.0
# An idle upstream connection is kept this long for the caller's next client connection
# (mitm/speedups/upstreampool.py): under common servers' keep-alive timeouts (5 s and more).
DEFAULT_UPSTREAM_REUSE_IDLE = 2.0
# Before identification (sandgate/mitm/guards/admission.py): short, since a client that means to be
# served sends its CONNECT or request at once.
DEFAULT_FIRST_BYTE_TIMEOUT = 10.0
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_IDENTIFY_TIMEOUT = 30.0
DEFAULT_MAX_UNIDENTIFIED_PER_SOURCE = 128


@dataclass(frozen=True)
class LimitsConfig:
    """The process-wide limits (flags). Per-identity `limits:` in the policy override the
    per-identity ones; None: no limit."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    max_connections_per_identity: int | None = DEFAULT_MAX_CONNECTIONS_PER_IDENTITY
    rps: float | None = None  # requests a second per identity; None: off
    burst: int | None = None  # default: rps rounded up
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    upstream_connect_timeout: float | None = DEFAULT_UPSTREAM_CONNECT_TIMEOUT
    upstream_read_timeout: float | None = DEFAULT_UPSTREAM_READ_TIMEOUT
    upstream_reuse_idle: float | None = DEFAULT_UPSTREAM_REUSE_IDLE  # None: no reuse
    first_byte_timeout: float | None = DEFAULT_FIRST_BYTE_TIMEOUT
    handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT
    identify_timeout: float | None = DEFAULT_IDENTIFY_TIMEOUT
    max_unidentified_per_source: int | None = DEFAULT_MAX_UNIDENTIFIED_PER_SOURCE


def retry_after(seconds: float) -> int:
    """A Retry-After value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(seconds - 1e-9))


def default_burst(rps: float) -> int:
    return max(1, math.ceil(rps))


# The refusals of these limits, the same whether counted here or for the fleet (sandgate.state)

def rate_limited(identity: str, rate: tuple[float, int], wait: float) -> LimitExceeded:
    return LimitExceeded(
        Code.RATE_LIMITED, f"identity '{identity}' is over its request rate ({rate[0]:g}/s, "
        f"burst {rate[1]})", hint="slow down and retry after the Retry-After seconds",
        retry_after=retry_after(wait))


def budget_exhausted(name: str, budget: SecretBudget, wait: float) -> LimitExceeded:
    return LimitExceeded(
        Code.BUDGET_EXHAUSTED, f"secret '{name}' has used its budget of {budget.calls} calls "
        f"per {budget.per:g}s", hint="nothing was sent upstream; retry after the Retry-After "
        "seconds", retry_after=retry_after(wait))


def too_many_connections(identity: str, limit: int | None) -> LimitExceeded:
    return LimitExceeded(
        Code.TOO_MANY_CONNECTIONS, f"identity '{identity}' already has {limit} open "
        "connections to Sandgate", hint="reuse connections (keep-alive) or close idle ones",
        retry_after=1)


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.updated = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is available."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class WindowBudget:
    def __init__(self, calls: int, per: float) -> None:
        if calls < 1 or per <= 0:
            raise ValueError("a budget needs calls >= 1 and per > 0")
        self.calls = calls
        self.per = per
        self.start: float | None = None
        self.used = 0

    def _roll(self, now: float) -> None:
        if self.start is None or now >= self.start + self.per:
            self.start, self.used = now, 0

    def wait(self, now: float) -> float:
        """0.0 when a call fits in the current window, else the seconds until it ends."""
        self._roll(now)
        if self.used < self.calls:
            return 0.0
        assert self.start is not None
        return self.start + self.per - now

    def spend(self, now: float) -> None:
        self._roll(now)
        self.used += 1


class ConnectionCounter:
    """Open client connections, in total, per source address until identified, and per identity
    (once the identity is known)."""

    def __init__(self) -> None:
        self.open: set[str] = set()  # client connection ids
        self.identity_of: dict[str, str] = {}  # client connection id -> identity it counts for
        self.per_identity: dict[str, int] = {}
        self.source_of: dict[str, str] = {}  # unidentified connection id -> its source address
        self.unidentified: dict[str, int] = {}  # source address -> unidentified connections

    @property
    def total(self) -> int:
        return len(self.open)

    def connected(self, client_id: str, limit: int | None, source: str | None = None,
                  per_source: int | None = None) -> bool:
        """Count a new client connection; False when it is over the total limit, or its source
        over `per_source` unidentified connections (it is still counted until
        `disconnected`)."""
        self.open.add(client_id)
        over_source = False
        if source is not None:
            self.source_of[client_id] = source
            n = self.unidentified[source] = self.unidentified.get(source, 0) + 1
            over_source = per_source is not None and n > per_source
        return not over_source and (limit is None or len(self.open) <= limit)

    def _unpend(self, client_id: str) -> None:
        _release(self.unidentified, self.source_of.pop(client_id, None))

    def identify(self, client_id: str, identity: str, limit: int | None) -> bool:
        """Count the connection for `identity` (once); False when over the identity's limit,
        and then it is not counted for it."""
        if client_id in self.identity_of:
            return True
        n = self.per_identity.get(identity, 0)
        if limit is not None and n >= limit:
            return False
        self.identity_of[client_id] = identity
        self.per_identity[identity] = n + 1
        self._unpend(client_id)
        return True

    def disconnected(self, client_id: str) -> None:
        self.open.discard(client_id)
        self._unpend(client_id)
        _release(self.per_identity, self.identity_of.pop(client_id, None))


def _release(counts: dict[str, int], key: str | None) -> None:
    """One fewer for `key` (None: nothing counted); a count that reaches 0 is removed."""
    if key is None:
        return
    n = counts.get(key, 1) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class Limiter:
    """The process's rate, budget and connection state, judged against the flags and the
    policy's per-identity `limits:` and per-secret `budget:`."""

    def __init__(self, config: LimitsConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._buckets: dict[str, tuple[tuple[float, int], TokenBucket]] = {}
        self._budgets: dict[str, tuple[SecretBudget, WindowBudget]] = {}
        self.connections = ConnectionCounter()

    # ------------------------------------------------------------------ connections

    def connected(self, client_id: str, source: str | None = None) -> bool:
        return self.connections.connected(client_id, self.config.max_connections, source,
                                          self.config.max_unidentified_per_source)

    def over_source(self, source: str) -> bool:
        """Is `source` over its unidentified connections (the last one counted included)?"""
        limit = self.config.max_unidentified_per_source
        return limit is not None and self.connections.unidentified.get(source, 0) > limit

    def disconnected(self, client_id: str) -> None:
        self.connections.disconnected(client_id)

    def connection_limit(self, limits: IdentityLimits | None) -> int | None:
        """The identity's open connections limit: its policy `limits:`, else the flag."""
        if limits is not None and limits.max_connections is not None:
            return limits.max_connections
        return self.config.max_connections_per_identity

    def identified(self, client_id: str, identity: str, limits: IdentityLimits | None) -> None:
        limit = self.connection_limit(limits)
        if not self.connections.identify(client_id, identity, limit):
            raise too_many_connections(identity, limit)

    # ------------------------------------------------------------------ request rate

    def rate(self, limits: IdentityLimits | None) -> tuple[float, int] | None:
        """The identity's (rps, burst): its policy `limits:`, else the flags; None: no limit."""
        rps, burst = self.config.rps, self.config.burst
        if limits is not None and limits.rps is not None:
            rps, burst = limits.rps, limits.burst
        elif limits is not None and limits.burst is not None:
            burst = limits.burst
        if rps is None:
            return None
        return rps, burst if burst is not None else default_burst(rps)

    def admit(self, identity: str, limits: IdentityLimits | None) -> None:
        """One request of `identity`: refused (429 rate_limited) when its bucket is empty."""
        rate = self.rate(limits)
        if rate is None:
            self._buckets.pop(identity, None)
            return
        now = self.clock()
        held = self._buckets.get(identity)
        if held is None or held[0] != rate:  # new, or the policy changed the rate: start full
            held = self._buckets[identity] = (rate, TokenBucket(rate[0], rate[1], now))
        wait = held[1].take(now)
        if wait > 0:
            raise rate_limited(identity, rate, wait)

    # ------------------------------------------------------------------ secret budgets

    def spend(self, budgets: Iterable[tuple[str, SecretBudget | None]]) -> None:
        """One injection of each secret: all of them fit their budgets, or none is spent and
        429 budget_exhausted is raised."""
        now = self.clock()
        held: list[WindowBudget] = []
        for name, budget in budgets:
            if budget is None:
                self._budgets.pop(name, None)
                continue
            cur = self._budgets.get(name)
            if cur is None or cur[0] != budget:
                cur = self._budgets[name] = (budget, WindowBudget(budget.calls, budget.per))
            wait = cur[1].wait(now)
            if wait > 0:
                raise budget_exhausted(name, budget, wait)
            held.append(cur[1])
        for b in held:
            b.spend(now)

    def forget(self, identities: Iterable[str], secrets: Iterable[str]) -> None:
        """After a reload: drop the state of identities and secrets the policy no longer has."""
        keep_i, keep_s = set(identities), set(secrets)
        for k in [k for k in self._buckets if k not in keep_i]:
            del self._buckets[k]
        for k in [k for k in self._budgets if k not in keep_s]:
            del self._budgets[k]
