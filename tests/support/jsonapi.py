"""A real JSON API on loopback TLS (aiohttp): it records every request and answers with what it
received, parsed (JSON or form), so a test sees both what the upstream got and what a reflecting
upstream hands back to the sandbox."""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


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
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None

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
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._echo)
            self._runner = web.AppRunner(app)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(
                web.TCPSite(self._runner, self.host, self.port, ssl_context=ctx).start())
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the JSON API did not start")
        return self

    def stop(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
