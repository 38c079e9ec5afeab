"""The two speed changes to mitmproxy's machinery: cached hook dispatch and the lean relay of
verified passthrough tunnels. Both must behave exactly like what they replace."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from mitmproxy import connection, exceptions, hooks, master, options
from mitmproxy.addonmanager import AddonManager
from mitmproxy.proxy import server
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.proxy.layers.tcp import TCPLayer

from sandgate.mitm.speedups import dispatch, relay

# ---------------------------------------------------------------------------- dispatch


class Recorder:
    def __init__(self, name: str, calls: list[str], fail: bool = False, halt: bool = False,
                 children: list[Any] | None = None) -> None:
        self.name, self.calls, self.fail, self.halt = name, calls, fail, halt
        if children is not None:
            self.addons = children

    async def request(self, flow: Any) -> None:
        self.calls.append(f"{self.name}:{flow}")
        if self.fail:
            raise RuntimeError("addon failed")
        if self.halt:
            raise exceptions.AddonHalt()

    def response(self, flow: Any) -> None:
        self.calls.append(f"{self.name}:response:{flow}")


class Plain:
    """An addon without the hooks under test (and a module attribute named like a hook)."""

    name = "plain"
    error = logging


def _run(manager_cls: type[AddonManager] | None, setup: Any) -> list[str]:
    async def go() -> list[str]:
        m = master.Master(options.Options())
        if manager_cls is not None:
            dispatch.install(m)
        calls: list[str] = []
        await setup(m, calls)
        return calls

    return asyncio.run(go())


@pytest.mark.parametrize("cached", [False, True])
def test_cached_dispatch_calls_what_mitmproxy_calls(cached: bool) -> None:
    async def setup(m: master.Master, calls: list[str]) -> None:
        m.addons.add(Plain(), Recorder("a", calls),
                     Recorder("parent", calls, children=[Recorder("child", calls, fail=True),
                                                         Recorder("after-fail", calls)]),
                     Recorder("c", calls, fail=True), Recorder("d", calls))
        await m.addons.trigger_event(hooks.UpdateHook([]))  # no handlers: nothing happens
        await m.addons.trigger_event(HttpRequestHook("f1"))
        await m.addons.trigger_event(HttpResponseHook("f1"))
        m.addons.add(Recorder("late", calls))  # the chain changed: the cache must follow
        await m.addons.trigger_event(HttpRequestHook("f2"))
        m.addons.remove(m.addons.get("late"))
        m.addons.add(Recorder("halt", calls, halt=True), Recorder("never", calls))
        await m.addons.trigger_event(HttpRequestHook("f3"))

    calls = _run(dispatch.CachedAddons if cached else None, setup)
    # an exception in one addon's hook skips the rest of *that* addon, the next addon still runs
    expected = ["a:f1", "parent:f1", "child:f1", "c:f1", "d:f1",
                "a:response:f1", "parent:response:f1", "child:response:f1",
                "after-fail:response:f1", "c:response:f1", "d:response:f1",
                "a:f2", "parent:f2", "child:f2", "c:f2", "d:f2", "late:f2",
                "a:f3", "parent:f3", "child:f3", "c:f3", "d:f3", "halt:f3"]
    assert calls == expected


def test_cached_manager_must_be_installed_before_addons() -> None:
    async def go() -> None:
        m = master.Master(options.Options())
        m.addons.add(Plain())
        with pytest.raises(RuntimeError):
            dispatch.install(m)

    asyncio.run(go())


def test_cached_manager_follows_option_changes_once() -> None:
    async def go() -> int:
        m = master.Master(options.Options())
        dispatch.install(m)
        seen: list[set[str]] = []

        class Conf:
            def configure(self, updated: set[str]) -> None:
                seen.append(updated)

        m.addons.add(Conf())
        seen.clear()
        m.options.update(listen_port=1234)
        return len(seen)

    assert asyncio.run(go()) == 1  # the replaced manager no longer listens


# ---------------------------------------------------------------------------- relay


def test_relay_installs_its_handle_connection() -> None:
    # (the copied source is pinned by test_mitm_registry.py::test_source_is_pinned[relay])
    relay.install()
    relay.install()
    assert relay.installed()
    assert server.ConnectionHandler.handle_connection is relay.handle_connection


class _Writer:
    def __init__(self, closing: bool = False) -> None:
        self.closing = closing

    def is_closing(self) -> bool:
        return self.closing


class _IO:
    def __init__(self, writer: _Writer | None) -> None:
        self.writer = writer


class _Handler:
    def __init__(self, client: connection.Client) -> None:
        self.client = client
        self.transports: dict[Any, _IO] = {}


def _tunnel(ignore: bool = True) -> tuple[_Handler, Context, TCPLayer]:
    client = connection.Client(peername=("10.0.0.1", 1), sockname=("10.0.0.2", 8080),
                               timestamp_start=0)
    ctx = Context(client, options.Options())
    ctx.server = connection.Server(address=("192.0.2.1", 443))
    layer = TCPLayer(ctx, ignore=ignore)
    handler = _Handler(client)
    handler.transports[client] = _IO(_Writer())
    handler.transports[ctx.server] = _IO(_Writer())
    return handler, ctx, layer


def test_lean_relay_only_for_verified_tunnels_that_relay() -> None:
    handler, ctx, layer = _tunnel()
    client, srv = ctx.client, ctx.server
    # not verified (no SNI check passed): mitmproxy's path
    layer._handle_event = layer.relay_messages
    assert relay.peer_writer(handler, client) is None
    relay.verified(ctx)
    try:
        assert relay.peer_writer(handler, client) is handler.transports[srv].writer
        assert relay.peer_writer(handler, srv) is handler.transports[client].writer
        # a connection that is not this tunnel's
        other = connection.Server(address=("192.0.2.9", 443))
        assert relay.peer_writer(handler, other) is None
        # peer closing or gone: mitmproxy's path (which drops the data, as it always did)
        handler.transports[srv].writer.closing = True  # type: ignore[union-attr]
        assert relay.peer_writer(handler, client) is None
        del handler.transports[srv]
        assert relay.peer_writer(handler, client) is None
    finally:
        relay.forget(client)
    assert relay.peer_writer(handler, srv) is None


def test_lean_relay_waits_for_the_approved_dial() -> None:
    handler, ctx, layer = _tunnel()
    relay.verified(ctx)
    try:
        assert layer._handle_event == layer.start  # dial not done: bytes stay in the layer
        assert relay.peer_writer(handler, ctx.client) is None
        layer._handle_event = layer.relay_messages
        assert relay.peer_writer(handler, ctx.client) is not None
    finally:
        relay.forget(ctx.client)


def test_lean_relay_never_for_a_tcp_flow_that_hooks_see() -> None:
    handler, ctx, layer = _tunnel(ignore=False)  # raw TCP with a flow: tcp_message must run
    layer._handle_event = layer.relay_messages
    relay.verified(ctx)
    try:
        assert relay.peer_writer(handler, ctx.client) is None
    finally:
        relay.forget(ctx.client)


# ---------------------------------------------------------------------------- inert addons


def test_inert_addons_are_exactly_those_pinned_off() -> None:
    from mitmproxy.addons import default_addons

    from sandgate.addons.pinned import _PINNED, pinned
    from sandgate.mitm.speedups import speed

    for name, (option, value) in speed.INERT.items():
        assert option in _PINNED, name  # skipping is only sound while the option is pinned
        assert _PINNED[option][0] == value, name

    async def go() -> tuple[set[str], set[str]]:
        m = master.Master(options.Options())
        addons = dispatch.install(m)
        m.addons.add(*default_addons())
        values = pinned("32m", None)
        m.options.update(**values)
        inert = speed.inert_addons(m, values)
        names = {a.__class__.__name__.lower() for a in inert}
        m.options.update(anticache=True)  # not pinned in this bare master: no longer inert
        still = {a.__class__.__name__.lower()
                 for a in speed.inert_addons(m, {**values, "anticache": True})}
        addons.set_inert(inert)
        return names, still

    names, still = asyncio.run(go())
    assert names == set(speed.INERT)
    assert still == set(speed.INERT) - {"anticache"}


def test_inert_addons_get_lifecycle_hooks_only() -> None:
    calls: list[str] = []

    class Inert:
        name = "inert"

        def request(self, flow: Any) -> None:
            calls.append("request")

        def running(self) -> None:
            calls.append("running")

    async def go() -> None:
        m = master.Master(options.Options())
        addons = dispatch.install(m)
        inert = Inert()
        m.addons.add(inert, Recorder("live", calls))
        addons.set_inert({inert})
        await m.addons.trigger_event(HttpRequestHook("f"))
        await m.addons.trigger_event(hooks.RunningHook())

    asyncio.run(go())
    assert calls == ["live:f", "running"]


def test_speed_install_drops_only_debug_type_checks() -> None:
    from mitmproxy import http

    from sandgate.mitm.speedups import speed

    speed.install()
    speed.install()
    assert speed.installed()
    # what mitmproxy would only check without -O is not checked; the objects are the same
    r = http.Request.make("GET", "https://example.com/x")
    assert r.host == "example.com" and r.path == "/x"


# ---------------------------------------------------------------------------- batched writes


class _RawWriter:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def write(self, data: bytes) -> None:
        self.log.append(("write", bytes(data)))

    def is_closing(self) -> bool:
        self.log.append("is_closing")
        return False

    def write_eof(self) -> None:
        self.log.append("write_eof")

    def close(self) -> None:
        self.log.append("close")


def test_batched_writer_keeps_bytes_and_order_and_sends_once() -> None:
    from sandgate.mitm.speedups import writes

    log: list[Any] = []
    w = writes.Batched(_RawWriter(log))  # type: ignore[arg-type]
    assert not w.is_closing()  # answered without sending what is pending
    w.write(b"head ")
    w.write(b"body")
    assert not w.is_closing()
    assert log == ["is_closing", "is_closing"]
    w.write_eof()  # anything else first sends what was written, in order
    w.write(b"x")
    w.flush()
    w.flush()
    w.close()
    assert log == ["is_closing", "is_closing", ("write", b"head body"), "write_eof",
                   ("write", b"x"), "close"]


def test_batched_writers_flush_when_the_event_is_done() -> None:
    from mitmproxy.proxy.server import ConnectionIO

    from sandgate.mitm.speedups import writes

    writes.install()
    writes.install()
    assert writes.installed()

    async def go() -> tuple[bool, list[Any]]:
        log: list[Any] = []
        reader = asyncio.StreamReader()
        transport = _FakeTransport(log)
        raw = asyncio.StreamWriter(transport, asyncio.Protocol(), reader,  # type: ignore[arg-type]
                                   asyncio.get_running_loop())
        transports = writes._Transports()
        transports["c"] = ConnectionIO(reader=reader, writer=raw)
        w = transports["c"].writer
        w.write(b"a")
        w.write(b"b")
        before = list(log)

        class H:
            pass

        h = H()
        h.transports = transports  # type: ignore[attr-defined]
        writes.flush(h)
        return isinstance(w, writes.Batched) and before == [], list(log)

    wrapped, log = asyncio.run(go())
    assert wrapped and log == [b"ab"]


class _FakeTransport(asyncio.Transport):
    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.log = log

    def write(self, data: Any) -> None:
        self.log.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        self.log.append("close")


def test_speed_fork_and_hook_args_are_mitmproxys() -> None:
    from mitmproxy.proxy.context import Context
    from mitmproxy.proxy.layers.http import HttpRequestHeadersHook

    from sandgate.mitm.speedups import speed

    speed.install()
    client = connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2),
                               timestamp_start=0.0)
    parent = Context(client, options.Options())
    parent.server.address = ("example.com", 443)
    parent.layers = ["a", "b"]  # type: ignore[list-item]
    child = parent.fork()
    assert type(child) is Context and child is not parent
    assert child.client is client and child.options is parent.options
    assert child.server is parent.server  # the same server, no new one
    assert child.layers == parent.layers and child.layers is not parent.layers
    assert HttpRequestHeadersHook("f").args() == ["f"]  # type: ignore[arg-type]
    assert hooks.UpdateHook(["x"]).args() == [["x"]]  # type: ignore[list-item]
    assert hooks.RunningHook().args() == []


def test_no_update_hook_built_without_an_update_addon() -> None:
    calls: list[str] = []

    class Updating:
        def update(self, flows: list[Any]) -> None:
            calls.append(f"update:{len(flows)}")

    async def go() -> None:
        m = master.Master(options.Options())
        dispatch.install(m)
        m.addons.add(Recorder("r", calls))
        from mitmproxy.test import tflow

        f = tflow.tflow()
        await m.addons.handle_lifecycle(HttpRequestHook(f))
        calls.append("--")
        m.addons.add(Updating())  # the cache follows: update hooks run again
        await m.addons.handle_lifecycle(HttpRequestHook(f))

    asyncio.run(go())
    assert [c.split(":")[0] for c in calls] == ["r", "--", "r", "update"]


def test_speed_option_reads_copy_only_what_can_change() -> None:
    from sandgate.mitm.speedups import speed

    speed.install()
    o = options.Options()
    o.update(listen_host="127.0.0.9", ignore_hosts=["example.com"])
    assert o.listen_host == "127.0.0.9" and o.listen_port is None and o.showhost is False
    first = o.ignore_hosts
    first.append("mutated")  # a list is still a copy: the option itself is untouched
    assert o.ignore_hosts == ["example.com"]
