"""The admin API's one route table: every method, path and role, for every admin listener.

The single process (sandgate.admin.listener, also a worker's control socket) and the workers'
front (sandgate.workers.admin_front) each give a handler per operation, their own way of
answering (this process's parts, or the workers asked over their control sockets); this table
says where each operation is mounted and which role it needs beyond the method's default
(sandgate.admin.access: viewer for GET, admin otherwise). An operation a listener does not
answer is not mounted there: the grant copy exists only on a worker's control socket.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from sandgate.admin.access import Role, needs

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Route:
    op: str  # the operation's name, the key of a listener's handlers
    method: str
    path: str
    role: Role | None = None  # None: the method's default (viewer for GET, admin otherwise)


ROUTES: tuple[Route, ...] = (
    Route("healthz", "GET", "/healthz"),
    Route("readyz", "GET", "/readyz"),
    Route("metrics", "GET", "/metrics"),
    Route("policy", "GET", "/v1/policy"),
    Route("reload", "POST", "/v1/reload"),
    Route("explain", "POST", "/v1/explain", "viewer"),  # read-only: a viewer may ask
    Route("tokens", "POST", "/v1/tokens"),
    Route("end_sandbox", "DELETE", "/v1/sandboxes/{sandbox}"),
    # `action: ask` (sandgate.approvals.api; with workers, sandgate.approvals.fanout)
    Route("approval_grant", "POST", "/v1/approvals/{id}/grant"),  # a worker's socket only
    Route("approvals", "GET", "/v1/approvals"),
    Route("approval", "GET", "/v1/approvals/{id}"),
    Route("approval_decide", "POST", "/v1/approvals/{id}", "approver"),
)

OPS = frozenset(r.op for r in ROUTES)


def _with_role(handler: Handler, role: Role) -> Handler:
    """A handler of its own for the route, marked with the role: one handler may serve routes
    of different roles (the front forwards several), and the mark must not leak between them."""
    async def routed(request: web.Request) -> web.StreamResponse:
        return await handler(request)
    return needs(role)(routed)


def mount(app: web.Application, handlers: Mapping[str, Handler]) -> None:
    """Mount each operation `handlers` answers at its path, with its role."""
    unknown = set(handlers) - OPS
    if unknown:  # a handler no route names: a typo would leave an endpoint unserved
        raise ValueError(f"no admin route for {sorted(unknown)}: add it to ROUTES")
    for r in ROUTES:
        handler = handlers.get(r.op)
        if handler is None:
            continue
        if r.role is not None:
            handler = _with_role(handler, r.role)
        if r.method == "GET":  # and HEAD, as aiohttp's add_get does
            app.router.add_get(r.path, handler)
        else:
            app.router.add_route(r.method, r.path, handler)
