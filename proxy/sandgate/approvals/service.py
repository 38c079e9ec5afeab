"""The approvals of one Sandgate process: asking (the proxy's ask stage), deciding (the admin
API), remembering, auditing and announcing, over an `ApprovalStore`.

One subscription to the store's changes feeds every waiter: a held request registers a future
under its approval id before it looks at the store, so a decision made anywhere (this process,
another worker, another replica sharing Redis) wakes it, and none slips between the look and the
wait. Limits: at most `max_pending_per_identity` pending approvals per identity and
`max_pending` in all (429 too_many_pending / 503 approvals_full past them), so no sandbox can
hold the proxy's connections or fill the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from sandgate.approvals.store import ApprovalStore, Subscription
from sandgate.approvals.votes import (
    Approval,
    VoteError,
    fingerprint,
    grant_for,
    new_id,
    parse_scope,
    vote,
)
from sandgate.errors import ApprovalRefused, Code
from sandgate.policy.model import Policy, Rule

log = logging.getLogger("sandgate.approvals")

AUDIT_EVENT = "approval"
ASYNC_RETRY_AFTER = 30  # seconds a 202 tells the client to wait before retrying
GONE_POLL = 1.0  # seconds between looks at a held request's client

Audit = Callable[..., None]
Notify = Callable[[Policy, Approval], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class AskLimits:
    max_pending_per_identity: int = 20
    max_pending: int = 200


@dataclass(frozen=True, slots=True)
class Request:
    """What is asked about, as the ask stage read it (nothing secret: the URL is redacted, the
    headers scrubbed; the full URL goes only into the fingerprint's hash)."""

    identity: str
    sandbox: str | None
    method: str
    url: str  # redacted
    full_url: str  # hashed into the fingerprint only
    host: str
    tool: str | None
    body_sha256: str
    body_size: int
    headers_sha256: str  # the forwarded headers the sandbox sent (approvals/bound_headers.py)
    headers: tuple[tuple[str, str], ...]  # the same, scrubbed: what approvers see
    headers_injected: tuple[str, ...]  # where the rule injects credentials (names only)


class Approvals:
    def __init__(self, store: ApprovalStore, audit: Audit | None = None,
                 instance: str = "sandgate", limits: AskLimits = AskLimits(),
                 notify: Notify | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.audit = audit
        self.instance = instance
        self.limits = limits
        self.notify = notify
        self.clock = clock
        self._waiters: dict[str, set[asyncio.Future[Approval]]] = {}
        self._listeners: set[asyncio.Queue[Approval]] = set()
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is None:
            self._sub = await self.store.subscribe()
            self._task = asyncio.ensure_future(self._pump())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        if self._sub is not None:
            await self._sub.aclose()
            self._sub = None
        for t in list(self._tasks):
            t.cancel()
        await self.store.aclose()

    async def _pump(self) -> None:
        assert self._sub is not None
        while True:
            try:
                a = await self._sub.get()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sandgate: approval change stream failed; resubscribing")
                await asyncio.sleep(1)
                with contextlib.suppress(Exception):
                    await self._sub.aclose()
                    self._sub = await self.store.subscribe()
                continue
            if a.state != "pending":
                for fut in self._waiters.pop(a.id, set()):
                    if not fut.done():
                        fut.set_result(a)
            for q in list(self._listeners):
                if q.qsize() < 1000:
                    q.put_nowait(a)

    def listen(self) -> asyncio.Queue[Approval]:
        """A queue of every approval created or changed from now on (`watch`)."""
        q: asyncio.Queue[Approval] = asyncio.Queue()
        self._listeners.add(q)
        return q

    def unlisten(self, q: asyncio.Queue[Approval]) -> None:
        self._listeners.discard(q)

    def _audit(self, action: str, a: Approval, **fields: Any) -> None:
        if self.audit is None:
            return
        self.audit(AUDIT_EVENT, action=action, approval=a.id, identity=a.identity,
                   sandbox=a.sandbox, method=a.method, url=a.url, rule=a.rule, tool=a.tool,
                   body_sha256=a.body_sha256, body_size=a.body_size,
                   headers_sha256=a.headers_sha256, **fields)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ asking (the proxy)

    async def ask(self, policy: Policy, rule: Rule, req: Request, reason: str,
                  gone: Callable[[], bool] | None = None) -> str:
        """Return when the request may go on (approved, or a remembered grant: returns how);
        raise ApprovalRefused otherwise (pending 202 in mode async, denied, timed out, limits).
        `gone`: has the client closed its connection? Then a held request's approval is
        withdrawn (nobody would get the answer, and nothing is sent for nobody)."""
        ask = rule.ask
        assert ask is not None
        await self.start()  # the change stream is up before any waiter registers
        now = self.clock()
        # a remembered grant covers the rule's requests with the headers that were approved
        g = await self.store.grant(rule.name, req.identity, req.sandbox, req.headers_sha256,
                                   now)
        if g is not None:
            if self.audit is not None:
                self.audit(AUDIT_EVENT, action="used", approval=g.approval,
                           identity=req.identity, sandbox=req.sandbox, method=req.method,
                           url=req.url, rule=rule.name, tool=req.tool,
                           body_sha256=req.body_sha256, body_size=req.body_size,
                           headers_sha256=req.headers_sha256,
                           grant="sandbox" if g.sandbox is not None else "identity",
                           approvers=list(g.approvers), grant_expires=g.expires)
            return f"remembered approval {g.approval}"
        fp = fingerprint(req.identity, req.sandbox, req.method, req.full_url, req.body_sha256,
                         req.headers_sha256)
        if ask.mode == "async":
            seen = await self.store.find(fp)
            if seen is not None:
                out = await self._async_retry(seen, now)
                if out is not None:
                    return out
        await self._check_limits(req.identity)
        a = Approval(
            id=new_id(), identity=req.identity, sandbox=req.sandbox, method=req.method,
            url=req.url, host=req.host, tool=req.tool, rule=rule.name,
            rule_source=str(rule.source), body_sha256=req.body_sha256, body_size=req.body_size,
            headers_sha256=req.headers_sha256, headers=req.headers,
            headers_injected=req.headers_injected, created=now, expires=now + ask.timeout,
            mode=ask.mode,
            require_approvers=ask.require_approvers, approvers=ask.approvers,
            remember=ask.remember, max_remember_ttl=ask.max_remember_ttl, fingerprint=fp,
            reason=(rule.meta.description if rule.meta and rule.meta.description else reason),
            replica=self.instance)
        fut: asyncio.Future[Approval] = asyncio.get_running_loop().create_future()
        if ask.mode == "hold":
            self._waiters.setdefault(a.id, set()).add(fut)
        try:
            await self.store.create(a)
            self._audit("requested", a, mode=a.mode, require_approvers=a.require_approvers,
                        timeout=ask.timeout)
            if self.notify is not None:
                self._spawn(self.notify(policy, a))  # never blocks the hold
            if ask.mode == "async":
                raise ApprovalRefused(
                    Code.APPROVAL_PENDING, f"the request awaits approval {a.id} (rule "
                    f"'{rule.name}'); it was not sent",
                    hint="send the identical request again once it is approved (same method, "
                    "URL, body and headers)", approval=a.id, retry_after=min(ASYNC_RETRY_AFTER,
                                                                    ask.timeout))
            return await self._hold(a, fut, gone)
        finally:
            waiters = self._waiters.get(a.id)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._waiters[a.id]

    async def _hold(self, a: Approval, fut: asyncio.Future[Approval],
                    gone: Callable[[], bool] | None) -> str:
        got: Approval | None = await self.store.get(a.id)
        while got is not None and got.state == "pending":
            remaining = a.expires - self.clock()
            if gone is not None and gone():
                got = await self.store.update(a.id, _expire(self.clock(), "withdrawn"))
                break
            try:  # look at the client once a second while waiting
                got = await asyncio.wait_for(asyncio.shield(fut),
                                             max(min(remaining, GONE_POLL), 0))
            except TimeoutError:
                if remaining <= GONE_POLL:
                    got = await self.store.update(a.id, _expire(self.clock()))
        out = self._outcome(got, a)  # raises unless approved
        await self.used(a.id)
        return out

    def _outcome(self, got: Approval | None, a: Approval) -> str:
        if got is None:  # vanished from the store (Redis flushed?): fail closed
            raise ApprovalRefused(Code.APPROVAL_TIMEOUT, f"approval {a.id} was lost before a "
                                  "decision", approval=a.id)
        if got.state == "withdrawn":
            self._audit("withdrawn", got)
            raise ApprovalRefused(Code.APPROVAL_TIMEOUT, f"approval {a.id} was withdrawn: the "
                                  "client closed its connection while it waited",
                                  approval=a.id)
        if got.state == "timeout":
            self._audit("timed_out", got, timeout=round(got.expires - got.created))
            raise ApprovalRefused(
                Code.APPROVAL_TIMEOUT, f"nobody decided approval {a.id} (rule '{a.rule}') "
                f"within {round(a.expires - a.created)}s; the request was not sent",
                hint="ask an approver to watch `sandgate approvals`, or retry later",
                approval=a.id)
        if got.state == "denied":
            raise ApprovalRefused(
                Code.APPROVAL_DENIED, f"approval {a.id} (rule '{a.rule}') was denied by "
                f"{', '.join(v.approver for v in got.votes if v.verdict == 'deny')}; the "
                "request was not sent", approval=a.id)
        if got.state in ("approved", "used"):
            return f"approved ({a.id}) by {', '.join(got.approved_by)}"
        raise ApprovalRefused(Code.APPROVAL_TIMEOUT, f"approval {a.id} is {got.state}",
                              approval=a.id)

    async def _async_retry(self, seen: Approval, now: float) -> str | None:
        """The identical request comes again (mode async): pass it once if approved, tell it
        the news once if denied or timed out, 202 again while pending; None: ask anew."""
        if seen.state == "pending" and seen.expires > now:
            raise ApprovalRefused(
                Code.APPROVAL_PENDING, f"the request still awaits approval {seen.id}",
                hint="send the identical request again once it is approved",
                approval=seen.id, retry_after=min(ASYNC_RETRY_AFTER,
                                                  max(1, round(seen.expires - now))))
        if seen.state == "pending":  # past its expiry: nobody decided
            seen = await self.store.update(seen.id, _expire(now)) or seen
        if seen.state not in ("approved", "denied", "timeout"):
            return None  # used: ask again
        before = seen.state
        used = await self.store.update(seen.id, _use(before))
        if used is None or used.state != "used":
            return None  # another request took it first
        if before == "approved":
            self._audit("used", seen, approvers=list(seen.approved_by))
            return f"approved ({seen.id}) by {', '.join(seen.approved_by)}"
        if before == "timeout":
            self._audit("timed_out", seen, timeout=round(seen.expires - seen.created))
        return self._outcome(seen, seen)  # raises denied / timeout

    async def _check_limits(self, identity: str) -> None:
        pending = await self.store.pending()
        if len(pending) >= self.limits.max_pending:
            raise ApprovalRefused(Code.APPROVALS_FULL, f"{len(pending)} requests await "
                                  "approval already; no more can be held", retry_after=30)
        mine = sum(1 for a in pending if a.identity == identity)
        if mine >= self.limits.max_pending_per_identity:
            raise ApprovalRefused(Code.TOO_MANY_PENDING, f"identity '{identity}' has {mine} "
                                  "requests awaiting approval already",
                                  hint="wait for the pending ones to be decided",
                                  retry_after=30)

    async def used(self, approval_id: str) -> None:
        """A held request that was approved goes on: it is used (audited once)."""
        a = await self.store.update(approval_id, _use("approved"))
        if a is not None and a.state == "used":
            self._audit("used", a, approvers=list(a.approved_by))

    # ------------------------------------------------------------------ deciding (admin API)

    async def decide(self, approval_id: str, user: str,
                     verdict: Literal["approve", "deny"], scope: object,
                     note: str | None) -> Approval:
        """`user` (authenticated) approves or denies; raises VoteError."""
        now = self.clock()
        current = await self.store.get(approval_id)
        if current is None:
            raise VoteError(404, "not_found", f"no approval {approval_id}")
        sc = parse_scope(scope if verdict == "approve" else None, current.policy,
                         current.sandbox is not None)
        before = len(current.votes)

        def change(a: Approval) -> Approval:
            return vote(a, user, verdict, sc, note, now)

        a = await self.store.update(approval_id, change)
        if a is None:
            raise VoteError(404, "not_found", f"no approval {approval_id}")
        if len(a.votes) != before or a.state != current.state:
            self._audit("decided" if a.state != "pending" else "voted", a, approver=user,
                        decision=verdict, scope=sc.as_dict(), note=note, state=a.state,
                        approvers=list(a.approved_by))
        g = grant_for(a)
        if g is not None and a.state == "approved" and current.state == "pending":
            await self.store.add_grant(g)
        return a

    async def pending(self) -> list[Approval]:
        return await self.store.pending()

    async def get(self, approval_id: str) -> Approval | None:
        return await self.store.get(approval_id)


def _expire(now: float, state: Literal["timeout", "withdrawn"] = "timeout"
            ) -> Callable[[Approval], Approval]:
    def change(a: Approval) -> Approval:
        if a.state != "pending":
            return a  # decided meanwhile: the decision stands
        return dataclasses.replace(a, state=state, decided_at=now)
    return change


def _use(expected: str) -> Callable[[Approval], Approval]:
    def change(a: Approval) -> Approval:
        if a.state != expected:
            return a
        return dataclasses.replace(a, state="used")
    return change
