"""`Counts` for the fleet: rates, connections per identity and secret budgets on Redis.

Every decision is one Lua script (sandgate.state.scripts) run atomically on the server with the
server's clock; Python sends arguments and reads the verdict. Keys (under `--state-prefix`):

    rate:<identity>:<rps>:<burst>       token bucket (hash); expires once it would be full
    budget:<secret>:<calls>:<per>       calls in the current window; expires when it ends
    spend:<budget>:<scope>:<who>:<limits>:<per>   an LLM budget's window (hash: scripts.py)
    conns:<identity>                    hash process -> open connections
    proc:<process>                      the process's lease, refreshed by its heartbeat

The limits are part of the rate and budget keys, so a reload that changes a limit starts a
fresh count, as a single process does, and two replicas briefly serving different policies
never reset each other's counts.

Bounded waits: each call waits at most `--state-timeout` (a slow answer fails that request
only); a failed connection marks the state down (sandgate.state.health), and later requests do
not wait on it until the heartbeat sees it back.
A budget call that timed out may still have been counted by the server: it errs on the side of
fewer calls forwarded, never more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from sandgate.errors import StateUnavailable, Unavailable
from sandgate.limits import Limiter, budget_exhausted, rate_limited, too_many_connections
from sandgate.llm.spend import (
    UNKNOWN_MODEL,
    Amounts,
    Reservation,
    WindowView,
    budget_key,
    limits_of,
    parse_budget_key,
    spend_exhausted,
)
from sandgate.policy.model import Budget, IdentityLimits, SecretBudget
from sandgate.state import StateConfig, scripts
from sandgate.state.health import StateHealth

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from sandgate.state.fleet import Fleet

log = logging.getLogger("sandgate.state")


class StateDown(Unavailable):
    """The state did not answer (or is known to be down): the caller decides what that means."""


def down_reason(cfg: StateConfig) -> str:
    return (f"Sandgate's shared state ({cfg.url.redacted()}) did not answer within "
            f"{cfg.timeout:g}s")


class RedisCounts:
    def __init__(self, r: aioredis.Redis, cfg: StateConfig, limiter: Limiter,
                 health: StateHealth, process: str, fleet: Fleet | None = None) -> None:
        self.r = r
        self.cfg = cfg
        self.limiter = limiter  # the fallback while the state is down; raw admission always
        self.health = health
        self.process = process
        self.fleet = fleet
        self._rate = r.register_script(scripts.RATE)
        self._budget = r.register_script(scripts.BUDGET)
        self._reserve = r.register_script(scripts.SPEND_RESERVE)
        self._settle = r.register_script(scripts.SPEND_SETTLE)
        self._acquire = r.register_script(scripts.CONN_ACQUIRE)
        self._release = r.register_script(scripts.CONN_RELEASE)
        self.leased: dict[str, str] = {}  # client id -> conns key it is counted under
        self._unreleased: list[str] = []  # releases that failed: retried on recovery
        self._tasks: set[asyncio.Task[Any]] = set()
        health.listeners.append(self._availability)

    # ------------------------------------------------------------------ calls

    async def call(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script, within the timeout; StateDown when it cannot be had."""
        if not self.health.available:
            raise StateDown()
        try:
            return await asyncio.wait_for(script(keys=list(keys), args=list(args)),
                                          self.cfg.timeout)
        except TimeoutError:  # slow: this request is not served; the heartbeat judges health
            raise StateDown() from None
        except (RedisError, OSError) as e:
            if not isinstance(e, RedisTimeout):
                self.health.down(e)
            raise StateDown() from None

    def _closed(self) -> StateUnavailable:
        return StateUnavailable(down_reason(self.cfg) + " (--state-fail closed)")

    # ------------------------------------------------------------------ rates

    async def admit(self, identity: str, limits: IdentityLimits | None) -> None:
        rate = self.limiter.rate(limits)
        if rate is None:
            return
        key = self.cfg.key("rate", identity, f"{rate[0]:g}", str(rate[1]))
        try:
            wait = float(await self.call(self._rate, [key], [rate[0], rate[1]]))
        except StateDown:
            if self.cfg.fail == "closed":
                raise self._closed() from None
            self.limiter.admit(identity, limits)  # per process while the state is down
            return
        if wait > 0:
            raise rate_limited(identity, rate, wait)

    # ------------------------------------------------------------------ budgets

    async def spend(self, budgets: Sequence[tuple[str, SecretBudget | None]]) -> None:
        held = [(n, b) for n, b in budgets if b is not None]
        if not held:
            return
        keys = [self.cfg.key("budget", n, str(b.calls), f"{b.per:g}") for n, b in held]
        args: list[Any] = []
        for _, b in held:
            args += [b.calls, max(1, round(b.per * 1000))]
        try:
            index, left_ms = await self.call(self._budget, keys, args)
        except StateDown:  # a budget is never counted per process: fail closed
            raise StateUnavailable(down_reason(self.cfg) + ": a secret budget cannot be "
                                   "counted") from None
        if int(index):
            name, budget = held[int(index) - 1]
            raise budget_exhausted(name, budget, int(left_ms) / 1000)

    # ------------------------------------------------------------------ LLM spend

    async def reserve(self, budget: Budget, who: str, want: Amounts, identity: str = "",
                      model: str = UNKNOWN_MODEL) -> Reservation:
        key = self.cfg.key("spend", budget_key(budget, who))
        lim = limits_of(budget)
        args = [lim.input_tokens, lim.output_tokens, lim.cost_micros, want.input_tokens,
                want.output_tokens, want.cost_micros, budget.per * 1000, identity or who]
        try:
            refused, value = await self.call(self._reserve, [key], args)
        except StateDown:  # never counted per process: fail closed
            raise StateUnavailable(down_reason(self.cfg) + ": an LLM budget cannot be "
                                   "counted") from None
        if int(refused):
            raise spend_exhausted(budget, who, int(value) / 1000)
        window = value.decode() if isinstance(value, bytes) else str(value)
        return Reservation(key, window, want, model)

    async def settle(self, res: Reservation, actual: Amounts) -> None:
        d, r = actual.minus(res.reserved), res.reserved
        try:
            await self.call(self._settle, [res.key],
                            [res.window, d.input_tokens, d.output_tokens, d.cost_micros,
                             r.input_tokens, r.output_tokens, r.cost_micros, res.model,
                             actual.input_tokens, actual.output_tokens, actual.cost_micros])
        except StateDown:  # the worst case stays counted: fewer calls, never more
            log.warning("sandgate: an LLM budget's settlement was not counted (state down)")

    async def open_windows(self) -> list[WindowView]:
        """The fleet's open budget windows (SCAN of this fleet's `spend:` keys: at most
        MAX_WINDOWS shown)."""
        prefix = self.cfg.key("spend", "")
        out: list[WindowView] = []
        try:
            async with asyncio.timeout(self.cfg.timeout * 4):
                async for raw in self.r.scan_iter(match=_glob_escape(prefix) + "*", count=500):
                    key = raw.decode() if isinstance(raw, bytes) else str(raw)
                    held = {_text(k): _text(v) for k, v in (await self.r.hgetall(raw)).items()}
                    view = window_view(key[len(prefix):], held, await self.r.pttl(raw))
                    if view is not None:
                        out.append(view)
                    if len(out) >= MAX_WINDOWS:
                        break
        except (TimeoutError, RedisError, OSError):
            raise StateUnavailable(down_reason(self.cfg) + ": the budget windows cannot be "
                                   "read") from None
        return sorted(out, key=lambda v: (v.budget, v.scope, v.who))

    # ------------------------------------------------------------------ connections

    async def identified(self, client_id: str, identity: str,
                         limits: IdentityLimits | None) -> None:
        conns = self.limiter.connections
        if client_id in conns.identity_of:
            return
        limit = self.limiter.connection_limit(limits)
        if limit is None:
            conns.identify(client_id, identity, None)
            return
        key = self.cfg.key("conns", identity)
        try:
            ok = await self.call(self._acquire, [key],
                                 [self.process, limit, self.cfg.key("proc", "")])
        except StateDown:
            if self.cfg.fail == "closed":
                raise self._closed() from None
            self.limiter.identified(client_id, identity, limits)  # per process meanwhile
            return
        if not int(ok):
            raise too_many_connections(identity, limit)
        if client_id not in conns.open or client_id in conns.identity_of:
            self._spawn(self._give_back(key))  # closed, or counted by another of its flows
            return
        conns.identify(client_id, identity, None)
        self.leased[client_id] = key

    def disconnected(self, client_id: str) -> None:
        self.limiter.disconnected(client_id)
        key = self.leased.pop(client_id, None)
        if key is not None:
            self._spawn(self._give_back(key))

    async def _give_back(self, key: str) -> None:
        try:
            await self.call(self._release, [key], [self.process])
        except StateDown:
            self._unreleased.append(key)

    def _availability(self, available: bool) -> None:
        if available and self._unreleased:
            keys, self._unreleased = self._unreleased, []
            for key in keys:
                self._spawn(self._give_back(key))

    def _spawn(self, coro: Awaitable[None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ sandboxes

    async def sandbox_ended(self, sandbox: str) -> bool:
        if self.fleet is None:
            return False
        return await self.fleet.sandbox_ended(sandbox)


# The spend view shows at most this many windows (a fleet with more budget windows open than
# this is read in part: the view says how many it shows).
MAX_WINDOWS = 2000


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis glob."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _text(v: bytes | str) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def window_view(key: str, fields: dict[str, str], ttl_ms: int) -> WindowView | None:
    """One budget window's hash as the spend view shows it (None: not a window's)."""
    parts = parse_budget_key(key)
    if parts is None or "w" not in fields:
        return None
    name, scope, who, lim, per = parts

    def n(field: str) -> int:
        try:
            return int(fields.get(field, "0"))
        except ValueError:
            return 0

    models: dict[str, list[int]] = {}
    for f in fields:
        if f.startswith("m:") and f[-2:] in (":i", ":o", ":c"):
            models.setdefault(f[2:-2], [0, 0, 0])["ioc".index(f[-1])] = n(f)
    identity = fields.get("id") or who
    return WindowView(name, scope, who, identity, lim, per, max(0.0, ttl_ms / 1000),
                      Amounts(n("i"), n("o"), n("c")), Amounts(n("ri"), n("ro"), n("rc")),
                      {m: Amounts(*a) for m, a in models.items()}, shared=True)
