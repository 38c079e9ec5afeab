"""The bench's load client: raw HTTP/1.1 over asyncio streams, CONNECT + TLS, the same for every
target. Lean on purpose: on two cores the client's CPU competes with the proxy's."""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from dataclasses import dataclass

REQUEST_BODY = b'{"model":"bench","max_tokens":16,"messages":[{"role":"user","content":"' \
    + b"y" * 160 + b'"}]}'


@dataclass(frozen=True)
class Target:
    """Where the client connects and what it asks for.

    proxy None: TLS straight to (host, port). Otherwise CONNECT `authority` through the proxy
    (with Basic proxy credentials when `proxy_auth` is set), then TLS with SNI `sni`."""

    host: str
    port: int
    sni: str
    cafile: str
    proxy: tuple[str, int] | None = None
    authority: str = ""
    proxy_auth: tuple[str, str] | None = None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.cafile)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: S110 - closing a dead socket
            pass

    def send(self, method: str, path: str, body: bytes = b"", close: bool = False) -> None:
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n")
        if close:
            head += "connection: close\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)

    async def head(self) -> tuple[int, dict[bytes, bytes]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body(self, headers: dict[bytes, bytes], sink: bool = False) -> int:
        """Read the body; returns its length. `sink`: read in chunks without keeping them."""
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            total = 0
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    return total
                await self.reader.readexactly(size + 2)
                total += size
        length = int(headers.get(b"content-length", b"0"))
        if not sink:
            await self.reader.readexactly(length)
            return length
        left = length
        while left:
            data = await self.reader.read(min(left, 1 << 20))
            if not data:
                raise ConnectionError("short body")
            left -= len(data)
        return length

    async def request(self, method: str = "POST", path: str = "/v1/messages",
                      body: bytes = REQUEST_BODY, close: bool = False) -> int:
        self.send(method, path, body, close)
        status, headers = await self.head()
        await self.body(headers)
        if status != 200:
            raise RuntimeError(f"{method} {path}: status {status}")
        return status


async def connect(t: Target) -> Conn:
    if t.proxy is None:
        reader, writer = await asyncio.open_connection(t.host, t.port, ssl=t.ssl_context(),
                                                       server_hostname=t.sni)
        return Conn(reader, writer, f"{t.sni}:{t.port}")
    reader, writer = await asyncio.open_connection(*t.proxy)
    head = f"CONNECT {t.authority} HTTP/1.1\r\nhost: {t.authority}\r\n"
    if t.proxy_auth is not None:
        cred = base64.b64encode(f"{t.proxy_auth[0]}:{t.proxy_auth[1]}".encode()).decode()
        head += f"proxy-authorization: Basic {cred}\r\n"
    writer.write(head.encode() + b"\r\n")
    raw = await reader.readuntil(b"\r\n\r\n")
    status = int(raw.split(b" ", 2)[1])
    if status != 200:
        writer.close()
        raise RuntimeError(f"CONNECT {t.authority}: status {status}: {raw[:200]!r}")
    await writer.start_tls(t.ssl_context(), server_hostname=t.sni)
    return Conn(reader, writer, f"{t.sni}:{t.authority.rpartition(':')[2]}")


async def keepalive(t: Target, requests: int, concurrency: int) -> float:
    """Requests per second over `concurrency` kept-alive connections (opened before timing)."""
    conns = await asyncio.gather(*(connect(t) for _ in range(concurrency)))
    for c in conns:  # one request each first: warm caches, settle the tunnels
        await c.request()
    left = requests

    async def worker(c: Conn) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await c.request()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return requests / elapsed


async def new_connections(t: Target, requests: int, concurrency: int) -> float:
    """Requests per second when each request opens its own CONNECT + TLS."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            c = await connect(t)
            try:
                await c.request()  # like curl: no `Connection: close`; the client just leaves
            finally:
                c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - t0)


async def sse_first_event(t: Target, samples: int) -> float:
    """Median milliseconds from sending a request to reading its first event (warm tunnel)."""
    c = await connect(t)
    await c.request()  # warm: tunnel up, secrets cached
    times: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        c.send("GET", "/sse")
        status, _ = await c.head()
        if status != 200:
            raise RuntimeError(f"/sse: status {status}")
        await c.reader.readuntil(b"\n\n")  # the first chunk's size line and first event
        times.append((time.perf_counter() - t0) * 1000)
        # the rest, however the proxy re-chunked it: up to the last chunk
        await c.reader.readuntil(b"\r\n0\r\n\r\n")
    c.close()
    times.sort()
    return times[len(times) // 2]


async def download(t: Target) -> float:
    """MiB per second of one 20 MiB response."""
    c = await connect(t)
    await c.request()
    t0 = time.perf_counter()
    c.send("GET", "/big")
    status, headers = await c.head()
    n = await c.body(headers, sink=True)
    elapsed = time.perf_counter() - t0
    c.close()
    if status != 200 or n != 20 * 1024 * 1024:
        raise RuntimeError(f"/big: status {status}, {n} bytes")
    return n / (1024 * 1024) / elapsed


def percentiles(times: list[float]) -> tuple[float, float]:
    """(p50, p99) of `times` (nearest rank)."""
    s = sorted(times)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


async def latency_keepalive(t: Target, samples: int) -> tuple[float, float]:
    """p50 and p99 ms of one request at a time on a warm kept-alive connection."""
    c = await connect(t)
    for _ in range(5):
        await c.request()
    times: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        await c.request()
        times.append((time.perf_counter() - t0) * 1000)
    c.close()
    return percentiles(times)


async def latency_new_connection(t: Target, samples: int) -> tuple[float, float]:
    """p50 and p99 ms of CONNECT + TLS + one request, one connection at a time."""
    times: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        c = await connect(t)
        try:
            await c.request()
        finally:
            c.close()
        times.append((time.perf_counter() - t0) * 1000)
    return percentiles(times)
