"""The admin API of approvals in one process (mounted by sandgate.admin.routes, the one table):

    GET  /v1/approvals        pending approvals, oldest first (viewer)
    GET  /v1/approvals/{id}   one approval, in any state (viewer)
    POST /v1/approvals/{id}   {"decision": "approve"|"deny", "scope": {"kind": "request"|
                              "sandbox"|"identity", "ttl": SECONDS}, "note": "..."} (approver)

The approver is the authenticated user (sandgate.admin.access), never a name in the body.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from sandgate.admin.access import USER_KEY
from sandgate.admin.routes import Handler, mount
from sandgate.approvals.service import Approvals
from sandgate.approvals.votes import Approval, VoteError, grant_for
from sandgate.text import has_control_chars

MAX_BODY = 16 * 1024
MAX_NOTE = 500
# a whole approval document (its headers: up to --max-headers values of up to 512 characters,
# JSON-escaped), from the front over a worker's control socket
MAX_GRANT_COPY = 4 * 1024 * 1024


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body, indent=2) + "\n",
                        content_type="application/json")


def _error(status: int, code: str, reason: str) -> web.Response:
    return _json(status, {"error": code, "reason": reason})


async def _read_at_most(request: web.Request, limit: int) -> bytes:
    """The body, or its first `limit` + 1 bytes: one read returns only what has arrived, and an
    approval's document with its headers spans many chunks."""
    out = bytearray()
    while len(out) <= limit:
        chunk = await request.content.read(limit + 1 - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def parse_vote(doc: object) -> tuple[str, object, str | None]:
    """(decision, raw scope, note) of a POST body; VoteError(400) when malformed."""
    if not isinstance(doc, dict):
        raise VoteError(400, "bad_request", "the body must be a JSON object")
    unknown = set(doc) - {"decision", "scope", "note"}
    if unknown:
        raise VoteError(400, "bad_request", f"unknown key(s) {sorted(unknown)}: the body "
                        "takes decision, scope and note (the approver is the authenticated "
                        "user)")
    decision = doc.get("decision")
    if decision not in ("approve", "deny"):
        raise VoteError(400, "bad_request", "`decision` must be \"approve\" or \"deny\"")
    note = doc.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE
                             or has_control_chars(note)):
        raise VoteError(400, "bad_request", f"`note` must be one line of text, at most "
                        f"{MAX_NOTE} characters")
    scope = doc.get("scope")
    if decision == "deny" and scope is not None:
        raise VoteError(400, "bad_request", "a deny takes no scope")
    return decision, scope, note


def handlers(approvals: Approvals | None, internal: bool = False) -> dict[str, Handler]:
    """The handlers of the approvals routes (sandgate.admin.routes); `internal` (a worker's
    control socket) adds the grant copy the front sends (sandgate.approvals.fanout)."""
    async def listing(_: web.Request) -> web.Response:
        items = await approvals.pending() if approvals is not None else []
        return _json(200, {"approvals": [a.as_dict() for a in items]})

    async def show(request: web.Request) -> web.Response:
        a = await approvals.get(request.match_info["id"]) if approvals is not None else None
        if a is None:
            return _error(404, "not_found", f"no approval {request.match_info['id']}")
        return _json(200, a.as_dict())

    async def decide(request: web.Request) -> web.Response:
        if approvals is None:
            return _error(404, "not_found", f"no approval {request.match_info['id']}")
        raw = await request.content.read(MAX_BODY + 1)
        try:
            if len(raw) > MAX_BODY:
                raise VoteError(413, "too_large", f"the body is over {MAX_BODY} bytes")
            try:
                doc = json.loads(raw or b"{}")
            except ValueError:
                raise VoteError(400, "bad_request", "the body is not JSON") from None
            decision, scope, note = parse_vote(doc)
            a = await approvals.decide(request.match_info["id"], request[USER_KEY],
                                       decision, scope, note)  # type: ignore[arg-type]
        except VoteError as e:
            return _error(e.status, e.code, e.reason)
        return _json(200, a.as_dict())

    async def copy_grant(request: web.Request) -> web.Response:
        """A grant decided in another worker (the front sends the approved approval)."""
        if approvals is None:
            return _error(404, "not_found", "no approvals here")
        try:
            raw = await _read_at_most(request, MAX_GRANT_COPY)
            if len(raw) > MAX_GRANT_COPY:
                return _error(413, "too_large", f"the body is over {MAX_GRANT_COPY} bytes")
            a = Approval.from_dict(json.loads(raw))
        except (ValueError, KeyError, TypeError):
            return _error(400, "bad_request", "the body must be an approved approval")
        g = grant_for(a)
        if g is None or a.id != request.match_info["id"]:
            return _error(400, "bad_request", "no grant to remember in this approval")
        await approvals.store.add_grant(g)
        return _json(200, g.as_dict())

    out: dict[str, Handler] = {"approvals": listing, "approval": show, "approval_decide": decide}
    if internal:
        out["approval_grant"] = copy_grant
    return out


def register(app: web.Application, approvals: Approvals | None, internal: bool = False) -> None:
    """Mount the approvals routes alone on `app`, from the one table (sandgate.admin.routes)."""
    mount(app, handlers(approvals, internal))
