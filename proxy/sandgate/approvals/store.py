"""Where approvals and remembered grants live: the `ApprovalStore` protocol and the in-process
store (one `sandgate run`, or one worker). The Redis store (redis_approvals.py) is the same protocol
over shared state, so any replica can decide a request another one holds.

Every change to an approval goes through `update` (read, apply a pure function, write: atomic
per approval), and every change is announced to `changes()` subscribers (the holding request
waits on it; `sandgate approvals watch` streams it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from sandgate.approvals.votes import Approval, Grant, grant_key

Change = Callable[[Approval], Approval]


@dataclass(frozen=True, slots=True)
class Subscription:
    """A stream of changed approvals: `get()` the next one, `aclose()` to stop."""

    get: Callable[[], Awaitable[Approval]]
    aclose: Callable[[], Awaitable[None]]


class ApprovalStore(Protocol):
    async def create(self, a: Approval) -> None:
        """Store a new pending approval (kept until a while after it expires)."""

    async def get(self, approval_id: str) -> Approval | None: ...

    async def pending(self) -> list[Approval]:
        """Pending approvals not yet past their expiry, oldest first."""

    async def update(self, approval_id: str, change: Change) -> Approval | None:
        """Apply `change` atomically (it may raise to refuse); None: no such approval."""

    async def find(self, fingerprint: str) -> Approval | None:
        """The newest approval of an identical request (mode async), in any state."""

    async def add_grant(self, g: Grant) -> None: ...

    async def grant(self, rule: str, identity: str, sandbox: str | None,
                    headers_sha256: str, now: float) -> Grant | None:
        """A remembered grant for this rule, caller (sandbox scope first) and forwarded headers'
        digest, if unexpired."""

    async def subscribe(self) -> Subscription:
        """Every approval created or changed from now on (on any replica, for shared stores):
        subscribed when this returns."""

    async def aclose(self) -> None: ...


# How long a decided approval stays readable (GET /v1/approvals/{id}, async retries).
KEEP_DECIDED = 24 * 3600


class MemoryStore:
    """The in-process store: dicts, and a queue per subscriber."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._approvals: dict[str, Approval] = {}
        self._by_fp: dict[str, str] = {}
        self._grants: dict[str, Grant] = {}
        self._subs: set[asyncio.Queue[Approval]] = set()
        self._clock = clock

    def _publish(self, a: Approval) -> None:
        for q in list(self._subs):
            q.put_nowait(a)

    def _sweep(self) -> None:
        now = self._clock()
        for k, a in list(self._approvals.items()):
            if a.expires + KEEP_DECIDED < now:
                del self._approvals[k]
                if self._by_fp.get(a.fingerprint) == k:
                    del self._by_fp[a.fingerprint]
        for k, g in list(self._grants.items()):
            if g.expires <= now:
                del self._grants[k]

    async def create(self, a: Approval) -> None:
        self._sweep()
        self._approvals[a.id] = a
        self._by_fp[a.fingerprint] = a.id
        self._publish(a)

    async def get(self, approval_id: str) -> Approval | None:
        return self._approvals.get(approval_id)

    async def pending(self) -> list[Approval]:
        now = self._clock()
        return sorted((a for a in self._approvals.values()
                       if a.state == "pending" and a.expires > now), key=lambda a: a.created)

    async def update(self, approval_id: str, change: Change) -> Approval | None:
        a = self._approvals.get(approval_id)
        if a is None:
            return None
        new = change(a)  # synchronous: nothing else runs in between
        if new is not a:
            self._approvals[approval_id] = new
            self._publish(new)
        return new

    async def find(self, fingerprint: str) -> Approval | None:
        k = self._by_fp.get(fingerprint)
        return self._approvals.get(k) if k is not None else None

    async def add_grant(self, g: Grant) -> None:
        self._grants[g.key] = g

    async def grant(self, rule: str, identity: str, sandbox: str | None,
                    headers_sha256: str, now: float) -> Grant | None:
        for sb in ((sandbox, None) if sandbox is not None else (None,)):
            g = self._grants.get(grant_key(rule, identity, sb, headers_sha256))
            if g is not None and g.expires > now:
                return g
        return None

    async def subscribe(self) -> Subscription:
        q: asyncio.Queue[Approval] = asyncio.Queue()
        self._subs.add(q)

        async def close() -> None:
            self._subs.discard(q)

        return Subscription(q.get, close)

    async def aclose(self) -> None:
        return None
