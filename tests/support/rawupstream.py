"""Scripted upstreams on loopback that send what a well-behaved server would not.

`RawServer` speaks HTTP/1.1 by hand (plain or TLS with the test PKI) so a test can answer with a
reason phrase that quotes a secret, a status line that does not parse, chunked trailers, or a
101 to an arbitrary `Upgrade`, and see byte for byte what reached it. `H2TrailerServer` is an
HTTP/2-only TLS server (the `h2` library) that answers every stream with a body and trailers.
Both run their own event loop in a thread; every read has a time limit.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass
class RawRequest:
    """One request as it arrived: the head's lines, split, and the body."""

    line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.decode("latin-1").lower() == name.lower():
                return v.decode("latin-1")
        return None

    @property
    def path(self) -> str:
        parts = self.line.split(b" ")
        return parts[1].decode("latin-1") if len(parts) > 1 else ""


Responder = Callable[[RawRequest], bytes]


def _tls_context(cert: str, key: str, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(alpn)
    return ctx


class _ThreadLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def _serve(self, handler, host: str, port: int, ctx: ssl.SSLContext | None) -> None:
        self._thread.start()

        async def start() -> asyncio.Server:
            return await asyncio.start_server(handler, host, port, ssl=ctx)

        self._server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class RawServer(_ThreadLoop):
    """HTTP/1.1 by hand. `responders` maps a path prefix to a function building the answer.

    `requests` lists every request head that arrived, `raw` every byte per connection. An
    answer whose status is 101 switches the connection to "record only": bytes that follow are
    kept in `raw` and never parsed as requests.
    """

    host: str
    port: int
    cert: str | None = None
    key: str | None = None
    responders: dict[str, Responder] = field(default_factory=dict)
    requests: list[RawRequest] = field(default_factory=list)
    raw: list[bytearray] = field(default_factory=list)

    def __post_init__(self) -> None:
        _ThreadLoop.__init__(self)

    def start(self) -> RawServer:
        ctx = _tls_context(self.cert, self.key, ["http/1.1"]) if self.cert and self.key else None
        self._serve(self._handle, self.host, self.port, ctx)
        return self

    def _answer(self, req: RawRequest) -> bytes:
        for prefix in sorted(self.responders, key=len, reverse=True):
            if req.path.startswith(prefix):
                return self.responders[prefix](req)
        return b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buf = bytearray()
        self.raw.append(buf)
        pending = b""
        switched = False
        try:
            while True:
                try:
                    data = await asyncio.wait_for(r.read(65536), 10)
                except TimeoutError:
                    break
                if not data:
                    break
                buf += data
                if switched:
                    continue
                pending += data
                while b"\r\n\r\n" in pending:
                    head, _, rest = pending.partition(b"\r\n\r\n")
                    lines = head.split(b"\r\n")
                    headers = [tuple(x.strip() for x in ln.split(b":", 1))
                               for ln in lines[1:] if b":" in ln]
                    req = RawRequest(lines[0], headers, b"")  # type: ignore[arg-type]
                    n = int(req.header("content-length") or 0)
                    if len(rest) < n:
                        break
                    req.body, pending = rest[:n], rest[n:]
                    self.requests.append(req)
                    out = self._answer(req)
                    w.write(out)
                    await w.drain()
                    if out.startswith(b"HTTP/1.1 101"):
                        switched = True
                        break
                    if b"connection: close" in out.lower():
                        return
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            w.close()


# ---------------------------------------------------------------- canned answers


def reason_quotes_key(req: RawRequest) -> bytes:
    """A reason phrase that quotes the key the upstream was given."""
    key = (req.header("x-api-key") or "").encode()
    return b"HTTP/1.1 200 OK " + key + b"\r\nContent-Length: 3\r\n\r\nok\n"


def malformed_status_quotes_key(req: RawRequest) -> bytes:
    """A status line that does not parse, quoting the key (error pages tend to echo it)."""
    key = (req.header("x-api-key") or "").encode()
    return b"HTTP/1.1 2OO " + key + b"\r\nContent-Length: 3\r\n\r\nok\n"


def chunked_with_trailers(req: RawRequest) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n"
            b"Content-Type: text/plain\r\n\r\n"
            b"6\r\nhello \r\n6\r\nworld!\r\n0\r\nX-Checksum: abc123\r\n\r\n")


def switch_on_any_upgrade(req: RawRequest) -> bytes:
    """A lenient upstream: 101 to whatever the client asked to upgrade to."""
    up = req.header("upgrade")
    if up:
        return (b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "
                + up.encode("latin-1") + b"\r\n\r\n")
    return b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nno upgrade\r\n"


def echo_credential_forms(req: RawRequest) -> bytes:
    """Echo what Sandgate injected on a Basic + query rule, in the spellings a client can undo.

    One form per line: the Basic pair's base64 as received, the query value as received
    (percent-encoded), and the password as std/urlsafe base64, lower/upper hex and quoted.
    """
    auth = req.header("authorization") or ""
    pair = auth.removeprefix("Basic ").strip()
    try:
        password = base64.b64decode(pair).decode().partition(":")[2]
    except ValueError:
        password = ""
    query = urllib.parse.urlsplit(req.path).query
    raw_q = next((v for k, _, v in (p.partition("=") for p in query.split("&"))
                  if k == "access_token"), "")
    pw = password.encode()
    lines = [
        f"basic-pair {pair}",
        f"query-value {raw_q}",
        f"b64 {base64.b64encode(pw).decode()}",
        f"b64url {base64.urlsafe_b64encode(pw).decode()}",
        f"hex {pw.hex()}",
        f"HEX {pw.hex().upper()}",
        f"pct {urllib.parse.quote(password, safe='')}",
        "end",
    ]
    body = ("\n".join(lines) + "\n").encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


# ---------------------------------------------------------------- HTTP/2 with trailers


@dataclass
class H2TrailerServer(_ThreadLoop):
    """HTTP/2 only (ALPN h2): answers each stream with 200, a body and trailers that echo the
    x-api-key it received (an upstream that leaks in the one place scrubbers forget)."""

    host: str
    port: int
    cert: str
    key: str
    streams: list[list[tuple[bytes, bytes]]] = field(default_factory=list)
    # the client address of the connection each stream came on (one per connection)
    peers: list[object] = field(default_factory=list)

    def __post_init__(self) -> None:
        _ThreadLoop.__init__(self)

    def start(self) -> H2TrailerServer:
        self._serve(self._handle, self.host, self.port, _tls_context(self.cert, self.key, ["h2"]))
        return self

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                                 header_encoding=None))
        c.initiate_connection()
        w.write(c.data_to_send())
        try:
            while True:
                try:
                    data = await asyncio.wait_for(r.read(65536), 10)
                except TimeoutError:
                    break
                if not data:
                    break
                for ev in c.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        self.streams.append(list(ev.headers))
                        self.peers.append(w.get_extra_info("peername"))
                        key = dict(ev.headers).get(b"x-api-key", b"")
                        sid = ev.stream_id
                        c.send_headers(sid, [(b":status", b"200"),
                                             (b"content-type", b"text/plain")])
                        c.send_data(sid, b"hello over h2\n")
                        c.send_headers(sid, [(b"x-echo-key", key), (b"x-checksum", b"abc")],
                                       end_stream=True)
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        return
                w.write(c.data_to_send())
                await w.drain()
        except (ConnectionError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass
        finally:
            w.close()
