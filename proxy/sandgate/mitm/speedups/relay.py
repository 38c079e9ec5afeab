"""Verified passthrough tunnels at tunnel speed: once relaying, bytes skip mitmproxy's layers.

A `passthrough: true` rule's tunnel is judged in full by mitmproxy's machinery, as before: the
CONNECT (identity, decision, audit), the ClientHello's SNI against the CONNECT target
(`Gate.tls_clienthello`, which only then sets `ignore_connection` and calls `verified`), the
dial (`Gate.server_connect`: only the checked address, connection limits). After that mitmproxy
relays each chunk through its whole layer stack (HTTP proxy layer, the CONNECT stream, the
ignored TLS layer, the TCP layer: generators, events and commands for every read), which costs
2-3x a plain CONNECT tunnel's CPU. Nothing in that stack looks at the bytes any more: the TCP
layer of an ignored connection has no flow and calls no hook, it only answers "send this to the
other side".

So `handle_connection`, the per-connection read loop of mitmproxy's ConnectionHandler, gets one
shortcut: a chunk read on a connection whose tunnel was verified *and* whose TCP layer is in its
relaying state is written straight to the peer's writer. Everything else takes mitmproxy's own
path unchanged: bytes before the upstream connection is open (the layer buffers them until the
dial that `server_connect` approved), end of stream and half-closes, errors, cancellation
(shutdown, timeouts and `drain` cancel this same task), the inactivity watchdog (registered per
chunk as before). Backpressure stays: a lean chunk waits for the peer's writer to drain whenever
that writer's buffer is over asyncio's high-water mark (mitmproxy drains all of the connection's
writers after every chunk, which costs a lock and two coroutines per chunk).

After that first lean chunk the direction goes one step further down: its transport's protocol
is swapped for a `Pipe` that writes each chunk to the peer's transport from the socket callback
itself (no StreamReader buffer, no wake-up of the reading task, no copies), and the reading task
keeps waiting on its now quiet StreamReader. The pipe hands everything but data back to the
original protocol: end of stream and connection loss (it puts the original back first, so
mitmproxy's read loop sees them as always and closes, half-closes and cancels as before) and
the write-side flow control. Backpressure is the transport's own: when the peer's buffer passes
its high-water mark the pipe's `pause_writing` pauses reading on the other side, until the
buffer drains.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import selector_events
from typing import Any

from mitmproxy import connection
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import events, server
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.tcp import TCPLayer
from mitmproxy.proxy.layers.tls import ClientTLSLayer

from sandgate.mitm.guards import admission
from sandgate.mitm.speedups import writes

_MARK = "_sandgate_relay"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


_SOCKET_TRANSPORT: Any = getattr(selector_events, "_SelectorSocketTransport")  # noqa: B009
_HIGH_WATER = 64 * 1024  # asyncio's default high-water mark for a transport's write buffer
# Upstream reads: up to 256 KiB per read (mitmproxy: 64 KiB), so a bulk download crosses the
# layers, the scrubber and the TLS records a quarter as often; wirelimits' upstream reader
# buffers up to UPSTREAM_READ (2 x its 128 KiB limit) before it pauses the socket.
UPSTREAM_READ = 256 * 1024
# client connection id -> the context of its verified passthrough tunnel (its TLS layer's);
# entries leave with the client (`forget`, from Gate.client_disconnected)
_VERIFIED: dict[str, Context] = {}


def verified(context: Context) -> None:
    """The tunnel of `context.client` passed the SNI check: relay it lean once it relays.

    Not when the client spoke TLS to the proxy port itself (`curl --proxy https://`): its
    socket carries the proxy's own TLS records around the tunnel, which only mitmproxy's layers
    unwrap; copied raw, the upstream would get those records and the client garbage."""
    if below_tls(context):
        return
    _VERIFIED[context.client.id] = context


def below_tls(context: Context) -> bool:
    """Does a TLS layer that Sandgate terminates sit between the socket and this tunnel? (The
    client's own flags cannot tell: the inner handshake writes to the same Client object.)"""
    return any(isinstance(layer, ClientTLSLayer) for layer in context.layers[:-1])


def forget(client: connection.Client) -> None:
    _VERIFIED.pop(client.id, None)


def peer_writer(handler: Any, conn: connection.Connection) -> Any:
    """The writer a chunk read on `conn` goes to, if the lean relay may send it; else None."""
    ctx = _VERIFIED.get(handler.client.id)
    if ctx is None:
        return None
    layer = ctx.layers[-1]
    if (not isinstance(layer, TCPLayer) or layer.flow is not None
            or getattr(layer._handle_event, "__func__", None) is not TCPLayer.relay_messages):
        return None  # not relaying yet (dial pending) or not an ignored tunnel
    if conn is layer.context.client:
        to: connection.Connection = layer.context.server
    elif conn is layer.context.server:
        to = layer.context.client
    else:
        return None
    io = handler.transports.get(to)
    if io is None or io.writer is None or io.writer.is_closing():
        return None  # mitmproxy's own path drops it, as it always did
    return io.writer


class Pipe(asyncio.Protocol):
    """The protocol of one side of a verified tunnel while it relays: each chunk read goes
    straight to the other side's transport. `to` is also the transport this side's writes come
    from, so pausing reading on it is this side's backpressure."""

    __slots__ = ("original", "to", "transport", "watchdog")

    def __init__(self, original: asyncio.StreamReaderProtocol, transport: asyncio.Transport,
                 to: asyncio.Transport, watchdog: Any) -> None:
        self.original = original
        self.transport = transport
        self.to = to
        self.watchdog = watchdog

    def data_received(self, data: bytes) -> None:
        self.watchdog.last_activity = time.time()  # TimeoutWatchdog.register_activity
        if not self.to.is_closing():
            self.to.write(data)
        # else: dropped, as mitmproxy drops writes to a closing connection

    def eof_received(self) -> bool | None:
        self.transport.set_protocol(self.original)  # mitmproxy's own path from here on
        return self.original.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport.set_protocol(self.original)
        self.original.connection_lost(exc)

    def pause_writing(self) -> None:
        self.original.pause_writing()
        self.to.pause_reading()

    def resume_writing(self) -> None:
        self.original.resume_writing()
        self.to.resume_reading()


def _pipe(handler: Any, reader: asyncio.StreamReader, to: asyncio.Transport) -> None:
    """Swap the protocol of `reader`'s transport for a Pipe to `to`, if nothing is pending on it
    (buffered bytes are sent on first; an end of stream or error already seen stays with
    mitmproxy's loop)."""
    transport: Any = getattr(reader, "_transport", None)
    if type(transport) is not _SOCKET_TRANSPORT \
            or transport.is_closing() or getattr(reader, "_eof", True) \
            or reader.exception() is not None:
        return  # not the plain socket transport this was written for, or ending: leave it
    original = transport.get_protocol()
    if type(original) is not asyncio.StreamReaderProtocol:
        return
    buffered = reader._buffer  # type: ignore[attr-defined]
    if buffered:
        to.write(bytes(buffered))
        buffered.clear()
    if reader._paused:  # type: ignore[attr-defined]
        reader._paused = False  # type: ignore[attr-defined]
        transport.resume_reading()
    transport.set_protocol(Pipe(original, transport, to, handler.timeout_watchdog))


async def handle_connection(self: Any, conn: connection.Connection) -> None:
    """mitmproxy 12.3.1's ConnectionHandler.handle_connection with the lean relay step."""
    cancelled = None
    reader = self.transports[conn].reader
    assert reader
    while True:
        try:
            data = await reader.read(65535 if conn is self.client else UPSTREAM_READ)
            if not data:
                raise OSError("Connection closed by peer.")
        except OSError:
            break
        except asyncio.CancelledError as e:
            cancelled = e
            break

        if conn is self.client and not getattr(self, admission.SPOKE, False):
            setattr(self, admission.SPOKE, True)  # the client's first byte (admission.py)
        writer = peer_writer(self, conn)
        if writer is not None:
            self.timeout_watchdog.register_activity()
            if type(writer) is writes.Batched:
                writer.flush()  # nothing is pending outside an event; kept in order regardless
                writer = writer.raw
            writer.write(data)
            # Backpressure for this direction: wait while the peer's buffer is over its limit
            # (mitmproxy drains every writer of the connection after every chunk).
            if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                try:
                    await self.drain_writers()  # mitmproxy's, with its error handling
                except asyncio.CancelledError as e:
                    cancelled = e
                    break
            if peer_writer(self, conn) is not None:  # still relaying after the wait
                _pipe(self, reader, writer.transport)
            continue

        await self.server_event(events.DataReceived(conn, data))

        try:
            await self.drain_writers()
        except asyncio.CancelledError as e:
            cancelled = e
            break

    if cancelled is None and conn.transport_protocol == "tcp":
        # TCP connections can be half-closed.
        conn.state &= ~ConnectionState.CAN_READ
    else:
        conn.state = ConnectionState.CLOSED

    await self.server_event(events.ConnectionClosed(conn))

    if conn.state is ConnectionState.CAN_WRITE:
        # we may still use this connection to *send* stuff,
        # even though the remote has closed their side of the connection.
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as e:
            cancelled = e

    try:
        w = self.transports[conn].writer
        assert w
        w.close()
    except OSError:
        pass
    self.transports.pop(conn)

    if cancelled:
        raise cancelled


ORIGINAL = server.ConnectionHandler.handle_connection  # what `handle_connection` copies


def install() -> None:
    cls = server.ConnectionHandler
    if getattr(cls, _MARK, False):
        return
    cls.handle_connection = handle_connection  # type: ignore[method-assign, assignment]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(server.ConnectionHandler, _MARK, False))
