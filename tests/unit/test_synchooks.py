"""Hooks nothing awaits in run inline (mitm/speedups/synchooks.py): the same handlers, in the same
order, with the same error handling as mitmproxy's hook task; anything that awaits keeps it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from mitmproxy import connection, exceptions, master, options
from mitmproxy.proxy import commands, events, layer, mode_servers, server, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.test import tflow

from sandgate.mitm.speedups import dispatch, synchooks, writes


def test_install_in_either_order_with_writes_keeps_the_flush() -> None:
    writes.install()
    synchooks.install()
    synchooks.install()
    assert synchooks.installed() and writes.installed()
    # writes' wrapper (flush after each event) stays outermost and calls the inline version
    assert server.ConnectionHandler.server_event is writes._server_event
    assert writes.ORIGINAL_SERVER_EVENT is synchooks.server_event


class Plain:
    def __init__(self, name: str, calls: list[str], fail: bool = False, halt: bool = False,
                 children: list[Any] | None = None) -> None:
        self.name, self.calls, self.fail, self.halt = name, calls, fail, halt
        if children is not None:
            self.addons = children

    def server_connected(self, data: Any) -> None:
        self.calls.append(f"{self.name}:{data}")
        if self.fail:
            raise RuntimeError("addon failed")
        if self.halt:
            raise exceptions.AddonHalt()


class Awaits:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def server_connected(self, data: Any) -> None:
        self.calls.append(f"plain:{data}")

    async def server_connect(self, data: Any) -> None:
        self.calls.append(f"async:{data}")


def _manager() -> dispatch.CachedAddons:
    m = master.Master(options.Options())
    return dispatch.install(m)


def test_call_now_calls_what_trigger_event_calls() -> None:
    def chain(calls: list[str]) -> list[Any]:
        return [Plain("a", calls),
                Plain("parent", calls, children=[Plain("child", calls, fail=True),
                                                 Plain("after-fail", calls)]),
                Plain("c", calls, fail=True), Plain("halt", calls, halt=True),
                Plain("never", calls)]

    async def go() -> tuple[list[str], list[str]]:
        inline: list[str] = []
        m = _manager()
        m.add(*chain(inline))
        assert m.call_now(server_hooks.ServerConnectedHook("x"))  # type: ignore[arg-type]
        tasked: list[str] = []
        m2 = _manager()
        m2.add(*chain(tasked))
        await m2.handle_lifecycle(server_hooks.ServerConnectedHook("x"))  # type: ignore[arg-type]
        return inline, tasked

    inline, tasked = asyncio.run(go())
    assert inline == tasked == ["a:x", "parent:x", "child:x", "c:x", "halt:x"]


def test_call_now_leaves_hooks_that_await_to_the_task() -> None:
    async def go() -> list[str]:
        calls: list[str] = []
        m = _manager()
        m.add(Awaits(calls))
        assert not m.call_now(server_hooks.ServerConnectHook("x"))  # type: ignore[arg-type]
        assert m.call_now(server_hooks.ServerConnectedHook("y"))  # type: ignore[arg-type]
        return calls

    assert asyncio.run(go()) == ["plain:y"]  # the async handler was not called (nor awaited)


def test_a_flow_hook_runs_inline_with_its_update_and_never_when_intercepted() -> None:
    class FlowAddon:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def http_connected(self, flow: Any) -> None:
            self.calls.append("http_connected")

        def update(self, flows: Any) -> None:
            self.calls.append(f"update:{len(flows)}")

    from mitmproxy.proxy.layers.http import HttpConnectedHook

    async def go() -> tuple[list[str], bool, bool]:
        m = _manager()
        a = FlowAddon()
        m.add(a)
        f = tflow.tflow()
        ran = m.master is not None and synchooks.call_now(_Handler(m.master, None),
                                                          HttpConnectedHook(f))
        f.intercept()
        held = synchooks.call_now(_Handler(m.master, None), HttpConnectedHook(f))
        return a.calls, ran, held

    calls, ran, held = asyncio.run(go())
    assert ran and not held
    assert calls == ["http_connected", "update:1"]  # handle_lifecycle's pair, once


def test_a_plain_handler_returning_a_coroutine_is_an_error_and_leaves_the_fast_path(
        caplog: pytest.LogCaptureFixture) -> None:
    class Sneaky:
        def server_connected(self, data: Any) -> Any:
            return asyncio.sleep(0)

    async def go() -> tuple[bool, bool]:
        m = _manager()
        m.add(Sneaky())
        first = m.call_now(server_hooks.ServerConnectedHook("x"))  # type: ignore[arg-type]
        second = m.call_now(server_hooks.ServerConnectedHook("x"))  # type: ignore[arg-type]
        return first, second

    with caplog.at_level(logging.ERROR):
        first, second = asyncio.run(go())
    assert first and not second
    assert "returned an awaitable" in caplog.text


# ------------------------------------------------------------------ server_event, inline


class _Watchdog:
    def register_activity(self) -> None:
        pass

    @contextlib.contextmanager
    def disarm(self) -> Iterator[None]:
        yield


class _Handler:
    """What server_event, hook_task and ProxyConnectionHandler.handle_hook use."""

    server_event = synchooks.server_event
    hook_task = server.ConnectionHandler.hook_task
    handle_hook = mode_servers.ProxyConnectionHandler.handle_hook

    def __init__(self, m: Any, root: layer.Layer | None) -> None:
        self.master = m
        self.layer = root
        self._server_event_lock = asyncio.Lock()
        self.timeout_watchdog = _Watchdog()
        self.transports: dict[Any, Any] = {}
        self.wakeup_timer: set[asyncio.Task[None]] = set()
        self.client = connection.Client(peername=("10.0.0.1", 1),
                                        sockname=("10.0.0.2", 8080), timestamp_start=0)

    def log(self, message: str, level: int = logging.INFO, exc_info: Any = None) -> None:
        logging.getLogger("test").log(level, message, exc_info=exc_info)


class _Steps(layer.Layer):
    """Starts a hook nothing awaits in, then one that awaits, then logs."""

    def __init__(self, context: Context, seen: list[str]) -> None:
        super().__init__(context)
        self.seen = seen

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            data = server_hooks.ServerConnectionHookData(self.context.server, self.context.client)
            self.seen.append("start")
            yield server_hooks.ServerConnectedHook(data)
            self.seen.append("after plain hook")
            yield server_hooks.ServerConnectHook(data)
            self.seen.append("after async hook")
            yield commands.Log("done")


@pytest.mark.parametrize("inline", [True, False])
def test_server_event_completes_plain_hooks_at_once_and_tasks_the_rest(inline: bool) -> None:
    async def go() -> tuple[list[str], list[str], list[str]]:
        m = _manager()
        calls: list[str] = []
        m.add(Awaits(calls))
        client = connection.Client(peername=("10.0.0.1", 1), sockname=("10.0.0.2", 8080),
                                   timestamp_start=0)
        ctx = Context(client, options.Options())
        ctx.server = connection.Server(address=("192.0.2.1", 443))
        seen: list[str] = []
        h = _Handler(m.master, _Steps(ctx, seen))
        if not inline:
            h.server_event = synchooks.ORIGINAL.__get__(h)  # type: ignore[method-assign]
        await h.server_event(events.Start())
        after_event = list(seen)
        # mitmproxy 12 keeps its hook tasks itself (asyncio_utils, keep_ref=True)
        while pending := asyncio.all_tasks() - {asyncio.current_task()}:
            await asyncio.gather(*pending)
        return after_event, seen, [c.split(":")[0] for c in calls]

    after_event, seen, calls = asyncio.run(go())
    # inline: the plain hook completed within the same server_event call; mitmproxy's own
    # needs a task for it. Either way the layer sees the same steps, in the same order.
    assert after_event == (["start", "after plain hook"] if inline else ["start"])
    assert seen == ["start", "after plain hook", "after async hook"]
    assert calls == ["plain", "async"]
