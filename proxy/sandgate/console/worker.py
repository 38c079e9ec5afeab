"""What a worker of `--workers N` answers its supervisor's console, on its control socket.

The supervisor's console (sandgate.console.source.WorkersSource) merges every worker's recent
decisions and refusal counts and their LLM budget windows, and takes the reach report from one
worker. Only the control
socket serves these (the supervisor's token); the admin listener does not.
"""

from __future__ import annotations

import json

from aiohttp import web

from sandgate.console.ring import MAX_LIMIT, Filter
from sandgate.console.source import WORKER_PREFIX, LocalSource, SourceError


def add_routes(app: web.Application, source: LocalSource) -> None:
    async def events(request: web.Request) -> web.Response:
        try:
            limit = max(0, min(int(request.query.get("limit", MAX_LIMIT)), MAX_LIMIT))
        except ValueError:
            limit = MAX_LIMIT
        return web.json_response(source.ring.as_dict(Filter.from_query(request.query), limit))

    async def event(request: web.Request) -> web.Response:
        return web.json_response({"event": source.ring.get(request.match_info["id"])})

    async def report(_: web.Request) -> web.Response:
        return web.json_response(await source.report(), dumps=json.dumps)

    async def spend(_: web.Request) -> web.Response:
        try:
            return web.json_response({"windows": await source.spend()})
        except SourceError as e:
            return web.json_response({"error": "state_unavailable", "reason": str(e)},
                                     status=503)

    app.router.add_get(f"{WORKER_PREFIX}/events", events)
    app.router.add_get(f"{WORKER_PREFIX}/events/{{id}}", event)
    app.router.add_get(f"{WORKER_PREFIX}/report", report)
    app.router.add_get(f"{WORKER_PREFIX}/spend", spend)
