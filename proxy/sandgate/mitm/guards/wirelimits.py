"""Limits below the hooks: how much of a request head is buffered, and how long anything may take.

mitmproxy 12.3.1 leaves these open, and no addon hook runs early enough to close them:

1. HTTP/1 request heads (the CONNECT head and heads inside a tunnel) are buffered until the blank
   line with no bound (`Http1Server.read_headers`: "FIXME: protect against header size DoS").
   Here a head that has not ended within `max_header_bytes` is answered 431
   `headers_too_large` and the connection closed (at most one read, 64 KiB, past the limit is
   ever held). The header count, and the size of heads that did fit, are checked in the hooks.
   Upstream response heads (same FIXME in `Http1Client`) are bounded at RESPONSE_HEAD_BYTES or
   `max_header_bytes`, whichever is larger: 502 `upstream_error`.
2. HTTP/2 header blocks are bounded by h2 itself: at most 64 CONTINUATION frames of up to
   mitmproxy's 128 KiB frame size (8 MiB encoded), decoded up to 64 KiB (hpack). On client
   connections the encoded block and the decoded list are bounded here by `h2_readable_head`
   (512 KiB, or twice `max_header_bytes`, plus hpack's 32 bytes a header); above that h2 ends
   the connection (GOAWAY), below it the hooks answer 431 on the stream for a head over
   `max_header_bytes`.
3. Slow clients: an HTTP/1 head that has started must end within `header_timeout` (408
   `header_timeout`, connection closed); any connection on which nothing moves in either
   direction for `idle_timeout` is closed (mitmproxy's own watchdog: its `tcp_timeout` option,
   pinned to it by addons/pinned.py).
4. Upstreams: the TCP connect must succeed within `upstream_connect_timeout`, and once connected
   the upstream must send something within `upstream_read_timeout` of the last byte that went
   either way on that connection (so: to the ServerHello after the ClientHello, to the response
   head after the request was sent, and between body chunks of a response). WebSocket and
   passthrough connections are exempt (the idle timeout applies to them). Either answers 504
   `upstream_timeout` with the refusal body. A connection the upstream reset before asyncio
   made its transport (no peername) is a failed dial, 502 `upstream_error` (mitmproxy's own
   dial asserts a peername, and that assertion left the request without an answer).

5. Unparseable HTTP/1 request heads: mitmproxy answers them 400 itself, before any flow or hook
   exists, and only logs them. Each gets its `request` event here (decision deny, code
   bad_request, a fixed reason: mitmproxy's message quotes the head, which may hold a secret).

`install(limits, on_event)` is idempotent and takes the latest limits; `installed()` lets a unit
test pin the patched attributes, so a mitmproxy upgrade that moves them fails loudly.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
import types
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, SupportsIndex

import h2.exceptions
import h2.frame_buffer
from hyperframe.frame import HeadersFrame
from mitmproxy import connection, http
from mitmproxy.proxy import commands, events, server
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers import tls as tls_layer
from mitmproxy.proxy.layers.http import _http1, _http_h2
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError

from sandgate.audit import events as A
from sandgate.errors import Code
from sandgate.limits import LimitsConfig
from sandgate.mitm.guards import corrections, dialorigin, readable

log = logging.getLogger("sandgate")

_MARK = "_sandgate_wirelimits"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


# In every error message of a timeout Sandgate imposed upstream: answered 504
# (mitm/guards/corrections.py).
TIMEOUT_MARK = corrections.TIMEOUT_MARK
RESET_MESSAGE = "sandgate: the upstream reset the connection"
_HPACK_OVERHEAD = 32  # hpack counts 32 bytes per header on top of name and value (RFC 7541 4.1)
# The least HTTP/2 header block that is still decoded and answered 431 (see h2_readable_head):
# a 256 KiB cookie or token header, as clients send by mistake, gets a readable refusal.
H2_READABLE_HEAD = 512 * 1024
_BLANK_LINE = re.compile(rb"\n\r?\n")
RESPONSE_HEAD_BYTES = 256 * 1024  # upstream response heads: generous (cookies), but bounded

# (event, fields) -> None: the audit sink for what happens below the hooks
OnEvent = Callable[[str, dict[str, Any]], None]


@dataclass
class _State:
    limits: LimitsConfig
    on_event: OnEvent


_state = _State(LimitsConfig(), lambda _e, _f: None)
# The upstream connection ConnectionHandler.open_connection is dialling (read by the dialler).
_dialling: contextvars.ContextVar[connection.Server | None] = contextvars.ContextVar(
    "sandgate_dialling", default=None)
# Upstream connections the read timeout does not apply to (WebSocket, passthrough), and those it
# closed (their stream's error becomes a 504). Connection ids; emptied on server_disconnected.
_exempt: set[str] = set()
_timed_out: set[str] = set()
# Upstream connection id -> the checked address it dials; the connection keeps the name it was
# judged for as its address (see `dial_at`). Emptied on server_disconnected.
_dial_at: dict[str, tuple[str, int]] = {}


def head_bytes(req: http.Request) -> int:
    """The size of a request head as HTTP/1 carries it (request line, header lines, blank line);
    an HTTP/2 head is measured the same way, its pseudo-headers as the request line."""
    d = req.data
    target = d.path or d.authority
    n = len(d.method) + len(target) + len(b"HTTP/1.1") + 4 + 2
    for name, value in req.headers.fields:
        n += len(name) + len(value) + 4
    return n


def _peer(conn: connection.Connection) -> str | None:
    p = conn.peername
    return f"{p[0]}:{p[1]}" if p else None


def _emit(event: str, code: Code, reason: str, conn: connection.Connection) -> None:
    try:
        _state.on_event(event, {"code": str(code), "reason": reason, "client": _peer(conn)})
    except Exception:
        log.exception("sandgate: audit failed")


def _emit_unparsed(conn: connection.Client) -> None:
    """The request event of a head mitmproxy refused before there was a flow (see 5.)."""
    mode = conn.proxy_mode.type_name
    try:
        _state.on_event("request", {
            A.IDENTITY: None, A.SANDBOX: None, A.IDENTITY_SOURCE: None, A.CLIENT: _peer(conn),
            A.METHOD: None, A.SCHEME: None, A.HOST: None, A.PORT: None, A.PATH: None,
            A.RULE: None, A.DECISION: "deny", A.CODE: str(Code.BAD_REQUEST),
            A.REASON: "the request head could not be parsed as HTTP/1",
            A.SECRETS: [], A.UPSTREAM_STATUS: None, A.BYTES_IN: 0, A.BYTES_OUT: 0,
            A.DURATION_MS: 0.0, A.DIALED: None, A.EXFIL: [], A.REDACTIONS: 0, A.ERROR: None,
            A.LISTENER: "http" if mode == "regular" else mode})
    except Exception:
        log.exception("sandgate: audit failed")


# ------------------------------------------------------------------------ 1 + 3: HTTP/1 heads

def _head_over(buf: Any, limit: int) -> bool:
    """Has more than `limit` bytes been buffered without the head ending within them?"""
    if len(buf) <= limit:
        return False
    return _BLANK_LINE.search(bytes(buf)[:limit + 4]) is None


def _refuse_head(self: Any, code: Code, reason: str) -> Generator[Any, Any, None]:
    """Answer a head that will not be read (through the layers: a TLS client gets it
    encrypted) and close. A head over the size limit is still being sent: the connection is
    closed gracefully (the rest is read and discarded, bounded), so that the client reads the
    answer instead of a reset (readable.py). A head past its time is not: closed at once."""
    self._sg_head_deadline = None
    _emit("limit", code, reason, self.conn)
    yield commands.SendData(self.conn, readable.refusal_response(code, reason))
    self.state = self.done
    if code == Code.HEADERS_TOO_LARGE:
        yield from readable.close_gracefully(self)
    else:
        yield commands.CloseConnection(self.conn)


def _wrap_read_headers(original: Any) -> Any:
    def read_headers(self: Any, event: events.ConnectionEvent) -> Generator[Any, Any, None]:
        limits = _state.limits
        if isinstance(event, events.DataReceived) and _head_over(self.buf,
                                                                 limits.max_header_bytes):
            yield from _refuse_head(self, Code.HEADERS_TOO_LARGE, "the request head is larger "
                                    f"than {limits.max_header_bytes} bytes")
            return
        yield from original(self, event)
        if (isinstance(event, events.DataReceived) and self.state == self.done
                and self.request is None):
            _emit_unparsed(self.conn)  # answered 400 and closed by mitmproxy, no flow made
        if not (self.state == self.read_headers and self.buf):
            self._sg_head_deadline = None  # no head in progress
        elif limits.header_timeout and getattr(self, "_sg_head_deadline", None) is None:
            self._sg_head_deadline = time.monotonic() + limits.header_timeout
            yield from _wake_at_deadline(self)

    return read_headers


def _wake_at_deadline(self: Any) -> Generator[Any, Any, None]:
    """One wakeup outstanding at a time; a stale one (the head ended) is ignored on arrival."""
    if getattr(self, "_sg_wakeup", None) is None and self._sg_head_deadline is not None:
        self._sg_wakeup = commands.RequestWakeup(
            max(0.0, self._sg_head_deadline - time.monotonic()))
        yield self._sg_wakeup


def _wrap_handle_event(original: Any) -> Any:
    def _handle_event(self: Any, event: events.Event) -> Generator[Any, Any, None]:
        if isinstance(event, events.Wakeup) and event.command is getattr(self, "_sg_wakeup",
                                                                          None):
            self._sg_wakeup = None
            deadline = getattr(self, "_sg_head_deadline", None)
            if deadline is None or self.state != self.read_headers:
                return
            if time.monotonic() >= deadline - 0.01:
                yield from _refuse_head(self, Code.HEADER_TIMEOUT, "the request head did not "
                                        f"arrive within {_state.limits.header_timeout:g}s")
            else:  # a later head than the one this wakeup was for
                yield from _wake_at_deadline(self)
            return
        yield from original(self, event)

    return _handle_event


_INTERIM = re.compile(rb"HTTP/1\.[01] 1(?!01)[0-9][0-9][ \r\n]")


def drop_interim(buf: Any) -> int:
    """Remove the complete 1xx heads (not 101) at the start of an upstream's receive buffer;
    how many were removed.

    mitmproxy 11.0.2 reads an HTTP/1 1xx head as the final response (no body), so the client
    got a `100 Continue` or `103 Early Hints` as its answer and the real response was lost (the
    client hung). A proxy may drop them: mitmproxy answers `Expect: 100-continue` to the client
    itself (and removes the header, so an upstream's 100 is never solicited), and drops 1xx from
    HTTP/2 upstreams already; 103 is a hint, and its headers would be one more channel."""
    data = bytes(buf)
    at = n = 0
    while _INTERIM.match(data, at):
        end = _BLANK_LINE.search(data, at)
        if end is None:
            break  # not complete yet: wait for more
        at = end.end()
        n += 1
    if at:
        buf._extract(at)  # h11's ReceiveBuffer: drop the first `at` bytes
    return n


def _wrap_response_head(original: Any) -> Any:
    def read_headers(self: Any, event: events.ConnectionEvent) -> Generator[Any, Any, None]:
        limit = max(RESPONSE_HEAD_BYTES, _state.limits.max_header_bytes)
        if isinstance(event, events.DataReceived) and self.request is not None:
            drop_interim(self.buf)
            if not self.buf:
                return  # only interim heads so far: wait for the final one
        if (isinstance(event, events.DataReceived) and self.stream_id is not None
                and self.request is not None and _head_over(self.buf, limit)):
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(
                self.stream_id, f"sandgate: the upstream's response head is larger than "
                f"{limit} bytes", ErrorCode.GENERIC_SERVER_ERROR))
            self.state = self.done
            return
        yield from original(self, event)

    return read_headers


# ------------------------------------------------------------------------ 2: HTTP/2 headers

def h2_readable_head(limits: LimitsConfig) -> int:
    """How large an HTTP/2 header block a client may send and still get a readable answer.

    HPACK is one state for the whole connection: a block that is not decoded cannot be skipped,
    so a block past h2's bounds ends the connection (GOAWAY), which clients report as "Connection
    died" with nothing to show. Blocks up to this size are decoded and then answered `431
    headers_too_large` on their stream by the hooks (over `max_header_bytes`); the bound is per
    connection (one header block is in flight at a time), so what a connection may hold before
    it is identified stays bounded.
    """
    return max(H2_READABLE_HEAD, 2 * limits.max_header_bytes)


def _wrap_h2_init(original: Any) -> Any:
    def __init__(self: Any, config: Any) -> None:
        original(self, config)
        if not config.client_side:  # facing a client
            limits = _state.limits
            readable = h2_readable_head(limits)
            decoded = readable + _HPACK_OVERHEAD * (limits.max_headers + 8)
            self.decoder.max_header_list_size = decoded
            self.local_settings.max_header_list_size = decoded
            self.local_settings.acknowledge()
            self.incoming_buffer._sg_max_block = readable + 8 * (limits.max_headers + 8) + 1024

    return __init__


def _wrap_update_header_buffer(original: Any) -> Any:
    def _update_header_buffer(self: Any, f: Any) -> Any:
        limit = getattr(self, "_sg_max_block", None)
        out = original(self, f)
        if limit is not None:
            held = sum(len(x.data) for x in self._headers_buffer)
            if isinstance(out, HeadersFrame):
                held = max(held, len(out.data))
            if held > limit:
                raise h2.exceptions.DenialOfServiceError(
                    f"header block larger than {limit} bytes")
        return out

    return _update_header_buffer


# ------------------------------------------------------------------------ 4: upstream timeouts

class _SilenceReader(asyncio.StreamReader):
    """An upstream connection's reader that ends with a TimeoutError once the connection has
    been silent for the read timeout (counted from the last byte received or sent).

    One timer per connection checks the deadline at most once a second (so a reload that
    shortens the timeout, or an exemption, is seen within a second) and re-arms itself; reads
    and writes only store a timestamp. (A task and an `asyncio.wait` per read cost more than
    the relaying itself.)"""

    def __init__(self, server_conn: connection.Server | None, limit: int) -> None:
        super().__init__(limit=limit)
        self.loop = asyncio.get_running_loop()
        self.sid = server_conn.id if server_conn is not None else None
        self.last = self.loop.time()
        self.ended = False

    def arm(self) -> None:
        """Start counting (the connection is up)."""
        self.last = self.loop.time()
        self.loop.call_later(min(_state.limits.upstream_read_timeout or 1.0, 1.0), self._check)

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.last = self.loop.time()
        super().feed_data(data)

    def feed_eof(self) -> None:
        self.ended = True
        super().feed_eof()

    def _check(self) -> None:
        if self.ended or self.exception() is not None or self.sid in _exempt:
            return  # over, or exempt for good (WebSocket, passthrough): the timer stops
        timeout = _state.limits.upstream_read_timeout
        left = (self.last + timeout - self.loop.time()) if timeout else 1.0
        if left <= 0:
            if self.sid is not None:
                _timed_out.add(self.sid)
            # wakes the pending read with it; mitmproxy's read loop treats it as a close
            self.set_exception(TimeoutError(
                f"{TIMEOUT_MARK}: nothing from the upstream for {timeout:g}s"))
            return
        self.loop.call_later(min(left, 1.0), self._check)


class _TimedWriter:
    BATCHED = True  # writes.Batched wraps it too: a StreamWriter underneath, one write per event

    def __init__(self, inner: asyncio.StreamWriter, reader: _SilenceReader) -> None:
        self._inner = inner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self, data: bytes) -> None:
        self._reader.last = self._reader.loop.time()
        self._inner.write(data)


class _AsyncioForServer(types.ModuleType):
    """`asyncio` as mitmproxy's proxy/server.py sees it: open_connection with the connect
    timeout, returning the timed reader and writer. Everything else is asyncio's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def open_connection(self, host: Any = None, port: Any = None, *,
                              limit: int = 2**17, **kwargs: Any) -> tuple[Any, Any]:
        # asyncio.open_connection, with the reader that keeps the read timeout
        timeout = _state.limits.upstream_connect_timeout
        loop = asyncio.get_running_loop()
        dialling = _dialling.get()
        at = _dial_at.get(dialling.id) if dialling is not None else None
        if at is not None:
            host, port = at
        reader = _SilenceReader(dialling, limit)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: protocol, host, port, **kwargs),
                timeout or None)
        except TimeoutError:
            raise TimeoutError(f"{TIMEOUT_MARK}: could not connect within {timeout:g}s") \
                from None
        if transport.get_extra_info("peername") is None:
            # The upstream reset the connection after the connect completed but before asyncio
            # made its transport (a busy loop: the RST lands in between), so getpeername()
            # failed. mitmproxy asserts a peername right after the dial: that assertion killed
            # the dialling task and the request waited for ever. A reset is what it is.
            transport.close()
            raise ConnectionResetError(f"{RESET_MESSAGE} (before the connection could be "
                                       "used)")
        reader.arm()
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return reader, _TimedWriter(writer, reader)


def _wrap_open_connection(original: Any) -> Any:
    async def open_connection(self: Any, command: commands.OpenConnection) -> None:
        token = _dialling.set(command.connection)
        try:
            await original(self, command)
        finally:
            _dialling.reset(token)

    return open_connection


def _wrap_protocol_error(original: Any) -> Any:
    def handle_protocol_error(self: Any, event: Any) -> Generator[Any, Any, None]:
        # the error page is 504 when its message carries TIMEOUT_MARK (mitm/guards/corrections.py)
        if isinstance(event, ResponseProtocolError) and TIMEOUT_MARK not in event.message \
                and self.flow.server_conn.id in _timed_out:
            message = (f"{TIMEOUT_MARK}: nothing from the upstream for "
                       f"{_state.limits.upstream_read_timeout:g}s")
            event = ResponseProtocolError(event.stream_id, message,
                                          ErrorCode.GENERIC_SERVER_ERROR)
        yield from original(self, event)

    return handle_protocol_error


def _wrap_handshake_finished(original: Any) -> Any:
    def _handshake_finished(self: Any, err: str | None) -> Generator[Any, Any, None]:
        # The read timeout closed the connection mid-handshake: mitmproxy only sees a close
        # ("connection closed", a 502); say it was a timeout so the stream answers 504.
        if err and TIMEOUT_MARK not in err and self.tunnel_connection.id in _timed_out:
            err = (f"{TIMEOUT_MARK}: no TLS handshake from the upstream within "
                   f"{_state.limits.upstream_read_timeout:g}s")
            self.conn.error = err
        yield from original(self, err)

    return _handshake_finished


def exempt(server_conn: connection.Server) -> None:
    """No read timeout on this upstream connection (a WebSocket, a passthrough tunnel)."""
    _exempt.add(server_conn.id)


def is_exempt(server_conn: connection.Server) -> bool:
    """A WebSocket or passthrough relay ran on this connection (it is no HTTP exchange)."""
    return server_conn.id in _exempt


def dial_at(server_conn: connection.Server, address: tuple[str, int]) -> None:
    """Dial `address` (the checked IP) for this upstream connection while its `address` stays
    the name it was judged for. mitmproxy reuses a connection for any later request whose
    address equals it: keyed by name, two names sharing an IP never share a TLS connection
    verified for one of them. (Renaming the connection once open is refused by mitmproxy:
    "Cannot change server.address on open connection".)"""
    _dial_at[server_conn.id] = address


class WireLimits:
    """The addon side: exemptions, and forgetting connections that closed."""

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        exempt(flow.server_conn)

    def server_disconnected(self, data: Any) -> None:
        _exempt.discard(data.server.id)
        _timed_out.discard(data.server.id)
        _dial_at.pop(data.server.id, None)
        dialorigin.forget(data.server)  # a dial cancelled before its server_connect hook


# ------------------------------------------------------------------------ idle timeout

def _wrap_on_timeout(original: Any) -> Any:
    async def on_timeout(self: Any) -> None:
        if self.client.transport_protocol == "tcp":
            _emit("limit", Code.IDLE_TIMEOUT, "nothing moved on the connection for "
                  f"{_state.limits.idle_timeout:g}s", self.client)
        await original(self)

    return on_timeout


def admission_closed(code: Code, reason: str, client: connection.Client) -> None:
    """admission's on_close: a connection it closes is a `limit` event like the others here."""
    _emit("limit", code, reason, client)


def install(limits: LimitsConfig, on_event: OnEvent | None = None) -> None:
    """Installed after admission and readable (sandgate.mitm.registry: their order)."""
    _state.limits = limits
    if on_event is not None:
        _state.on_event = on_event
    # (the idle timeout itself is mitmproxy's `tcp_timeout` option, pinned: addons/pinned.py)
    if getattr(_http1, _MARK, False):
        return
    srv = _http1.Http1Server
    srv.read_headers = _wrap_read_headers(srv.read_headers)  # type: ignore[method-assign]
    srv._handle_event = _wrap_handle_event(srv._handle_event)  # type: ignore[method-assign]
    cli = _http1.Http1Client
    cli.read_headers = _wrap_response_head(cli.read_headers)  # type: ignore[method-assign]
    conn_cls = _http_h2.BufferedH2Connection
    conn_cls.__init__ = _wrap_h2_init(conn_cls.__init__)  # type: ignore[method-assign]
    fb = h2.frame_buffer.FrameBuffer
    fb._update_header_buffer = _wrap_update_header_buffer(  # type: ignore[method-assign]
        fb._update_header_buffer)
    handler = server.ConnectionHandler
    handler.open_connection = _wrap_open_connection(  # type: ignore[method-assign]
        handler.open_connection)
    handler.on_timeout = _wrap_on_timeout(handler.on_timeout)  # type: ignore[method-assign]
    setattr(server, "asyncio", _AsyncioForServer("asyncio"))  # noqa: B010
    server_tls = tls_layer.ServerTLSLayer
    server_tls._handshake_finished = _wrap_handshake_finished(  # type: ignore[method-assign]
        server_tls._handshake_finished)
    stream = http_layer.HttpStream
    stream.handle_protocol_error = _wrap_protocol_error(  # type: ignore[method-assign]
        stream.handle_protocol_error)
    setattr(_http1, _MARK, True)


def installed() -> bool:
    return bool(getattr(_http1, _MARK, False)) and isinstance(
        getattr(server, "asyncio", None), _AsyncioForServer)
