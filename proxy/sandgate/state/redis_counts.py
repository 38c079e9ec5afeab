"""`Counts` for the fleet: rates, connections per identity and secret budgets on Redis.

Every decision is one Lua script (sandgate.state.scripts) run atomically on the server with the
server's clock; Python sends arguments and reads the verdict. Keys (under `--state-prefix`):

    rate:<identity>:<rps>:<burst>       token bucket (hash); expires once it would be full
    budget:<secret>:<calls>:<per>       calls in the current window; expires when it ends
    spend:<budget>:<scope>:<who>:<limits>:<per>   an LLM budget's window (hash w, i, o, c)
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
from sandgate.llm.spend import Amounts, Reservation, budget_key, limits_of, spend_exhausted
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

    async def reserve(self, budget: Budget, who: str, want: Amounts) -> Reservation:
        key = self.cfg.key("spend", budget_key(budget, who))
        lim = limits_of(budget)
        args = [lim.input_tokens, lim.output_tokens, lim.cost_micros, want.input_tokens,
                want.output_tokens, want.cost_micros, budget.per * 1000]
        try:
            refused, value = await self.call(self._reserve, [key], args)
        except StateDown:  # never counted per process: fail closed
            raise StateUnavailable(down_reason(self.cfg) + ": an LLM budget cannot be "
                                   "counted") from None
        if int(refused):
            raise spend_exhausted(budget, who, int(value) / 1000)
        window = value.decode() if isinstance(value, bytes) else str(value)
        return Reservation(key, window, want)

    async def settle(self, res: Reservation, actual: Amounts) -> None:
        d = actual.minus(res.reserved)
        try:
            await self.call(self._settle, [res.key],
                            [res.window, d.input_tokens, d.output_tokens, d.cost_micros])
        except StateDown:  # the worst case stays counted: fewer calls, never more
            log.warning("sandgate: an LLM budget's settlement was not counted (state down)")

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
