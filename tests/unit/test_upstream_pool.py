"""The upstream pool's bookkeeping: keys, bounds, readiness, expiry; and the reuse key the dial
stage gives a request (only tunnelled HTTPS of an identified caller gets one)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
from mitmproxy import connection
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.test import tflow

from sandgate.identity.base import Caller
from sandgate.mitm.guards import tunnels
from sandgate.mitm.speedups import upstreampool
from sandgate.mitm.speedups.parking import PER_KEY, TOTAL, Parked, Pool, key_for
from sandgate.stages.flow import Captured, Conn, FlowRecord, Tunnel
from sandgate.stages.s60_dial import reuse_key

pytestmark = pytest.mark.unit

AGENT = Caller("coding-agent", "sbx-1", "token")
OTHER_SANDBOX = Caller("coding-agent", "sbx-2", "token")
OTHER_IDENTITY = Caller("web-fetch", "sbx-1", "token")
LISTENER = ("127.0.0.1", 8080)


class FakeReader:
    def __init__(self) -> None:
        self._buffer = bytearray()
        self.eof = False
        self.exc: BaseException | None = None

    def exception(self) -> BaseException | None:
        return self.exc

    def at_eof(self) -> bool:
        return self.eof


class FakeWriter:
    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default


@pytest.fixture
def sockets() -> Any:
    made: list[socket.socket] = []

    def pair() -> tuple[socket.socket, socket.socket]:
        a, b = socket.socketpair()
        a.setblocking(False)
        made.extend((a, b))
        return a, b

    yield pair
    for s in made:
        s.close()


def parked(key: Any, sockets: Any, since: float | None = None) -> tuple[Parked, socket.socket]:
    ours, theirs = sockets()
    p = Parked(key, FakeReader(), FakeWriter(ours), object(), {},
               time.monotonic() if since is None else since, ready=True)
    return p, theirs


def test_keys_keep_identities_sandboxes_listeners_and_names_apart() -> None:
    base = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    assert base == key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    for other in (key_for(OTHER_SANDBOX, LISTENER, "192.0.2.1", 443, "api.test"),
                  key_for(OTHER_IDENTITY, LISTENER, "192.0.2.1", 443, "api.test"),
                  key_for(Caller("coding-agent", "sbx-1", "cidr"), LISTENER, "192.0.2.1", 443,
                          "api.test"),
                  key_for(AGENT, ("127.0.0.1", 8081), "192.0.2.1", 443, "api.test"),
                  key_for(AGENT, LISTENER, "192.0.2.2", 443, "api.test"),
                  key_for(AGENT, LISTENER, "192.0.2.1", 8443, "api.test"),
                  key_for(AGENT, LISTENER, "192.0.2.1", 443, "other.test")):
        assert other != base


def test_take_gives_only_the_same_keys_connection(sockets: Any) -> None:
    pool = Pool(idle=5)
    mine = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    p, _peer = parked(mine, sockets)
    pool.put(p)
    assert pool.take(key_for(OTHER_SANDBOX, LISTENER, "192.0.2.1", 443, "api.test")) is None
    assert pool.take(key_for(OTHER_IDENTITY, LISTENER, "192.0.2.1", 443, "api.test")) is None
    assert pool.take(mine) is p
    assert pool.take(mine) is None  # taken once
    assert pool.size == 0 and pool.reused == 1


def test_not_ready_until_the_old_handler_stopped_reading(sockets: Any) -> None:
    pool = Pool(idle=5)
    key = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    p, _peer = parked(key, sockets)
    p.ready = False
    pool.put(p)
    assert pool.take(key) is None and pool.size == 1
    p.ready = True
    assert pool.take(key) is p


@pytest.mark.parametrize("spoil", ["idle too long", "eof", "error", "buffered", "closing",
                                   "bytes on the socket", "peer closed"])
def test_a_connection_that_is_no_longer_idle_is_closed_not_taken(sockets: Any,
                                                                 spoil: str) -> None:
    pool = Pool(idle=5)
    key = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    p, peer = parked(key, sockets, since=time.monotonic() - 10 if spoil == "idle too long"
                     else None)
    if spoil == "eof":
        p.reader.eof = True
    elif spoil == "error":
        p.reader.exc = TimeoutError("upstream read timeout")
    elif spoil == "buffered":
        p.reader._buffer += b"HTTP/1.1 200 OK\r\n"
    elif spoil == "closing":
        p.writer.closed = True
    elif spoil == "bytes on the socket":
        peer.sendall(b"HTTP/1.1 200 OK\r\n")
    elif spoil == "peer closed":
        peer.close()
    pool.put(p)
    assert pool.take(key) is None
    assert p.writer.closed and pool.size == 0 and pool.expired == 1 and pool.reused == 0


def test_bounded_per_key_and_in_all(sockets: Any) -> None:
    pool = Pool(idle=5)
    key = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    first = [parked(key, sockets)[0] for _ in range(PER_KEY + 2)]
    for p in first:
        pool.put(p)
    assert pool.size == PER_KEY
    assert first[0].writer.closed and first[1].writer.closed  # the oldest go
    assert pool.take(key) is first[-1]  # the freshest is taken first
    pool.clear()
    assert pool.size == 0 and all(p.writer.closed for p in first[:-1])  # not the taken one
    many = []
    for i in range(TOTAL + 3):
        p = parked(key_for(AGENT, LISTENER, f"192.0.2.{i % 250}", 1000 + i, "api.test"),
                   sockets)[0]
        many.append(p)
        pool.put(p)
    assert pool.size == TOTAL
    assert sum(p.writer.closed for p in many) == 3
    pool.clear()


async def test_the_sweep_closes_what_expired_without_a_take(sockets: Any) -> None:
    pool = Pool(idle=0.05)
    key = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    p, _peer = parked(key, sockets)
    pool.put(p)
    for _ in range(100):
        await asyncio.sleep(0.02)
        if pool.size == 0:
            break
    assert pool.size == 0 and p.writer.closed and pool.expired == 1


# ------------------------------------------------------------------ the dial stage's key


def _flow(scheme: str = "https") -> Any:
    f = tflow.tflow()
    f.request.scheme = scheme
    f.client_conn.sockname = LISTENER
    f.server_conn = connection.Server(address=("api.test", 443))
    return f


def _tunnel(conn: Conn, f: Any, **kw: Any) -> None:
    tunnels.put(conn, f.client_conn, f.server_conn,
                Tunnel(caller=AGENT, host="api.test", port=443, rule=None,
                       passthrough=kw.pop("passthrough", False), **kw))


def test_reuse_key_for_a_tunnelled_https_request_of_an_identified_caller() -> None:
    conn, f = Conn(), _flow()
    _tunnel(conn, f)
    rec = FlowRecord(caller=AGENT)
    assert reuse_key(conn, f, rec, "192.0.2.1", 443, "api.test") == key_for(
        AGENT, LISTENER, "192.0.2.1", 443, "api.test")


def test_no_reuse_key_outside_an_intercepted_tunnel() -> None:
    rec = FlowRecord(caller=AGENT)
    conn, f = Conn(), _flow()
    assert reuse_key(conn, f, rec, "192.0.2.1", 443, "api.test") is None  # no CONNECT
    _tunnel(conn, f, passthrough=True)
    assert reuse_key(conn, f, rec, "192.0.2.1", 443, "api.test") is None
    conn, f = Conn(), _flow()
    _tunnel(conn, f)
    assert reuse_key(conn, f, FlowRecord(), "192.0.2.1", 443, "api.test") is None  # nobody
    conn.captured = Captured(original=("192.0.2.1", 443))
    assert reuse_key(conn, f, rec, "192.0.2.1", 443, "api.test") is None
    conn, f = Conn(), _flow("http")
    _tunnel(conn, f)
    assert reuse_key(conn, f, rec, "192.0.2.1", 80, "api.test") is None


def test_the_patches_are_in_place_once_and_only_once() -> None:
    from mitmproxy.proxy import server

    upstreampool.install(2.0)
    assert upstreampool.installed()
    get, open_ = http_layer.HttpLayer.get_connection, server.ConnectionHandler.open_connection
    assert "_wrap_get_connection" in get.__qualname__
    assert "_wrap_open_connection" in open_.__qualname__
    upstreampool.install(2.0)  # idempotent: nothing wrapped twice
    assert http_layer.HttpLayer.get_connection is get
    assert server.ConnectionHandler.open_connection is open_


def test_a_dead_connection_met_first_is_closed_and_the_next_idle_one_taken(
        sockets: Any) -> None:
    pool = Pool(idle=5)
    key = key_for(AGENT, LISTENER, "192.0.2.1", 443, "api.test")
    older, _a = parked(key, sockets)
    newer, peer = parked(key, sockets)
    pool.put(older)
    pool.put(newer)
    peer.close()  # the freshest one's upstream left while it was parked
    assert pool.take(key) is older
    assert newer.writer.closed and not older.writer.closed
    assert (pool.size, pool.expired, pool.reused) == (0, 1, 1)
