"""An aiohttp application served over TLS on a loopback address from a thread of the test
process (so a test reads what it recorded directly)."""

from __future__ import annotations

import asyncio
import ssl
import threading

from aiohttp import web


class ThreadedApp:
    def __init__(self, app: web.Application, host: str, port: int, cert: str, key: str) -> None:
        self.app, self.host, self.port = app, host, port
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.load_cert_chain(cert, key)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._runner = web.AppRunner(self.app)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port,
                                                ssl_context=self._ctx).start())
            ready.set()
            loop.run_forever()

        threading.Thread(target=run, daemon=True, name=f"aioserve-{self.host}").start()
        if not ready.wait(10):
            raise RuntimeError(f"the server on {self.host}:{self.port} did not start")

    def stop(self) -> None:
        if self._loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
