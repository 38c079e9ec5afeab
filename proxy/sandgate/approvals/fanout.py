"""The approvals API of `sandgate run --workers N`'s one admin listener (workers/admin_front.py).

Held requests live in the workers, each with its own store unless they share Redis. The front
authenticates the user (sandgate.admin.access) and asks the workers over their control sockets,
passing the user's name and role along (only a holder of the worker token may):

- `GET /v1/approvals`: every worker's pending approvals, merged (by id) and oldest first;
- `GET /v1/approvals/{id}`: the worker that knows it;
- `POST /v1/approvals/{id}`: the workers are asked one after another until one knows it (the
  one holding it, or with a shared store the first): a vote is taken once. A decision
  remembered for a sandbox or identity is then copied to every other worker (`POST
  /v1/approvals/{id}/grant` on the control sockets), so their requests pass too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from sandgate.admin.access import forwarded_headers
from sandgate.admin.routes import Handler
from sandgate.workers.group import WorkerGroup

log = logging.getLogger("sandgate")

MAX_BODY = 16 * 1024


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body, indent=2) + "\n",
                        content_type="application/json")


def _docs(answers: list[tuple[int, bytes, str]]) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    for status, raw, _ in answers:
        try:
            out.append((status, json.loads(raw)))
        except ValueError:
            continue
    return out


async def pending(sup: WorkerGroup, headers: Mapping[str, str]) -> list[Any]:
    """Every worker's pending approvals, merged by id, oldest first (also the web console's)."""
    merged: dict[str, Any] = {}
    for status, doc in _docs(await sup.ask_all("GET", "/v1/approvals", extra=headers)):
        if status == 200:
            for a in doc.get("approvals", []):
                merged.setdefault(a["id"], a)
    return sorted(merged.values(), key=lambda a: a["created"])


async def show(sup: WorkerGroup, aid: str, headers: Mapping[str, str]) -> tuple[int, Any]:
    docs = _docs(await sup.ask_all("GET", f"/v1/approvals/{aid}", extra=headers))
    found = next(((s, d) for s, d in docs if s == 200), None)
    if found is None:
        return 404, {"error": "not_found", "reason": f"no approval {aid}"}
    return found


async def decide(sup: WorkerGroup, aid: str, raw: bytes,
                 headers: Mapping[str, str]) -> tuple[int, Any]:
    """The worker holding it decides; a remembered grant is copied to every worker."""
    # one worker after another: a vote is taken once, by the worker holding the request
    answer = await sup.ask_until("POST", f"/v1/approvals/{aid}", raw, extra=headers)
    docs = _docs([answer] if answer is not None else [])
    if not docs:
        return 404, {"error": "not_found", "reason": f"no approval {aid}"}
    status, doc = docs[0]
    scope = doc.get("scope") if status == 200 and isinstance(doc, dict) else None
    if doc.get("state") == "approved" and scope and scope.get("kind") != "request":
        missed = await sup.tell_all("POST", f"/v1/approvals/{aid}/grant",
                                    json.dumps(doc).encode())
        if missed:  # their requests of this scope are held and asked again: say so
            log.warning("approval %s: the remembered grant did not reach worker(s) %s; their "
                        "requests in its scope will ask again", aid,
                        ", ".join(map(str, missed)))
    return status, doc


def front_handlers(sup: WorkerGroup) -> dict[str, Handler]:
    """The handlers of the approvals routes on the workers' front (sandgate.admin.routes)."""
    async def listing(request: web.Request) -> web.Response:
        return _json(200, {"approvals": await pending(sup, forwarded_headers(request))})

    async def show_(request: web.Request) -> web.Response:
        return _json(*await show(sup, request.match_info["id"], forwarded_headers(request)))

    async def decide_(request: web.Request) -> web.Response:
        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            return _json(413, {"error": "too_large", "reason": f"body over {MAX_BODY} bytes"})
        return _json(*await decide(sup, request.match_info["id"], raw,
                                   forwarded_headers(request)))

    return {"approvals": listing, "approval": show_, "approval_decide": decide_}
