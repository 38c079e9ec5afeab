"""The console's pending approvals: what `action: ask` rules hold, approved or denied here.

Every logged-in user sees them; only an approver (or admin) gets the forms, and the POST checks
the role again before it reaches the approvals service (sandgate.approvals, through the same
checks as `POST /v1/approvals/{id}`), which checks the rule's own `approvers:` and records the
session's user as the approver: never a name from the form. Each form carries the session's
CSRF token (checked by the console's middleware before this).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

from aiohttp import web

from sandgate.console import PREFIX, auth
from sandgate.console.source import Source


class Console(Protocol):
    """What the approvals pages need of the console (sandgate.console.app.Console has it)."""

    @property
    def source(self) -> Source: ...

    def page(self, request: web.Request, name: str, status: int = 200,
             **context: Any) -> web.Response: ...

    def error(self, request: web.Request, status: int, title: str,
              reason: str) -> web.Response: ...

log = logging.getLogger("sandgate.console")

SCOPES = ("request", "sandbox", "identity")


def vote_from_form(form: Mapping[str, Any]) -> dict[str, Any]:
    """The `POST /v1/approvals/{id}` body the decide form says; ValueError says what is
    missing (the service checks the rest: scopes the rule allows, the ttl's cap)."""
    decision = str(form.get("decision", ""))
    if decision not in ("approve", "deny"):
        raise ValueError("choose Approve or Deny")
    vote: dict[str, Any] = {"decision": decision}
    note = str(form.get("note", "")).strip()
    if note:
        vote["note"] = note
    if decision == "deny":
        return vote
    kind = str(form.get("scope", "") or "request")
    if kind not in SCOPES:
        raise ValueError(f"unknown scope {kind!r}: request, sandbox or identity")
    if kind == "request":
        vote["scope"] = {"kind": "request"}
        return vote
    raw = str(form.get("ttl", "")).strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError("give how many seconds the decision is remembered for")
    vote["scope"] = {"kind": kind, "ttl": int(raw)}
    return vote


class ApprovalsPage:
    def __init__(self, console: Console) -> None:
        self.console = console

    async def _page(self, request: web.Request, status: int = 200,
                    problem: str = "") -> web.Response:
        items = await self.console.source.approvals()
        return self.console.page(request, "approvals.html", status=status, nav="approvals",
                                 approvals=items, problem=problem)

    async def listing(self, request: web.Request) -> web.Response:
        return await self._page(request)

    async def rows(self, request: web.Request) -> web.Response:
        items = await self.console.source.approvals()
        return self.console.page(request, "_approvals.html", approvals=items)

    async def show(self, request: web.Request) -> web.Response:
        a = await self.console.source.approval(request.match_info["id"])
        if a is None:
            return self.console.error(request, 404, "Not found", "no such approval")
        return self.console.page(request, "approval.html", nav="approvals", a=a)

    async def decide(self, request: web.Request) -> web.StreamResponse:
        user, role = auth.who(request)
        if not auth.can_decide(role):
            log.warning("sandgate: console: %s (role %s) tried to decide an approval; refused",
                        user, role)
            return self.console.error(request, 403, "Refused", f"role {role} cannot decide "
                                      "approvals (an approver or admin can)")
        approval_id = request.match_info["id"]
        try:
            vote = vote_from_form(await request.post())
        except ValueError as e:
            return await self._page(request, 400, str(e))
        status, doc = await self.console.source.decide(approval_id, user, role, vote)
        if status != 200:
            return await self._page(request, status, str(
                doc.get("reason") or f"the decision failed ({status})"))
        log.info("sandgate: console: %s voted %s on approval %s", user, vote["decision"],
                 approval_id)
        return web.Response(status=303, headers={
            "Location": f"{PREFIX}/approvals/{quote(approval_id, safe='')}"})

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/approvals", self.listing)
        r.add_get("/approvals/rows", self.rows)
        r.add_get("/approvals/{id}", self.show)
        r.add_post("/approvals/{id}", self.decide)
