"""Real TLS upstreams on loopback (aiohttp) that report exactly what they received."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    method: str
    path: str
    query: str
    host: str | None
    headers: dict[str, str]
    body: bytes
    peer: Any = None  # the client address of the connection it came on (one per connection)


@dataclass
class Upstream:
    """Records every request; `/echo-key` answers with the x-api-key it got (a leaky API)."""

    seen: list[Seen] = field(default_factory=list)
    sse_release: threading.Event = field(default_factory=threading.Event)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/echo-key", self.echo_key)
        app.router.add_route("GET", "/sse", self.sse)
        app.router.add_route("GET", "/big", self.big)
        app.router.add_route("GET", "/desync/{tail:.*}", self.desync)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        return app

    async def _record(self, request: web.Request) -> Seen:
        body = await request.read()
        s = Seen(request.method, request.path, request.query_string, request.headers.get("Host"),
                 {k.lower(): v for k, v in request.headers.items()}, body,
                 request.transport.get_extra_info("peername") if request.transport else None)
        self.seen.append(s)
        return s

    async def echo(self, request: web.Request) -> web.StreamResponse:
        s = await self._record(request)
        if request.path.startswith("/v1/messages"):
            return web.json_response({
                "id": "msg_test", "type": "message", "role": "assistant", "model": "test-model",
                "content": [{"type": "text", "text": "hello from the test upstream"}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1},
            })
        if request.path.startswith("/v1/chat/completions"):
            return web.json_response({
                "id": "chatcmpl-test", "object": "chat.completion", "created": 0,
                "model": "test-model",
                "choices": [{
                    "index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hello from openai test"},
                }],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })
        return web.json_response({"method": s.method, "path": s.path, "query": s.query,
                                  "host": s.host, "body_len": len(s.body)})

    async def echo_key(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        key = request.headers.get("x-api-key", "") or request.headers.get("authorization", "")
        resp = web.StreamResponse(headers={"X-Echo-Key": key, "X-Sandgate-Reason": "forged"})
        resp.content_type = "text/plain"
        # The key split across writes, so a scrubber that looks chunk by chunk would miss it.
        blob = f"your key is {key} and again {key}.".encode()
        if request.query.get("as") == "qp":  # in a MIME part, quoted-printable, bytes escaped
            resp.headers["Content-Type"] = 'multipart/mixed; boundary="b1"'
            blob = _qp_mime(key.encode())
        await resp.prepare(request)
        mid = len(blob) // 3
        for part in (blob[:mid], blob[mid:2 * mid], blob[2 * mid:]):
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def sse(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        # Hold the stream open until the test has seen the first event through the proxy.
        await asyncio.get_running_loop().run_in_executor(None, self.sse_release.wait, 10)
        await resp.write(b"data: second\n\n")
        await resp.write_eof()
        return resp

    async def big(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        n = int(request.query.get("mb", "8"))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = n * 1024 * 1024
        await resp.prepare(request)
        chunk = b"x" * (1024 * 1024)
        for _ in range(n):
            await resp.write(chunk)
        await resp.write_eof()
        return resp


    async def desync(self, request: web.Request) -> web.StreamResponse:
        """A desynchronised upstream: after its response, a second one nobody asked for
        (`?delay=S`: that many seconds later, i.e. while the connection sits idle)."""
        await self._record(request)
        resp = web.Response(text="asked")
        await resp.prepare(request)
        await resp.write_eof()
        transport = request.transport
        assert transport is not None

        def smuggle() -> None:
            if not transport.is_closing():
                transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled")

        delay = float(request.query.get("delay", "0"))
        if delay:
            asyncio.get_running_loop().call_later(delay, smuggle)
        else:
            smuggle()
        return resp


class UpstreamServer:
    """Runs an Upstream on its own event loop thread; TLS when given a cert."""

    def __init__(self, host: str, port: int, cert: str | None, key: str | None,
                 sock: socket.socket | None = None) -> None:
        self.host, self.port = host, port
        self._sock = sock  # a listening socket made elsewhere (e.g. inside a network namespace)
        self.upstream = Upstream()
        self._ctx: ssl.SSLContext | None = None
        if cert is not None:
            self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ctx.load_cert_chain(cert, key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> UpstreamServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.upstream.app(), access_log=None)
        await self._runner.setup()
        site: web.BaseSite
        if self._sock is not None:
            site = web.SockSite(self._runner, self._sock, ssl_context=self._ctx)
        else:
            site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ctx)
        await site.start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def seen(self) -> list[Any]:
        return self.upstream.seen


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


class AppThread:
    """An aiohttp application served over TLS on `host`:443 from its own loop in a thread."""

    def __init__(self, app: web.Application, cert: Any, key: Any, host: str,
                 port: int = 443) -> None:
        self.host, self.port = host, port
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = web.AppRunner(app, access_log=None)

    def start(self) -> AppThread:
        self.thread.start()

        async def go() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, self.host, self.port, ssl_context=self.ctx).start()

        asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _qp_mime(key: bytes) -> bytes:
    """A multipart body whose quoted-printable part holds `key` with every other byte escaped
    (any octet may be: RFC 2045 6.7), lower-case hex on some, and a soft break every 7 bytes;
    any MIME library gives the key back."""
    out = bytearray()
    for i, byte in enumerate(key):
        if i and i % 7 == 0:
            out += b"=\r\n"
        if i % 2 or byte == 0x3D:
            out += (f"={byte:02X}" if i % 4 == 1 else f"={byte:02x}").encode()
        else:
            out.append(byte)
    return b"\r\n".join([b"--b1", b"Content-Type: text/plain",
                          b"Content-Transfer-Encoding: quoted-printable", b"",
                          b"key: " + bytes(out), b"--b1--", b""])
