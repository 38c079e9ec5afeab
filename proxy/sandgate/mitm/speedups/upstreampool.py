"""Upstream connections reused across client connections of the same caller.

Every `curl`, `pip` or `npm` process a sandbox runs opens a new connection to the proxy, and
mitmproxy opens a new upstream connection (TCP, TLS handshake, certificate verification, the
dial hooks) for each, and closes it when the client goes. Here an idle upstream connection
(HTTP/1.1, or HTTP/2 with its session) is *parked* when its client connection ends, and the
next client connection of the same caller that needs the same upstream *adopts* it instead of
dialling.

The key, and why it is safe (`key_for`): (identity, sandbox, identity source, the listener the
client came in on, the checked IP and port dialled, the name TLS verified). A parked
connection only ever serves the caller that opened it, through the same listener (pattern 1:
the tool listener and the agent's never share one), to the address that caller's own request
was checked for, under the name the certificate was verified for. So even an upstream that
desynchronised (an extra response, a smuggled one) could only hand a sandbox a response to a
request of that same sandbox, as keep-alive on one client connection already can; and a
connection is only parked when nothing is left unread on it (below). Every request on an
adopted connection is identified, judged, pinned, injected, scrubbed and audited like any
other: reuse skips only the dial, whose checks (`s60_dial`) were made for the same key.

Parked only when exactly idle: the HTTP/1 client layer between messages (no request or response
open, nothing buffered), TLS open with no pending plaintext and no shutdown, the socket open
both ways with no unread byte, not a WebSocket or other pipe, the last response not
`Connection: close` (mitmproxy closes those itself); for HTTP/2 no stream open or queued either
way and nothing buffered in the session, which moves along with the connection. Taken only
when still idle: nothing arrived while parked (an end of stream, data, an error: the
connection is closed instead), and not parked longer than `upstream_reuse_idle` (default 2 s:
under the keep-alive timeout of common servers, 5 s and more, so an upstream rarely closes a
connection as it is adopted). Bounded: at most PER_KEY connections a key, TOTAL in all; a
policy reload empties the pool.

How the move is done, in mitmproxy 11.0.2 terms: parking takes the connection's reader, writer
and OpenSSL object, gives its old handler a detached writer and cancels that handler's read
task (so the old layers see the close and nothing is written or closed on the socket);
adopting builds the stack `get_connection` would build (a ServerTLSLayer, an HttpClient) with
the TLS already open, registers the transport with the new client's handler and starts its
read loop. `install()` is idempotent; `installed()` lets a unit test pin the patch.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Generator
from typing import Any

import h2.connection
from mitmproxy import connection, http
from mitmproxy import tls as tls_hooks
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, server, server_hooks, tunnel
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers import tls as tls_layer
from mitmproxy.proxy.layers.http import _http1, _http2

from sandgate.mitm.guards import wirelimits
from sandgate.mitm.speedups import writes
from sandgate.mitm.speedups.parking import DEFAULT_IDLE, Parked, PoolKey, reader_quiet
from sandgate.mitm.speedups.parking import POOL as POOL
from sandgate.stages.flow import METADATA_KEY

log = logging.getLogger("sandgate")

_MARK = "_sandgate_upstreampool"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


# What a server connection brings along: copied onto the adopting Server object.
_FIELDS = ("peername", "sockname", "sni", "alpn", "alpn_offers", "cipher", "cipher_list",
           "tls_version", "certificate_list", "timestamp_start", "timestamp_tcp_setup",
           "timestamp_tls_setup")


# client connection id -> its handler (to park its upstreams and register adopted ones)
_HANDLERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
# upstream Server id -> the context its TLS/HTTP client layers share (their stack)
_STACKS: dict[str, Any] = {}
# upstream Server id -> the key of the requests it carried
_KEYS: dict[str, PoolKey] = {}
# upstream Server id -> the parked connection its OpenConnection is to be answered with
_ADOPTING: dict[str, Parked] = {}


class _Detached:
    """The writer a parked connection's old handler keeps: it writes and closes nothing."""

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def write_eof(self) -> None:
        pass

    async def drain(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _AdoptedTLS(tls_layer.ServerTLSLayer):
    """A ServerTLSLayer whose connection is a parked one: its OpenConnection goes up the
    stack as usual (each HTTP layer on the way learns the connection), the handler answers it
    with the parked transport (`_open_adopted`), and the TLS is already up: no handshake."""

    def __init__(self, context: Any, parked: Parked) -> None:
        super().__init__(context)
        self._parked_ssl = parked.ssl

    def _handle_command(self, command: commands.Command) -> Generator[Any, Any, None]:
        if isinstance(command, commands.OpenConnection) and command.connection == self.conn:
            err = yield commands.OpenConnection(self.tunnel_connection)
            if err:
                self.tunnel_state = tunnel.TunnelState.CLOSED
            else:
                self.tls = self._parked_ssl
                self.tunnel_state = tunnel.TunnelState.OPEN
            yield from self.event_to_child(events.OpenConnectionCompleted(command, err))
        else:
            yield from super()._handle_command(command)


def _layers(server_conn: connection.Server) -> tuple[Any, Any] | None:
    """The ServerTLSLayer and HTTP client layer (Http1Client or Http2Client) of this upstream
    connection, if it has exactly those."""
    ctx = _STACKS.get(server_conn.id)
    if ctx is None:
        return None
    tls = client = None
    for layer in ctx.layers:
        if isinstance(layer, tls_layer.ServerTLSLayer) and layer.conn is server_conn:
            tls = layer
        elif (isinstance(layer, (_http1.Http1Client, _http2.Http2Client))
              and layer.conn is server_conn):
            client = layer
    if tls is None or client is None:
        return None
    return tls, client


def _h1_idle(h1: Any) -> bool:
    return not (h1.stream_id is not None or h1.request is not None or h1.response is not None
                or h1.request_done or h1.response_done or len(h1.buf)
                or h1.state != h1.read_headers)


def _h2_idle(h2c: Any) -> bool:
    """No stream open or queued either way, nothing buffered in or out, the session alive."""
    conn = h2c.h2_conn
    return (h2c._paused is None and not h2c.stream_queue
            and conn.open_outbound_streams == 0 and conn.open_inbound_streams == 0
            and conn.state_machine.state is not h2.connection.ConnectionState.CLOSED
            and not len(getattr(conn, "_data_to_send", b""))
            and not len(conn.incoming_buffer._data)  # h2 4.4 (4.1: .data)
            and not any(conn.stream_buffers.values()))


class _AdoptedHttpClient(http_layer.HttpClient):
    """HttpClient over an adopted connection. HTTP/1.1: a fresh Http1Client (the connection
    is between messages). HTTP/2: the session's own Http2Client, moved to this stack (a new
    one would start a second session on the same connection); its stream id maps are the old
    client connection's and start empty here (no stream was open when it was parked)."""

    def __init__(self, context: Any, h2c: Any) -> None:
        super().__init__(context)
        self._h2c = h2c

    def _handle_event(self, event: events.Event) -> Generator[Any, Any, None]:
        if not isinstance(event, events.Start):
            raise AssertionError(f"unexpected event before the connection: {event}")
        err = yield commands.OpenConnection(self.context.server)
        if not err:
            if self._h2c is not None:
                child = self._h2c
                child.context = self.context
                child.conn = self.context.server
                self.context.layers.append(child)
                child.our_stream_id.clear()
                child.their_stream_id.clear()
                child.stream_queue.clear()
                child.streams.clear()
                self.child_layer = child
                self._handle_event = child.handle_event  # type: ignore[method-assign]
            else:
                self.child_layer = _http1.Http1Client(self.context)
                self._handle_event = self.child_layer.handle_event  # type: ignore[method-assign]
                yield from self._handle_event(event)
        yield http_layer.RegisterHttpConnection(self.context.server, err)


def _idle(server_conn: connection.Server, io: Any) -> tuple[Any, Any, Any] | None:
    """(tls layer, raw writer, the h2 client layer or None) of an exactly idle, reusable
    connection, else None."""
    if (server_conn.state is not ConnectionState.OPEN or server_conn.error
            or server_conn.alpn not in (None, b"", b"http/1.1", b"h2") or io is None
            or io.reader is None or io.writer is None):
        return None
    if wirelimits.is_exempt(server_conn):
        return None  # a WebSocket (or other relay) ran on it
    found = _layers(server_conn)
    if found is None:
        return None
    tls, client = found
    if (tls.tunnel_state is not tunnel.TunnelState.OPEN or tls.tls is None
            or tls.tls.pending() or tls.tls.get_shutdown()):
        return None
    if isinstance(client, _http2.Http2Client):
        if server_conn.alpn != b"h2" or not _h2_idle(client):
            return None
    elif server_conn.alpn == b"h2" or not _h1_idle(client):
        return None
    if not reader_quiet(io.reader):
        return None
    writer = io.writer
    raw = writer
    if type(writer) is writes.Batched:  # per handler (mitm/speedups/writes.py): send what it holds
        writer.flush()
        raw = writer.raw
    if raw.is_closing():
        return None
    return tls, raw, client if isinstance(client, _http2.Http2Client) else None


def park(client: connection.Client) -> None:
    """The client connection ended: park its idle upstream connections that have a key."""
    handler = _HANDLERS.get(client.id)
    if handler is None or POOL.idle <= 0:
        return
    for conn, io in list(handler.transports.items()):
        key = _KEYS.get(conn.id)
        if key is None or conn is client:
            continue
        got = _idle(conn, io)
        if got is None:
            continue
        tls, raw, h2c = got
        _detach(conn)
        p = Parked(key, io.reader, raw, tls.tls, {f: getattr(conn, f) for f in _FIELDS},
                   time.monotonic(), h2=h2c)
        old = io.handler
        io.writer = _Detached()
        handler.transports[conn] = io
        if old is None or old.done():
            p.ready = True
        else:
            old.add_done_callback(lambda _t, p=p: setattr(p, "ready", True))
            old.cancel("sandgate: parked for reuse")
        POOL.put(p)


def _inert(event: events.Event) -> Generator[Any, Any, None]:
    return
    yield


def _detach(server_conn: connection.Server) -> None:
    """The old stack's HttpClient stops passing events down: the close its handler is about to
    send must not reach the HTTP client layer (an h2 session moves with the connection and
    would answer a close with GOAWAY and end itself)."""
    ctx = _STACKS.get(server_conn.id)
    for layer in ctx.layers if ctx is not None else ():
        if isinstance(layer, http_layer.HttpClient) and layer.context is ctx:
            layer._handle_event = _inert


def forget(server_conn: connection.Server) -> None:
    _STACKS.pop(server_conn.id, None)
    p = _ADOPTING.pop(server_conn.id, None)
    if p is not None:
        p.close()
    _KEYS.pop(server_conn.id, None)


async def _open_adopted(handler: Any, command: commands.OpenConnection, p: Parked) -> None:
    """open_connection for an adopted connection: the parked transport instead of a dial (its
    checks were made for the same key), then the same read loop and end hook."""
    srv = command.connection
    # On Python 3.12+ mitmproxy runs tasks eagerly (Master.run: asyncio's eager task factory):
    # this one starts inside server_event, before server_event registers its own ConnectionIO
    # for the connection (without reader or writer). Yield once, so that the registration
    # below, with the parked transport, is the one that stays.
    await asyncio.sleep(0)
    srv.state = ConnectionState.OPEN
    # from here the handler owns the transport: its read loop's end closes it (or parks it)
    handler.transports[srv] = server.ConnectionIO(handler=asyncio.current_task(),
                                                  reader=p.reader, writer=p.writer)
    if hasattr(p.reader, "sid"):
        p.reader.sid = srv.id  # wirelimits: a read timeout is this connection's
    await handler.server_event(events.OpenConnectionCompleted(command, None))
    try:
        await handler.handle_connection(srv)
    finally:
        srv.timestamp_end = time.time()
        await handler.handle_hook(server_hooks.ServerDisconnectedHook(
            server_hooks.ServerConnectionHookData(client=handler.client, server=srv)))


def _adopt(layer: Any, event: Any) -> Generator[Any, Any, None] | None:
    """A generator that hands `event` an adopted connection, or None (dial as usual)."""
    if not POOL.size or not event.tls or event.via is not None \
            or event.transport_protocol != "tcp":
        return None
    stream = layer.command_sources.get(event)
    flow = getattr(stream, "flow", None)
    if not isinstance(flow, http.HTTPFlow):
        return None
    rec = flow.metadata.get(METADATA_KEY)
    key = getattr(rec, "reuse", None)
    if key is None or (key[4], key[5]) != tuple(event.address):
        return None
    for c in layer.connections:  # mitmproxy's own reuse comes first
        if event.connection_spec_matches(c):
            return None
    ctx_server = layer.context.server
    if ctx_server not in layer.connections and event.connection_spec_matches(ctx_server):
        return None
    parked = POOL.take(key)
    if parked is None:
        return None
    return _adopted(layer, event, parked)


def _adopted(layer: Any, event: Any, p: Parked) -> Generator[Any, Any, None]:
    """The stack mitmproxy's get_connection builds for a new TLS connection, over `p`."""
    context = layer.context.fork()
    srv = connection.Server(address=event.address, transport_protocol="tcp")
    for name, value in p.fields.items():
        setattr(srv, name, value)
    context.server = srv
    stack = tunnel.LayerStack()
    stack /= _AdoptedTLS(context, p)
    stack /= _AdoptedHttpClient(context, p.h2)
    _ADOPTING[srv.id] = p
    _STACKS[srv.id] = context
    _KEYS[srv.id] = p.key
    layer.connections[srv] = stack[0]
    layer.waiting_for_establishment[srv].append(event)
    yield from layer.event_to_child(stack[0], events.Start())


def _wrap_get_connection(original: Any) -> Any:
    def get_connection(self: Any, event: Any, *, reuse: bool = True
                       ) -> Generator[Any, Any, None]:
        adopted = None
        if reuse:
            try:
                adopted = _adopt(self, event)
            except Exception:  # never fatal: the request dials as it would without a pool
                log.exception("sandgate: taking a parked upstream connection failed; dialling")
        if adopted is None:
            yield from original(self, event, reuse=reuse)
        else:
            yield from adopted

    return get_connection


def _wrap_open_connection(original: Any) -> Any:
    async def open_connection(self: Any, command: commands.OpenConnection) -> None:
        p = _ADOPTING.pop(command.connection.id, None)
        if p is None:
            await original(self, command)
            return
        await _open_adopted(self, command, p)

    return open_connection


def _wrap_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _HANDLERS[self.client.id] = self

    return __init__


class UpstreamPool:
    """The hooks: know each upstream's stack and key; park at the client's end."""

    def tls_established_server(self, data: tls_hooks.TlsData) -> None:
        _STACKS[data.conn.id] = data.context

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        rec = flow.metadata.get(METADATA_KEY)
        key = getattr(rec, "reuse", None)
        if key is not None and flow.server_conn.id in _STACKS:  # an upstream it dialled
            _KEYS[flow.server_conn.id] = key

    def client_disconnected(self, client: connection.Client) -> None:
        try:
            park(client)
        except Exception:
            log.exception("sandgate: parking upstream connections failed; they close")

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        forget(data.server)


def configure(idle: float | None) -> None:
    POOL.idle = idle or 0.0
    if POOL.idle <= 0:
        POOL.clear()


def install(idle: float | None = DEFAULT_IDLE) -> None:
    configure(idle)
    cls = http_layer.HttpLayer
    if getattr(cls, _MARK, False):
        return
    cls.get_connection = _wrap_get_connection(cls.get_connection)  # type: ignore[method-assign]
    handler = server.ConnectionHandler
    handler.__init__ = _wrap_init(handler.__init__)  # type: ignore[method-assign]
    # outermost (installed after wirelimits and dialguard): an adopted connection is no dial
    handler.open_connection = _wrap_open_connection(  # type: ignore[method-assign]
        handler.open_connection)
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(http_layer.HttpLayer, _MARK, False))
