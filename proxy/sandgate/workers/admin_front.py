"""The one admin listener of `sandgate run --workers N`, served by the supervisor.

Same endpoints, token and answers as the single-process admin API (sandgate/admin/listener.py),
for the whole process group:

- `/healthz`: the supervisor is up.
- `/readyz`: ready only when every worker runs and says it is ready; the body lists each
  worker, and the reasons name the worker they come from.
- `/metrics`: the workers' metrics merged into one answer (aggregate.merge), plus the
  supervisor's own (`sandgate_workers`, `sandgate_workers_running`,
  `sandgate_worker_restarts_total`).
- `POST /v1/reload`: every worker reloads; one answer (an error in any worker is an error).
- `DELETE /v1/sandboxes/{id}`: every worker revokes the sandbox's leases it holds; 202 until all
  did.
- `/v1/policy`, `/v1/explain`, `/v1/tokens`: answered by one running worker (every worker
  serves the same policy; tokens are stateless and signed with the shared key).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from sandgate.admin.access import AdminUser
from sandgate.admin.listener import auth_middleware
from sandgate.admin.login import FailureLimit
from sandgate.admin.routes import mount as mount_routes
from sandgate.approvals.fanout import front_handlers
from sandgate.console.app import mount as mount_console
from sandgate.console.source import WorkersSource
from sandgate.metrics import CONTENT_TYPE
from sandgate.workers.group import WorkerGroup

MAX_BODY = 64 * 1024


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body, indent=2) + "\n",
                        content_type="application/json")


def build_front(sup: WorkerGroup, admin_token: str,
                open_paths: frozenset[str] = frozenset(),
                users: tuple[AdminUser, ...] = (), login_limit: int = 5) -> web.Application:
    # one guessing bound for the admin API and the console's login
    limit = FailureLimit.per_minute(login_limit)
    auth = auth_middleware(admin_token, open_paths, users,  # as the single process checks
                           limit=limit)

    async def healthz(_: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        r = await sup.readiness()
        return _json(200 if r.ready else 503, r.body)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=await sup.metrics(), headers={"Content-Type": CONTENT_TYPE})

    async def reload(_: web.Request) -> web.Response:
        status, body = await sup.reload_all()
        return _json(status, body)

    async def forward(request: web.Request) -> web.Response:
        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            return _json(413, {"error": "too_large", "reason": f"body over {MAX_BODY} bytes"})
        answer = await sup.ask_one(request.method, request.path, raw or None,
                                   request.headers.get("Content-Type"))
        if answer is None:
            return _json(503, {"error": "unavailable", "reason": "no worker is running"})
        status, body, ctype = answer
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})

    async def end_sandbox(request: web.Request) -> web.Response:
        status, body = await sup.end_sandbox_all(request.match_info["sandbox"])
        return _json(status, body)

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY)
    mount_routes(app, {
        "healthz": healthz, "readyz": readyz, "metrics": metrics, "reload": reload,
        # one running worker answers: every worker serves the same policy and key
        "policy": forward, "explain": forward, "tokens": forward,
        # leases live in every worker: the end of a sandbox reaches all of them
        "end_sandbox": end_sandbox,
        **front_handlers(sup)})  # approvals: held in the workers
    mount_console(app, WorkersSource(sup), admin_token, users,  # the console, over every worker
                  limit=limit)
    return app
