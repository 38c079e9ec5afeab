"""A lean asyncio HTTP/1.1 client for soak tests: keep-alive tunnels through Sandgate.

One `Tunnel` is one client connection to the proxy for one (identity, scheme, host): for https a
CONNECT (with the identity's Basic proxy credentials) and TLS to the proxy's certificate for the
host, then any number of requests on it; for http, absolute-form requests carrying the proxy
credentials each time. Raw sockets and the stdlib's ssl: cheap enough that one client process
does not starve a proxy sharing two cores with it. Every read has a time limit; a response is
returned whole (head and body bytes) so a test can search it for secrets.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from dataclasses import dataclass, field

REASON_HEADER = b"x-sandgate-reason"


@dataclass
class Req:
    rid: str
    method: str
    path: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class Res:
    rid: str
    status: int  # 0: no response (see error)
    reason_code: str  # X-Sandgate-Reason, "" when absent
    raw: bytes  # the whole response as received, head and body
    body: bytes
    latency: float  # from sending the request (the tunnel open) to the end of the response
    started: float  # time.monotonic() when the request was sent
    error: str | None = None


class ProxyClosed(Exception):
    """The proxy ended the connection before a complete response."""


class Tunnel:
    def __init__(self, proxy_host: str, proxy_port: int, identity: str, token: str, host: str,
                 *, scheme: str = "https", port: int | None = None,
                 ssl_ctx: ssl.SSLContext | None = None, timeout: float = 30.0) -> None:
        self.proxy = (proxy_host, proxy_port)
        self.identity, self.token = identity, token
        self.scheme, self.host = scheme, host
        self.port = port or (443 if scheme == "https" else 80)
        self.ssl_ctx = ssl_ctx
        self.timeout = timeout
        self.auth = "Basic " + base64.b64encode(f"{identity}:{token}".encode()).decode()
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self.opened = 0  # connections opened (reconnects after a close count too)

    async def _open(self) -> None:
        r, w = await asyncio.wait_for(asyncio.open_connection(*self.proxy), self.timeout)
        self.opened += 1
        if self.scheme == "https":
            w.write(f"CONNECT {self.host}:{self.port} HTTP/1.1\r\nHost: {self.host}:{self.port}"
                    f"\r\nProxy-Authorization: {self.auth}\r\n\r\n".encode())
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), self.timeout)
            if not head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                w.close()
                first = head.split(b"\r\n", 1)[0]
                raise ProxyClosed(f"CONNECT refused: {first!r}")
            await asyncio.wait_for(w.start_tls(self.ssl_ctx or ssl.create_default_context(),
                                               server_hostname=self.host), self.timeout)
        self._r, self._w = r, w

    def close(self) -> None:
        if self._w is not None:
            self._w.transport.abort()
        self._r = self._w = None

    async def send(self, req: Req) -> Res:
        started = time.monotonic()
        try:
            if self._w is None:
                await self._open()
                started = time.monotonic()  # latency is the request's, not the tunnel's setup
            assert self._r is not None and self._w is not None
            target = req.path if self.scheme == "https" else \
                f"http://{self.host}:{self.port}{req.path}"
            lines = [f"{req.method} {target} HTTP/1.1", f"Host: {self.host}",
                     f"X-Soak-Id: {req.rid}"]
            if self.scheme == "http":
                lines.append(f"Proxy-Authorization: {self.auth}")
            lines += [f"{k}: {v}" for k, v in req.headers]
            if req.body or req.method in ("POST", "PUT", "PATCH"):
                lines.append(f"Content-Length: {len(req.body)}")
            self._w.write(("\r\n".join(lines) + "\r\n\r\n").encode() + req.body)
            status, code, raw, body, close = await asyncio.wait_for(
                read_response(self._r, req.method), self.timeout)
            if close:
                self.close()
            return Res(req.rid, status, code, raw, body, time.monotonic() - started, started)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, ProxyClosed,
                TimeoutError, asyncio.LimitOverrunError, ValueError) as e:
            self.close()
            return Res(req.rid, 0, "", b"", b"", time.monotonic() - started, started,
                       error=f"{type(e).__name__}: {e}")


async def read_response(r: asyncio.StreamReader,
                        method: str) -> tuple[int, str, bytes, bytes, bool]:
    """(status, X-Sandgate-Reason, raw bytes, body, connection closes) of one response."""
    head = await r.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.strip().lower()] = v.strip()
    close = headers.get(b"connection", b"").lower() == b"close"
    if method == "HEAD" or status in (204, 304) or status < 200:
        body = b""
    elif b"content-length" in headers:
        body = await r.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks = []
        while True:
            size_line = await r.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await r.readuntil(b"\r\n")  # no trailers expected (Sandgate drops them)
                break
            chunks.append(await r.readexactly(size))
            await r.readexactly(2)
        body = b"".join(chunks)
    else:
        body = await r.read()
        close = True
    return status, headers.get(REASON_HEADER, b"").decode(), head + body, body, close
