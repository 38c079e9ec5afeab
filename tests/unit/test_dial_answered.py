"""Every upstream dial gets its answer (the "hangup" soak fault: an upstream that resets right
after accepting sometimes left its request without any answer).

The cause: when the RST lands after the TCP connect completed but before asyncio made the
transport (a busy event loop), getpeername() fails, asyncio records no peername, and mitmproxy
11.0.2's `open_connection` dies on `assert command.connection.peername` after registering the
connection and before telling the layer it is open. The layer that asked stays paused for ever.
These tests drive mitmproxy's real ConnectionHandler with Sandgate's patches and a layer that
dials, in exactly that order of events.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import pytest
from mitmproxy import connection, options
from mitmproxy.proxy import commands, events, layer, server
from mitmproxy.proxy.context import Context

from sandgate.limits import LimitsConfig
from sandgate.mitm.guards import dialguard, wirelimits
from sandgate.mitm.speedups import relay, writes

UPSTREAM = ("127.0.15.1", 443)


class _Dial(layer.Layer):
    """The layer that asks for the upstream connection and waits for the answer."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.replies: list[str | None] = []

    def _handle_event(self, event: events.Event) -> Generator[commands.Command, Any, None]:
        if isinstance(event, events.Start):
            err = yield commands.OpenConnection(self.context.server)
            self.replies.append(err)


Hook = Callable[[commands.StartHook], Awaitable[None]]


class _Handler(server.ConnectionHandler):
    def __init__(self, ctx: Context, on_hook: Hook | None = None) -> None:
        super().__init__(ctx)
        self.hooks: list[str] = []
        self.on_hook = on_hook
        self.layer = self.dial = _Dial(ctx)

    async def handle_hook(self, hook: commands.StartHook) -> None:
        self.hooks.append(hook.name)
        if self.on_hook is not None:
            await self.on_hook(hook)


class _Writer:
    """A connected socket's writer as asyncio hands it out; peername None when the upstream's
    RST beat the transport (what asyncio really does, see the integration test)."""

    def __init__(self, peername: tuple[str, int] | None) -> None:
        self.peername = peername
        self.closed = False
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peername, "sockname": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    async def drain(self) -> None:
        pass


def _dialler(writer: _Writer) -> Callable[..., Awaitable[tuple[Any, Any]]]:
    """asyncio.open_connection (mitmproxy's own dial) handing out `writer`."""
    async def open_connection(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        reader = asyncio.StreamReader()
        if writer.peername is None:
            reader.set_exception(ConnectionResetError(104, "Connection reset by peer"))
        return reader, writer

    return open_connection


def _connector(writer: _Writer) -> Callable[..., Awaitable[tuple[Any, Any]]]:
    """loop.create_connection (Sandgate's dial builds its own reader on it) with `writer` as
    the transport."""
    async def create_connection(self: Any, factory: Callable[[], asyncio.Protocol],
                                *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        protocol = factory()
        protocol.connection_made(writer)  # type: ignore[arg-type]
        if writer.peername is None:
            protocol.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
        return writer, protocol

    return create_connection


def _patch_dial(monkeypatch: pytest.MonkeyPatch, writer: _Writer) -> None:
    monkeypatch.setattr(asyncio.BaseEventLoop, "create_connection", _connector(writer))


def _install() -> None:
    wirelimits.install(LimitsConfig())
    relay.install()
    writes.install()
    dialguard.install()


async def _dial(on_hook: Hook | None = None) -> _Handler:
    client = connection.Client(peername=("10.0.0.1", 1), sockname=("10.0.0.2", 8080),
                               timestamp_start=0)
    ctx = Context(client, options.Options())
    ctx.server = connection.Server(address=UPSTREAM)
    h = _Handler(ctx, on_hook)
    await h.server_event(events.Start())
    for _ in range(300):  # 3 s: a fixed dial answers within a few loop iterations
        if h.dial.replies:
            break
        await asyncio.sleep(0.01)
    for io in list(h.transports.values()):
        if io.handler is not None:
            io.handler.cancel()
    return h


def test_reset_before_the_transport_is_a_failed_dial(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandgate's dialler: no peername means the upstream reset it; the layer hears so."""
    _install()
    writer = _Writer(peername=None)
    _patch_dial(monkeypatch, writer)
    h = asyncio.run(_dial())
    assert h.dial.replies, "the dial was never answered: the request would hang"
    err = h.dial.replies[0]
    assert err is not None and wirelimits.RESET_MESSAGE in err
    assert writer.closed and not writer.written  # nothing was sent upstream
    assert h.dial.context.server.error == err
    assert "server_connected" not in h.hooks and "server_connect_error" in h.hooks
    io = h.transports.get(h.dial.context.server)
    assert io is None or io.writer is None  # mitmproxy's failed dial: no transport kept


def test_guard_answers_a_dial_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """mitmproxy's own dial (its peername assertion fails): the guard still answers."""
    _install()
    writer = _Writer(peername=None)
    plain = types.ModuleType("asyncio")  # asyncio itself, with the dead dial: no wirelimits
    plain.__dict__.update(vars(asyncio), open_connection=_dialler(writer))
    monkeypatch.setattr(server, "asyncio", plain)
    h = asyncio.run(_dial())
    assert h.dial.replies, "the dial was never answered: the request would hang"
    err = h.dial.replies[0]
    assert err is not None and err.startswith(dialguard.FAILED) and "AssertionError" in err
    assert writer.closed and not writer.written
    assert h.dial.context.server not in h.transports
    assert h.dial.context.server.state is connection.ConnectionState.CLOSED


def test_guard_answers_a_dial_cancelled_before_its_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the server_connected hook runs (drain_writers cancels the handler of a
    server connection whose writer failed; it is registered before that hook): answered."""
    _install()
    writer = _Writer(peername=UPSTREAM)
    _patch_dial(monkeypatch, writer)

    async def cancel_in_connected(hook: commands.StartHook) -> None:
        if hook.name == "server_connected":
            task = asyncio.current_task()
            assert task is not None
            task.cancel("Error sending data: [Errno 104] Connection reset by peer")
            await asyncio.sleep(0)

    h = asyncio.run(_dial(cancel_in_connected))
    assert h.dial.replies, "the dial was never answered: the request would hang"
    err = h.dial.replies[0]
    assert err is not None and err.startswith(dialguard.FAILED) and "cancelled" in err
    assert writer.closed and not writer.written
    assert h.dial.context.server not in h.transports


def test_a_good_dial_is_answered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _install()
    writer = _Writer(peername=UPSTREAM)
    _patch_dial(monkeypatch, writer)
    h = asyncio.run(_dial())
    assert h.dial.replies == [None]
    assert h.hooks[:2] == ["server_connect", "server_connected"]


def test_guard_is_installed_over_mitmproxy_11_0_2_open_connection() -> None:
    # The guard relies on what open_connection does between the connect and the answer (it
    # registers the connection, asserts a peername, awaits server_connected) and on how a
    # layer waits for a blocking command (Layer._paused). An upgrade must re-check both.
    tree = ast.parse(inspect.getsource(server))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "ConnectionHandler")
    fn = next(n for n in cls.body if isinstance(n, ast.AsyncFunctionDef)
              and n.name == "open_connection")
    source = ast.get_source_segment(inspect.getsource(server), fn)
    assert source is not None
    assert hashlib.sha256(source.encode()).hexdigest() == \
        "cef8d73a19a787df732b7334863e94d0a001b1cbb97bf1b4c882557bd4ca030a"
    assert "assert command.connection.peername" in source
    assert "_paused" in inspect.getsource(layer.Layer.handle_event)
    _install()
    dialguard.install()
    assert dialguard.installed()
    fn: Any = server.ConnectionHandler.open_connection
    while fn is not None and fn.__module__ != dialguard.__name__:  # (upstreampool wraps it too)
        fn = dict(zip(fn.__code__.co_freevars,
                      (c.cell_contents for c in fn.__closure__ or ()), strict=True)).get("original")
    assert getattr(fn, "__wrapped__", None) is not None
