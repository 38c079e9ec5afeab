"""The upstream read timeout's reader (sandgate/mitm/guards/wirelimits.py `_SilenceReader`):
one timer per connection instead of a task per read. Real sockets and asyncio's own protocol;
timeouts of a fraction of a second (the test checks that they fire and that traffic keeps them off,
not how fast anything is)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from mitmproxy import connection

from sandgate.limits import LimitsConfig
from sandgate.mitm.guards import wirelimits

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def limits() -> Iterator[None]:
    wirelimits.install(LimitsConfig(upstream_read_timeout=0.3))
    yield
    wirelimits.install(LimitsConfig())


async def _reader(server: connection.Server | None) -> tuple[wirelimits._SilenceReader,
                                                            socket.socket, asyncio.Transport]:
    outside, inside = socket.socketpair()
    outside.setblocking(False)
    loop = asyncio.get_running_loop()
    reader = wirelimits._SilenceReader(server, 2**16)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, inside)
    reader.arm()
    return reader, outside, transport


def _checks_scheduled(reader: wirelimits._SilenceReader) -> int:
    scheduled: list[asyncio.TimerHandle] = reader.loop._scheduled  # type: ignore[attr-defined]
    return len([h for h in scheduled
                if not h.cancelled()
                and getattr(getattr(h, "_callback", None), "__self__", None) is reader])


async def test_a_silent_upstream_ends_the_pending_read_with_the_timeout() -> None:
    server = connection.Server(address=("127.0.15.9", 443))
    reader, outside, transport = await _reader(server)
    async with asyncio.timeout(5):
        with pytest.raises(TimeoutError, match=wirelimits.TIMEOUT_MARK):
            await reader.read(100)
    assert server.id in wirelimits._timed_out  # the stream answers 504, not 502
    assert _checks_scheduled(reader) == 0  # and the timer stopped
    wirelimits._timed_out.discard(server.id)
    transport.close()
    outside.close()


async def test_traffic_either_way_keeps_the_connection_alive() -> None:
    reader, outside, transport = await _reader(None)
    loop = asyncio.get_running_loop()
    writer = asyncio.StreamWriter(transport, transport.get_protocol(), reader, loop)
    timed = wirelimits._TimedWriter(writer, reader)
    got = b""
    for i in range(8):  # 1.6 s in all, five times the timeout, never 0.3 s silent
        if i % 2:
            await loop.sock_sendall(outside, b"x")
            got += await asyncio.wait_for(reader.read(10), 1)
        else:
            timed.write(b"y")  # bytes sent count as activity too
        await asyncio.sleep(0.2)
    assert got == b"xxxx"
    assert reader.exception() is None
    transport.close()
    outside.close()


async def test_the_timer_stops_at_the_end_of_the_connection() -> None:
    reader, outside, transport = await _reader(None)
    outside.close()  # the upstream closes: EOF
    async with asyncio.timeout(5):
        assert await reader.read(10) == b""
        while _checks_scheduled(reader):
            await asyncio.sleep(0.05)
    assert reader.exception() is None
    transport.close()


async def test_an_exempt_connection_never_times_out() -> None:
    server = connection.Server(address=("127.0.15.9", 443))
    wirelimits.exempt(server)  # a WebSocket or a passthrough tunnel
    reader, outside, transport = await _reader(server)
    await asyncio.sleep(0.8)
    assert reader.exception() is None and _checks_scheduled(reader) == 0
    wirelimits._exempt.discard(server.id)
    transport.close()
    outside.close()


async def test_a_reload_that_turns_the_timeout_on_is_seen() -> None:
    wirelimits.install(LimitsConfig(upstream_read_timeout=None))
    reader, outside, transport = await _reader(None)
    await asyncio.sleep(0.3)
    assert reader.exception() is None  # off: nothing times out, the timer keeps looking
    wirelimits.install(LimitsConfig(upstream_read_timeout=0.2))
    async with asyncio.timeout(5):
        with pytest.raises(TimeoutError, match=wirelimits.TIMEOUT_MARK):
            await reader.read(100)
    transport.close()
    outside.close()
