"""Spend: what an LLM call costs, and the budgets it is counted against.

A call on a rule whose `llm.budget` names a `budgets:` entry *reserves* its worst case before
it is forwarded (its output cap, and its body's size in bytes as its input tokens: no tokenizer
makes more tokens than bytes of text) and *settles* its real usage (sandgate.llm.llmcall) when it
ends, giving back what it did not use. A reservation is admitted while the window has anything
left of every limit it counts (reservations in flight included): so a window's spend passes its
limit by at most the worst case of the one call admitted last, across every replica sharing the
state. A stream is never cut for budget: the next call is refused (429 spend_exhausted with
Retry-After).

Counted per process (`SpendWindows`, embedded in sandgate.state.local), or atomically in Redis
with `--state` (sandgate.state.scripts SPEND_RESERVE / SPEND_SETTLE). Cost is counted in
micro-dollars (integers), priced by the policy's `prices:` first, then the shipped table
(data/prices.yaml); a budget counting cost refuses a model with no price (fail closed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Protocol

import yaml

from sandgate.errors import Code, LimitExceeded
from sandgate.llm.llmcall import Api, LlmCall, Usage, UsageReader
from sandgate.policy.model import Budget, Price, glob_matches

log = logging.getLogger("sandgate")


@functools.lru_cache(maxsize=1)
def shipped_prices() -> tuple[Price, ...]:
    """The price table shipped with Sandgate (proxy/sandgate/data/prices.yaml)."""
    text = resources.files("sandgate").joinpath("data/prices.yaml").read_text()
    return tuple(Price(model=str(e["model"]), input=float(e["input"]),
                       output=float(e["output"]),
                       cached_input=float(e["cached_input"]) if "cached_input" in e else None)
                 for e in yaml.safe_load(text))


# Per call, the price and the model's label are looked up by glob over the policy's and the
# shipped prices: memoised (bounded: a sandbox chooses the model strings; a reload brings new
# `prices` tuples, which are part of the key).
@functools.lru_cache(maxsize=4096)
def price_of(overrides: tuple[Price, ...], model: str | None) -> Price | None:
    """The first price whose glob matches the model: the policy's, then the shipped ones."""
    if model is None:
        return None
    for p in (*overrides, *shipped_prices()):
        if glob_matches(p.model, model):
            return p
    return None


def cost_micros(price: Price | None, usage: Usage) -> int:
    """Micro-dollars (rounded up) the usage costs; 0 without a price."""
    if price is None:
        return 0
    cached = min(usage.cached_tokens, usage.input_tokens)
    cached_rate = price.input if price.cached_input is None else price.cached_input
    # USD per million tokens is micro-dollars per token
    return math.ceil((usage.input_tokens - cached) * price.input + cached * cached_rate
                     + usage.output_tokens * price.output)


@dataclass(frozen=True, slots=True)
class Amounts:
    """What a call counts against a budget: tokens and micro-dollars."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0

    def minus(self, other: Amounts) -> Amounts:
        return Amounts(self.input_tokens - other.input_tokens,
                       self.output_tokens - other.output_tokens,
                       self.cost_micros - other.cost_micros)


def amounts(usage: Usage, price: Price | None) -> Amounts:
    return Amounts(usage.input_tokens, usage.output_tokens, cost_micros(price, usage))


def worst_case(call: LlmCall, cap: int) -> Usage:
    """The most a call can spend: every byte of its body an input token, its whole cap."""
    return Usage(input_tokens=call.input_bytes, output_tokens=cap)


@functools.lru_cache(maxsize=1024)
def limits_of(budget: Budget) -> Amounts:
    """The budget's limits as Amounts (-1: not limited)."""
    return Amounts(
        -1 if budget.input_tokens is None else budget.input_tokens,
        -1 if budget.output_tokens is None else budget.output_tokens,
        -1 if budget.cost_usd is None else math.floor(budget.cost_usd * 1_000_000))


@functools.lru_cache(maxsize=4096)  # per call; bounded (a sandbox id is the caller's string)
def budget_key(budget: Budget, who: str) -> str:
    """The counter of one budget for one identity or sandbox. Its limits are part of it, so a
    reload that changes them starts a fresh count (as secret budgets do)."""
    lim = limits_of(budget)
    return (f"{budget.name}:{budget.scope}:{who}:{lim.input_tokens}:{lim.output_tokens}:"
            f"{lim.cost_micros}:{budget.per}")


def spend_exhausted(budget: Budget, who: str, wait: float) -> LimitExceeded:
    return LimitExceeded(
        Code.SPEND_EXHAUSTED, f"budget '{budget.name}' of {budget.scope} {who!r} is spent for "
        f"this window ({budget.per}s)", hint="nothing was sent upstream; retry after the "
        "Retry-After seconds, or ask the operator to raise the budget",
        retry_after=max(1, math.ceil(wait)))


UNKNOWN_MODEL = "unknown"


@dataclass(frozen=True, slots=True)
class Reservation:
    """A reserved worst case: the counter, the window it went into, and how much (and the
    policy's name for the call's model, under which its spend is shown: sandgate.console)."""

    key: str
    window: str  # the window's id: a settlement after it ended changes nothing
    reserved: Amounts
    model: str = UNKNOWN_MODEL


@functools.lru_cache(maxsize=4096)
def model_label(globs: tuple[str, ...], prices: tuple[Price, ...], model: str | None) -> str:
    """The policy's name for a call's model: the first of the rule's `llm.models` globs that
    matches it, else the price glob it is priced by, else `unknown` (never the string a
    sandbox sent: the spend view's and the metrics' labels stay bounded by the policy)."""
    if model is None:
        return UNKNOWN_MODEL
    found = next((g for g in globs if glob_matches(g, model)), None)
    if found is not None:
        return found
    price = price_of(prices, model)
    return price.model if price is not None else UNKNOWN_MODEL


@dataclass(frozen=True, slots=True)
class WindowView:
    """One budget window as the console's spend view shows it: what the window has counted
    (`used`: settled spend and the reservations in flight), of which `reserved` is in flight,
    and the settled spend per model (the policy's name for it)."""

    budget: str
    scope: str  # identity or sandbox
    who: str  # the identity or sandbox counted
    identity: str  # the identity whose call opened the window
    limits: Amounts  # -1: not limited
    per: int
    ends_in: float  # seconds until the window ends
    used: Amounts
    reserved: Amounts
    models: dict[str, Amounts]
    shared: bool = False  # counted in the fleet's state (every replica sees the same window)

    def doc(self) -> dict[str, object]:
        def amounts_doc(a: Amounts) -> dict[str, object]:
            return {"input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
                    "cost_usd": round(a.cost_micros / 1_000_000, 6)}

        lim = self.limits
        return {"budget": self.budget, "scope": self.scope, "who": self.who,
                "identity": self.identity, "per": self.per, "ends_in": round(self.ends_in, 1),
                "limits": {"input_tokens": None if lim.input_tokens < 0 else lim.input_tokens,
                           "output_tokens": None if lim.output_tokens < 0
                           else lim.output_tokens,
                           "cost_usd": None if lim.cost_micros < 0
                           else round(lim.cost_micros / 1_000_000, 6)},
                "used": amounts_doc(self.used), "reserved": amounts_doc(self.reserved),
                "models": {m: amounts_doc(a) for m, a in sorted(self.models.items())},
                "shared": self.shared}


def parse_budget_key(key: str) -> tuple[str, str, str, Amounts, int] | None:
    """budget_key's parts: name, scope, who, limits, per (None: not one of its keys). The
    name and scope come first, the limits and window last: `who` is what is between."""
    parts = key.split(":")
    if len(parts) < 7:
        return None
    try:
        lim = Amounts(int(parts[-4]), int(parts[-3]), int(parts[-2]))
        per = int(parts[-1])
    except ValueError:
        return None
    return parts[0], parts[1], ":".join(parts[2:-4]), lim, per


@dataclass(slots=True)
class _Window:
    start: float
    end: float
    identity: str
    id: str  # `start` as the reservations name it (formatted once, not per call)
    used: list[int] = field(default_factory=lambda: [0, 0, 0])
    reserved: list[int] = field(default_factory=lambda: [0, 0, 0])
    models: dict[str, list[int]] = field(default_factory=dict)


class SpendWindows:
    """One process's budget windows: a window starts at its first call and lasts `per`."""

    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def reserve(self, key: str, budget: Budget, who: str, want: Amounts,
                now: float | None = None, identity: str = "", model: str = UNKNOWN_MODEL
                ) -> Reservation:
        now = time.monotonic() if now is None else now
        cur = self._windows.get(key)
        if cur is None or cur.end <= now:
            if len(self._windows) > 100_000:  # bounded: ended windows go first
                for k in [k for k, w in self._windows.items() if w.end <= now]:
                    del self._windows[k]
            cur = self._windows[key] = _Window(now, now + budget.per, identity or who,
                                               f"{now!r}")
        lim = limits_of(budget)
        for u, cap in zip(cur.used, (lim.input_tokens, lim.output_tokens, lim.cost_micros),
                          strict=True):
            if cap >= 0 and u >= cap:
                raise spend_exhausted(budget, who, cur.end - now)
        for i, n in enumerate((want.input_tokens, want.output_tokens, want.cost_micros)):
            cur.used[i] += n
            cur.reserved[i] += n
        return Reservation(key, cur.id, want, model)

    def settle(self, res: Reservation, actual: Amounts) -> None:
        cur = self._windows.get(res.key)
        if cur is None or cur.id != res.window:
            return  # the window ended: its successor owes nothing
        d = actual.minus(res.reserved)
        spent = cur.models.setdefault(res.model, [0, 0, 0])
        for i, (dn, r, a) in enumerate(zip(
                (d.input_tokens, d.output_tokens, d.cost_micros),
                (res.reserved.input_tokens, res.reserved.output_tokens,
                 res.reserved.cost_micros),
                (actual.input_tokens, actual.output_tokens, actual.cost_micros), strict=True)):
            cur.used[i] = max(0, cur.used[i] + dn)
            cur.reserved[i] = max(0, cur.reserved[i] - r)
            spent[i] += a

    def used(self, key: str) -> Amounts | None:
        cur = self._windows.get(key)
        return None if cur is None else Amounts(*cur.used)

    def views(self, now: float | None = None) -> list[WindowView]:
        """The windows still open, for the console's spend view."""
        now = time.monotonic() if now is None else now
        out: list[WindowView] = []
        for key, w in self._windows.items():
            parts = parse_budget_key(key)
            if parts is None or w.end <= now:
                continue
            name, scope, who, lim, per = parts
            out.append(WindowView(name, scope, who, w.identity, lim, per, w.end - now,
                                  Amounts(*w.used), Amounts(*w.reserved),
                                  {m: Amounts(*a) for m, a in w.models.items()}))
        return sorted(out, key=lambda v: (v.budget, v.scope, v.who))


@dataclass(slots=True)
class LlmFlow:
    """One LLM call through the proxy: what it asked, what it reserved, what it spent."""

    api: Api
    call: LlmCall | None = None
    drop_usage_chunk: bool = False  # Sandgate asked for OpenAI's usage chunk: taken out again
    reader: UsageReader | None = None
    budget: Budget | None = None
    price: Price | None = None
    reservation: Reservation | None = None
    settled: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def usage(self) -> Usage | None:
        return self.reader.usage if self.reader is not None else None

    def doc(self, prices: tuple[Price, ...] = ()) -> dict[str, object]:
        """The audit's `llm` field: the call, its usage and cost (USD), its budget."""
        c = self.call
        out: dict[str, object] = {"api": self.api}
        if c is not None:
            out.update(model=c.model, max_tokens=c.max_tokens, stream=c.stream)
        u = self.usage
        if u is not None:
            out["usage"] = u.doc()
            price = self.price or price_of(prices, c.model if c else None)
            if price is not None:
                out["cost_usd"] = round(cost_micros(price, u) / 1_000_000, 6)
        if self.budget is not None:
            out["budget"] = self.budget.name
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def settlement(llm: LlmFlow | None, never_sent: bool) -> tuple[Reservation, Amounts] | None:
    """What settles the call's reservation (once; None: nothing to settle): what the answer
    says it spent; nothing when it was `never_sent` upstream; its worst case (what it
    reserved: the count does not change, the call is no longer in flight) for an answer
    without readable usage or an upstream failure."""
    if llm is None or llm.reservation is None or llm.settled:
        return None
    llm.settled = True
    usage = llm.usage
    if usage is None:
        if not never_sent:
            return llm.reservation, llm.reservation.reserved
        usage = Usage()
    return llm.reservation, amounts(usage, llm.price)


class Settles(Protocol):
    """What `settle` needs of the counting (sandgate.state.counts.Counts has it): one call."""

    async def settle(self, res: Reservation, actual: Amounts) -> None: ...


def settle(counts: Settles, llm: LlmFlow | None, never_sent: bool) -> None:
    """Settle the call's reservation (see `settlement`): in place when this process counts
    (the counts' `settle_now`), else in a task: the proxy's hooks that end a flow (response,
    error) cannot wait for the state. Started in the response hook, before the client is
    sent the end of the answer; a later reservation of the same budget in this process waits
    for it (`settled`), so a client's next call always finds this one settled."""
    todo = settlement(llm, never_sent)
    if todo is None:
        return
    now = getattr(counts, "settle_now", None)
    if now is not None:  # counted in this process: settled in place, no task to start
        try:
            now(*todo)
        except Exception:
            log.exception("sandgate: settling an LLM budget failed; its worst case stays")
        return

    async def run() -> None:
        try:
            await counts.settle(*todo)
        except Exception:
            log.exception("sandgate: settling an LLM budget failed; its worst case stays")

    key = todo[0].key
    task = asyncio.ensure_future(run())
    if task.done():
        # run eagerly to its end (the proxy's loop starts tasks eagerly; a per-process count
        # never suspends): nothing to wait for, and nothing for `settled` to suspend on
        return
    _pending.setdefault(key, set()).add(task)

    def done(t: asyncio.Future[None]) -> None:
        held = _pending.get(key)
        if held is not None:
            held.discard(t)
            if not held:
                del _pending[key]

    task.add_done_callback(done)


async def settled(key_of: str) -> None:
    """The settlements of this budget counter started so far in this process, done (each is
    one short state call; a failing one only logs)."""
    if not _pending:
        return
    # only those still running: awaiting a finished one would suspend the request's hook for
    # a turn of the loop (gather answers through callbacks), sending it around mitmproxy's
    # hook machinery instead of completing in place
    held = [t for k, tasks in list(_pending.items()) if k.endswith(key_of) for t in tasks
            if not t.done()]
    if held:
        await asyncio.gather(*held, return_exceptions=True)


_pending: dict[str, set[asyncio.Future[None]]] = {}  # reservation key -> settlements running
