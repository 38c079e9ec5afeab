"""Where the console's data comes from: this process, or the workers of `--workers N`.

The pages ask a `Source`; both kinds answer the same shapes, built by the code the admin API
and the CLI use: the policy overview is the admin API's `/v1/policy` body, an explanation is
`explain.explain_request` (the admin API's `POST /v1/explain`, the decision function itself),
the reach report is `sandgate report`'s JSON (sandgate.review.report). With workers, the
supervisor serves the console and asks the workers over their control sockets, as it does for
metrics and readiness: events from every worker's ring merged newest first, the rest from one
running worker (every worker serves the same policy).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlencode

from sandgate.admin.access import FORWARDED_ROLE, FORWARDED_USER
from sandgate.admin.process import AdminState, policy_doc
from sandgate.approvals import fanout as front
from sandgate.audit import events as A
from sandgate.console.ring import MAX_LIMIT, EventRing, Filter, merge_events, merge_refusals
from sandgate.errors import Unavailable
from sandgate.workers.group import WorkerGroup

if TYPE_CHECKING:
    from sandgate.policy.model import Policy

WORKER_PREFIX = "/worker/console"


class SourceError(Unavailable):
    """The data could not be had (no worker answered): the page says so."""


class Source(Protocol):
    started: float

    async def overview(self) -> dict[str, Any]: ...

    async def events(self, flt: Filter, limit: int) -> list[dict[str, Any]]: ...

    async def event(self, event_id: str) -> dict[str, Any] | None: ...

    async def refusals(self) -> list[tuple[int, dict[str, int]]]: ...

    async def explain(self, args: Mapping[str, Any]) -> tuple[int, dict[str, Any]]: ...

    async def report(self) -> dict[str, Any]: ...

    async def spend(self) -> list[dict[str, Any]]: ...

    async def approvals(self) -> list[dict[str, Any]]: ...

    async def approval(self, approval_id: str) -> dict[str, Any] | None: ...

    async def decide(self, approval_id: str, user: str, role: str, vote: Mapping[str, Any]
                     ) -> tuple[int, dict[str, Any]]: ...


def explain_args(ev: Mapping[str, Any]) -> dict[str, Any] | str:
    """The `POST /v1/explain` body that asks about the request an audit event records, or why
    there is none (a CONNECT is judged as the proxy judges a tunnel's opening). The path is the
    audited one: query values are REDACTED except those a rule's `query:` constrains, which the
    audit keeps, so the rules see what they judged; a call's arguments are audited only as a
    digest, so rules on arguments are not judged again."""
    identity = ev.get(A.IDENTITY)
    args: dict[str, Any]
    if not identity:
        return ("no identity: the request was refused before any rule was consulted"
                f" ({ev.get(A.REASON) or 'no reason recorded'})")
    method, host, port = ev.get(A.METHOD), ev.get(A.HOST), ev.get(A.PORT)
    if ev.get(A.EVENT) == "dns" and host:  # a lookup of the policy DNS (sandgate.dns)
        return {"identity": identity, "dns": host, "type": ev.get("qtype") or "A"}
    if method and not host and isinstance(ev.get("url"), str):  # an approval event
        args = {"identity": identity, "method": method, "url": ev["url"]}
        if ev.get(A.SANDBOX):
            args["sandbox"] = ev[A.SANDBOX]
        if ev.get("tool"):
            args["mcp_tool"] = ev["tool"]
        return args
    if not (method and host and port):
        return "the event records no request (a connection or a limit)"
    scheme = ev.get(A.SCHEME) or ("https" if port == 443 else "http")
    if scheme not in ("http", "https"):
        scheme = "https"
    bracketed = f"[{host}]" if ":" in str(host) else str(host)
    path = ev.get(A.PATH) or "/"
    args = {"identity": identity, "method": method,
                            "url": f"{scheme}://{bracketed}:{port}{path}"}
    if method == "CONNECT":
        args["url"] = f"{bracketed}:{port}"
    elif ev.get(A.GATEWAY):  # the gateway listener: judged as the gateway path it came in on
        args.update(url=f"{ev[A.GATEWAY]}{path}", gateway=True)
    if ev.get(A.SANDBOX):
        args["sandbox"] = ev[A.SANDBOX]
    if ev.get(A.EVENT) == "websocket" or ev.get(A.CODE) == "upgrade_refused":
        args["websocket"] = True  # a WebSocket's message, or its refused handshake
    for call in ev.get("rpc") or ():
        if not isinstance(call, Mapping):
            continue
        if call.get("tool"):
            args["mcp_tool"] = call["tool"]
        elif call.get("method"):
            args["rpc_method"] = call["method"]
        break  # explain judges one call: the first of a batch
    return args


def report_doc(policy: Policy, title: str) -> dict[str, Any]:
    """`sandgate report --format json` of a loaded policy."""
    from sandgate.review.report import build_report, format_json

    doc: dict[str, Any] = json.loads(format_json(build_report(policy, title)))
    return doc


class ReportCache:
    """The reach report of the version now serving, made once per version in a thread (the
    reach search may take a while; the proxy's loop goes on meanwhile)."""

    def __init__(self) -> None:
        self._version: str | None = None
        self._doc: dict[str, Any] | None = None
        self._lock = asyncio.Lock()

    async def get(self, version: str, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        async with self._lock:
            if self._version != version or self._doc is None:
                self._doc = await asyncio.to_thread(make)
                self._version = version
            return self._doc


class LocalSource:
    """The one process of `sandgate run` (or one worker, answering its supervisor)."""

    def __init__(self, state: AdminState, ring: EventRing | None) -> None:
        self.state = state
        self.ring = ring if ring is not None else EventRing()
        self.started = self.ring.started
        self._reports = ReportCache()

    async def overview(self) -> dict[str, Any]:
        return {"policy": policy_doc(self.state), "workers": None}

    async def events(self, flt: Filter, limit: int = MAX_LIMIT) -> list[dict[str, Any]]:
        return self.ring.events(flt, limit)

    async def event(self, event_id: str) -> dict[str, Any] | None:
        return self.ring.get(event_id)

    async def refusals(self) -> list[tuple[int, dict[str, int]]]:
        return self.ring.refusals()

    async def explain(self, args: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        from sandgate.explain.inputs import explain_input, parse_input

        try:  # the admin API's `POST /v1/explain`: the same fields, read the same way
            out, _ = explain_input(self.state.live.policy, parse_input(args, files=False),
                                   self.state.resolve)
        except ValueError as e:
            return 400, {"error": "bad_request", "reason": str(e)}
        return 200, out

    async def report(self) -> dict[str, Any]:
        live = self.state.live
        policy, version = live.policy, live.current.version
        return await self._reports.get(
            version, lambda: report_doc(policy, str(live.directory)))

    async def spend(self) -> list[dict[str, Any]]:
        """The LLM budget windows open now (WindowView.doc each), as the proxy counts them."""
        from sandgate.errors import StateUnavailable

        if self.state.spend_windows is None:
            return []
        try:
            return [v.doc() for v in await self.state.spend_windows()]
        except StateUnavailable as e:
            raise SourceError(str(e)) from None

    async def approvals(self) -> list[dict[str, Any]]:
        svc = self.state.approvals
        return [a.as_dict() for a in await svc.pending()] if svc is not None else []

    async def approval(self, approval_id: str) -> dict[str, Any] | None:
        svc = self.state.approvals
        a = await svc.get(approval_id) if svc is not None else None
        return a.as_dict() if a is not None else None

    async def decide(self, approval_id: str, user: str, role: str, vote: Mapping[str, Any]
                     ) -> tuple[int, dict[str, Any]]:
        """`POST /v1/approvals/{id}`'s checks and the service's decision, for `user`."""
        from sandgate.approvals.api import parse_vote
        from sandgate.approvals.votes import VoteError

        svc = self.state.approvals
        if svc is None:
            return 404, {"error": "not_found", "reason": f"no approval {approval_id}"}
        try:
            verdict, scope, note = parse_vote(dict(vote))
            a = await svc.decide(approval_id, user, verdict, scope,  # type: ignore[arg-type]
                                 note)
        except VoteError as e:
            return e.status, {"error": e.code, "reason": e.reason}
        return 200, a.as_dict()


class WorkersSource:
    """The supervisor of `--workers N`: asks the workers."""

    def __init__(self, sup: WorkerGroup) -> None:
        self.sup = sup
        self.started = time.time()

    async def _one(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        raw = json.dumps(body).encode() if body is not None else None
        answer = await self.sup.ask_one(method, path, raw,
                                        "application/json" if raw is not None else None)
        if answer is None:
            raise SourceError("no worker is running")
        status, data, _ = answer
        try:
            return status, json.loads(data)
        except ValueError:
            raise SourceError(f"a worker answered {path} with something else than JSON") \
                from None

    async def _every(self, path: str) -> list[dict[str, Any]]:
        out = []
        for status, data, _ in await self.sup.ask_all("GET", path):
            if status == 200:
                try:
                    doc = json.loads(data)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    out.append(doc)
        return out

    async def overview(self) -> dict[str, Any]:
        status, doc = await self._one("GET", "/v1/policy")
        if status != 200:
            raise SourceError(f"the policy could not be read ({status})")
        running = sum(w.running and w.started for w in self.sup.workers)
        return {"policy": doc, "workers": {"asked": self.sup.n, "running": running}}

    async def events(self, flt: Filter, limit: int = MAX_LIMIT) -> list[dict[str, Any]]:
        q = urlencode({**flt.query(), "limit": str(limit)})
        answers = await self._every(f"{WORKER_PREFIX}/events?{q}")
        return merge_events((a.get("events") or [] for a in answers), limit)

    async def event(self, event_id: str) -> dict[str, Any] | None:
        for a in await self._every(f"{WORKER_PREFIX}/events/{quote(event_id, safe='')}"):
            if a.get("event"):
                return dict(a["event"])
        return None

    async def refusals(self) -> list[tuple[int, dict[str, int]]]:
        answers = await self._every(f"{WORKER_PREFIX}/events?limit=0")
        return merge_refusals(a.get("refusals") or [] for a in answers)

    async def explain(self, args: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        status, doc = await self._one("POST", "/v1/explain", dict(args))
        return status, doc if isinstance(doc, dict) else {}

    async def report(self) -> dict[str, Any]:
        status, doc = await self._one("GET", f"{WORKER_PREFIX}/report")
        if status != 200 or not isinstance(doc, dict):
            raise SourceError(f"the reach report could not be made ({status})")
        return doc

    async def spend(self) -> list[dict[str, Any]]:
        """Every worker's windows: a window in the fleet's state (`shared`) once, a worker's
        own (each process counts for itself without --state) under its worker."""
        answers = await self.sup.ask_all("GET", f"{WORKER_PREFIX}/spend")
        out: list[dict[str, Any]] = []
        seen: set[tuple[Any, ...]] = set()
        for i, (status, data, _) in enumerate(answers):
            if status != 200:
                continue
            try:
                doc = json.loads(data)
            except ValueError:
                continue
            for w in doc.get("windows") or () if isinstance(doc, dict) else ():
                if not isinstance(w, dict):
                    continue
                if w.get("shared"):
                    key = (w.get("budget"), w.get("scope"), w.get("who"),
                           json.dumps(w.get("limits"), sort_keys=True), w.get("per"))
                    if key in seen:
                        continue
                    seen.add(key)
                else:
                    w = {**w, "worker": i + 1}
                out.append(w)
        if not answers:
            raise SourceError("no worker is running")
        return out

    # approvals: held in the workers; asked as the front asks them (sandgate.approvals.fanout),
    # with the console's user passed along as the front passes an API user
    async def approvals(self) -> list[dict[str, Any]]:
        return [dict(a) for a in await front.pending(self.sup, {})]

    async def approval(self, approval_id: str) -> dict[str, Any] | None:
        status, doc = await front.show(self.sup, approval_id, {})
        return dict(doc) if status == 200 and isinstance(doc, dict) else None

    async def decide(self, approval_id: str, user: str, role: str, vote: Mapping[str, Any]
                     ) -> tuple[int, dict[str, Any]]:
        status, doc = await front.decide(self.sup, approval_id, json.dumps(dict(vote)).encode(),
                                         _as(user, role))
        return status, doc if isinstance(doc, dict) else {}


def _as(user: str, role: str) -> dict[str, str]:
    """The headers a front forwards a user with (only a holder of the worker token may set
    them); reads go without (the worker token's own role reads)."""
    return {FORWARDED_USER: user, FORWARDED_ROLE: role}
