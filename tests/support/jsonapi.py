"""A real JSON API on loopback TLS (aiohttp): it records every request and answers with what it
received, parsed (JSON or form), so a test sees both what the upstream got and what a reflecting
upstream hands back to the sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.aioserve import ThreadedApp


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class JsonApi:
    host: str
    port: int
    cert: str
    key: str
    seen: list[Seen] = field(default_factory=list)
    _server: ThreadedApp | None = None

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        got: Any
        if request.content_type == "application/x-www-form-urlencoded":
            got = dict(await request.post())
        else:
            try:
                got = await request.json()
            except ValueError:
                return web.json_response({"error": "not json"}, status=400)
        return web.json_response({"received": got})

    def start(self) -> JsonApi:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._server = ThreadedApp(app, self.host, self.port, self.cert, self.key)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
