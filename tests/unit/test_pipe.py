"""The tunnel pipe (sandgate/mitm/speedups/relay.py `Pipe`): once a verified tunnel relays,
each side's transport writes straight to the other's. Real sockets (socket pairs) and asyncio's own
transports and StreamReaders, so what is checked is what the proxy runs: order, backpressure,
and that end of stream and connection loss reach mitmproxy's read loop unchanged."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from sandgate.mitm.speedups import relay

pytestmark = pytest.mark.unit


@dataclass
class Side:
    outside: socket.socket  # the peer out there (client or upstream)
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def transport(self) -> Any:
        return self.writer.transport


async def _side() -> Side:
    outside, inside = socket.socketpair()
    outside.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=inside)
    return Side(outside, reader, writer)


async def _recv_exactly(sock: socket.socket, n: int, timeout: float = 10) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    async with asyncio.timeout(timeout):
        while len(out) < n:
            chunk = await loop.sock_recv(sock, n - len(out))
            assert chunk, f"closed after {len(out)} of {n} bytes"
            out += chunk
    return bytes(out)


async def _until(cond: Any, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


@pytest.fixture
async def sides() -> AsyncIterator[tuple[Side, Side, Any]]:
    a, b = await _side(), await _side()
    handler = SimpleNamespace(timeout_watchdog=SimpleNamespace(last_activity=0.0))
    yield a, b, handler
    for s in (a, b):
        s.writer.close()
        s.outside.close()


async def test_buffered_bytes_go_first_then_every_chunk_in_order_without_waking_the_reader(
        sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(a.outside, b"already buffered|")
    await _until(lambda: len(a.reader._buffer) > 0)  # type: ignore[attr-defined]
    relay._pipe(handler, a.reader, b.transport)
    assert type(a.transport.get_protocol()) is relay.Pipe
    pending = asyncio.ensure_future(a.reader.read(65535))  # mitmproxy's loop keeps waiting
    payload = bytes(range(256)) * 4096  # 1 MiB in many chunks
    await loop.sock_sendall(a.outside, payload)
    got = await _recv_exactly(b.outside, len(b"already buffered|") + len(payload))
    assert got == b"already buffered|" + payload
    assert handler.timeout_watchdog.last_activity > 0  # the idle watchdog sees the traffic
    assert not pending.done()  # no wake-up of the reading task per chunk
    pending.cancel()


async def test_end_of_stream_is_handed_back_to_mitmproxy_read_loop(
        sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    loop = asyncio.get_running_loop()
    relay._pipe(handler, a.reader, b.transport)
    pending = asyncio.ensure_future(a.reader.read(65535))
    await loop.sock_sendall(a.outside, b"last words")
    assert await _recv_exactly(b.outside, 10) == b"last words"
    a.outside.shutdown(socket.SHUT_WR)  # half-close
    async with asyncio.timeout(5):
        assert await pending == b""  # the loop sees the end as it always did
    assert type(a.transport.get_protocol()) is asyncio.StreamReaderProtocol
    assert not a.transport.is_closing()  # half-closed only: the other way still works
    a.writer.write(b"reply")
    assert await _recv_exactly(a.outside, 5) == b"reply"


async def test_connection_loss_is_handed_back(sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    relay._pipe(handler, a.reader, b.transport)
    pending = asyncio.ensure_future(a.reader.read(65535))
    a.writer.close()  # mitmproxy closing the connection (cancel, timeout, shutdown)
    async with asyncio.timeout(5):
        assert await pending == b""
        await a.writer.wait_closed()  # the original protocol saw the loss (its waiters end)


async def test_a_slow_reader_on_the_far_side_pauses_the_near_side_then_all_arrives(
        sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    loop = asyncio.get_running_loop()
    relay._pipe(handler, a.reader, b.transport)
    relay._pipe(handler, b.reader, a.transport)  # both directions piped, as in a tunnel
    payload = bytes(range(251)) * 40_000  # ~10 MiB, far more than the socket buffers
    sender = asyncio.ensure_future(loop.sock_sendall(a.outside, payload))
    # nobody reads b.outside: the pipe must stop reading a rather than buffer everything
    await _until(lambda: not a.transport.is_reading())
    assert b.transport.get_write_buffer_size() < 4 * 65536  # bounded, not the whole payload
    assert not sender.done()
    got = await _recv_exactly(b.outside, len(payload), timeout=30)  # now drain it
    assert got == payload
    await sender
    assert a.transport.is_reading()


async def test_writes_to_a_closing_peer_are_dropped_quietly(
        sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    loop = asyncio.get_running_loop()
    relay._pipe(handler, a.reader, b.transport)
    b.writer.close()
    await loop.sock_sendall(a.outside, b"nobody to take this")
    await asyncio.sleep(0.05)
    assert type(a.transport.get_protocol()) is relay.Pipe  # still piping, nothing raised


async def test_no_pipe_once_the_end_or_an_error_was_seen(sides: tuple[Side, Side, Any]) -> None:
    a, b, handler = sides
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(a.outside, b"tail")
    a.outside.shutdown(socket.SHUT_WR)
    await _until(lambda: a.reader._eof)  # type: ignore[attr-defined]
    relay._pipe(handler, a.reader, b.transport)  # the end is mitmproxy's to see, with the tail
    assert type(a.transport.get_protocol()) is asyncio.StreamReaderProtocol
    assert await a.reader.read(100) == b"tail"
    b.reader.set_exception(ConnectionResetError())
    relay._pipe(handler, b.reader, a.transport)
    assert type(b.transport.get_protocol()) is asyncio.StreamReaderProtocol


async def test_no_pipe_for_other_transports() -> None:
    reader = asyncio.StreamReader()
    reader.set_transport(SimpleNamespace())  # type: ignore[arg-type]  # e.g. uvloop's, TLS
    relay._pipe(SimpleNamespace(), reader, SimpleNamespace())  # type: ignore[arg-type]
    reader2 = asyncio.StreamReader()  # no transport at all
    relay._pipe(SimpleNamespace(), reader2, SimpleNamespace())  # type: ignore[arg-type]
