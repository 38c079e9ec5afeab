"""A fast HTTP/1.1 TLS upstream for soak tests that records which credential each request carried.

Every request names itself with an `X-Soak-Id` header; `Recorder.seen[id]` keeps what arrived for
it (host, method, path, the credential headers, the body length), and `Recorder.dupes` counts ids
that arrived more than once. Answers are small JSON bodies naming the id, so a client can check
that the response it got belongs to its own request. Path prefixes script misbehaviour:

  /echo/...         echoes the credential headers in the body (a leaky API: the proxy must scrub)
  /reset-early/...  reads the request head, then resets before reading the body
  /reset-head/...   reads the request, then resets the connection without a byte of response
  /reset-body/...   sends a head announcing 256 KiB, half of it (quoting the credential), resets
  /reset-stream/... the same with 4 MiB (over what the proxy buffers whole: streamed)
  /silent/...       reads the request and never answers (held until the client goes)

Keep-alive, one event loop in its own thread, no per-request allocation beyond the record.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import threading
from dataclasses import dataclass, field

ID_HEADER = b"x-soak-id"
CREDENTIAL_HEADERS = (b"x-api-key", b"authorization")


@dataclass
class Arrival:
    host: str
    method: str
    path: str
    credentials: dict[str, str]
    body_len: int


@dataclass
class Recorder:
    host: str
    port: int
    cert: str | None = None
    key: str | None = None
    seen: dict[str, Arrival] = field(default_factory=dict)
    dupes: dict[str, int] = field(default_factory=dict)
    anonymous: int = 0  # requests without an id (none are expected)
    silent_open: int = 0  # connections held by /silent right now
    connections: int = 0  # connections accepted so far

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name=f"recorder-{self.host}")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> Recorder:
        ctx = None
        if self.cert and self.key:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.cert, self.key)
            ctx.set_alpn_protocols(["http/1.1"])
        self._thread.start()

        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._handle, self.host, self.port, ssl=ctx,
                                              backlog=1024)

        self._server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def count(self) -> int:
        return len(self.seen)

    # ------------------------------------------------------------------ serving

    def _record(self, headers: dict[bytes, bytes], method: bytes, path: bytes,
                body_len: int) -> tuple[str, dict[str, str]]:
        rid = headers.get(ID_HEADER, b"").decode("latin-1")
        creds = {k.decode(): headers[k].decode("latin-1")
                 for k in CREDENTIAL_HEADERS if k in headers}
        if rid:
            if rid in self.seen:
                self.dupes[rid] = self.dupes.get(rid, 0) + 1
            self.seen[rid] = Arrival(headers.get(b"host", b"").decode("latin-1"),
                                     method.decode("latin-1"), path.decode("latin-1"), creds,
                                     body_len)
        else:
            self.anonymous += 1
        return rid, creds

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(w)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 600)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                    return
                lines = head[:-4].split(b"\r\n")
                method, _, rest = lines[0].partition(b" ")
                path = rest.rpartition(b" ")[0]
                headers: dict[bytes, bytes] = {}
                for ln in lines[1:]:
                    k, _, v = ln.partition(b":")
                    headers[k.strip().lower()] = v.strip()
                n = int(headers.get(b"content-length", b"0") or 0)
                if path.startswith(b"/reset-early/"):
                    self._record(headers, method, path, -1)
                    _reset(w)
                    return
                body = await r.readexactly(n) if n else b""
                rid, creds = self._record(headers, method, path, len(body))
                if path.startswith(b"/silent/"):
                    self.silent_open += 1
                    try:
                        await r.read()  # until the proxy gives up on us
                    finally:
                        self.silent_open -= 1
                    return
                if path.startswith(b"/reset-head/"):
                    _reset(w)
                    return
                if path.startswith((b"/reset-body/", b"/reset-stream/")):
                    quoted = json.dumps(creds).encode()
                    size = 262144 if path.startswith(b"/reset-body/") else 4 << 20
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                            b"Content-Length: " + str(size).encode() + b"\r\n\r\n")
                    w.write((quoted * (size // 2 // len(quoted) + 1))[:size // 2])
                    await w.drain()
                    await asyncio.sleep(0.05)
                    _reset(w)
                    return
                if path.startswith(b"/echo/"):
                    out = json.dumps({"id": rid, "echo": creds}).encode()
                else:
                    out = b'{"id": "' + rid.encode() + b'", "ok": true}'
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                        + str(len(out)).encode() + b"\r\n\r\n" + out)
                await w.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(w)
            if not w.transport.is_closing():
                w.close()


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not FIN: what a crashed or killed upstream looks like."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    w.transport.abort()
