"""Hooks whose every handler is a plain function run at once, without a task of their own.

mitmproxy 12.3.1 runs each hook a layer starts (`StartHook`) in a new asyncio task: the task
calls the addons, then feeds `HookCompleted` back through `server_event` (its lock, the layer
stack again). A passthrough tunnel's layers start five such hooks, and three of them have no
handler that awaits anything: `next_layer` twice (mitmproxy's NextLayer addon) and
`http_connected` (no handler at all); `http_connect` and `tls_clienthello` are Sandgate's
async judging hooks. (The connection hooks, `client_connected` ... `server_disconnected`, are
awaited by mitmproxy's connection handler directly, without a task: they are not changed.)
Each of those cost a task, the lock and one more `server_event` call (profiled under
`bench/focus.py --phase new_conn`); intercepted flows' plain hooks (`response`, `error`,
`tls_start_client`, ...) take the same shortcut.

`server_event` below is mitmproxy's, with one change: a hook whose handlers (and, for a flow,
those of the `update` hook that follows it) are all plain functions is called right there,
through the same cached handler list and the same `safecall` error handling
(`CachedAddons.call_now`), and its `HookCompleted` is handled by the same `server_event` call
once the commands of the event that started it are done: the order of events the layers see is
one mitmproxy could produce (the hook's task running first), only with nothing in between. Any
hook with an `async` handler (all of Sandgate's judging hooks: `guarded`), a flow that is
intercepted, or a manager without the cache takes mitmproxy's task as before.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import flow as mflow
from mitmproxy.proxy import commands, events, server
from mitmproxy.utils import asyncio_utils

from sandgate.mitm.speedups import writes

_MARK = "_sandgate_synchooks"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


def call_now(handler: Any, hook: commands.StartHook) -> bool:
    """Run `hook` now if nothing in it awaits; False leaves it to mitmproxy's task."""
    addons = getattr(getattr(handler, "master", None), "addons", None)
    call = getattr(addons, "call_now", None)
    if call is None:
        return False
    args = hook.args()
    if len(args) == 1 and isinstance(args[0], mflow.Flow) and args[0].intercepted:
        return False  # handle_hook would wait for its resumption
    return bool(call(hook))


async def server_event(self: Any, event: events.Event) -> None:
    """mitmproxy 12.3.1's ConnectionHandler.server_event; plain hooks complete inline."""
    async with self._server_event_lock:
        # No `await` beyond this point.
        self.timeout_watchdog.register_activity()
        pending = [event]
        while pending:
            event = pending.pop(0)
            try:
                layer_commands = self.layer.handle_event(event)
                for command in layer_commands:
                    if isinstance(command, commands.OpenConnection):
                        assert command.connection not in self.transports
                        handler = asyncio_utils.create_task(
                            self.open_connection(command),
                            name=f"server connection handler {command.connection.address}",
                            keep_ref=False,
                            client=self.client.peername,
                        )
                        self.transports[command.connection] = server.ConnectionIO(
                            handler=handler
                        )
                    elif isinstance(command, commands.RequestWakeup):
                        task = asyncio_utils.create_task(
                            self.wakeup(command),
                            name=f"wakeup timer ({command.delay:.1f}s)",
                            keep_ref=False,
                            client=self.client.peername,
                        )
                        assert task is not None
                        self.wakeup_timer.add(task)
                    elif (
                        isinstance(command, commands.ConnectionCommand)
                        and command.connection not in self.transports
                    ):
                        pass  # The connection has already been closed.
                    elif isinstance(command, commands.SendData):
                        writer = self.transports[command.connection].writer
                        assert writer
                        if not writer.is_closing():
                            writer.write(command.data)
                    elif isinstance(command, commands.CloseTcpConnection):
                        self.close_connection(command.connection, command.half_close)
                    elif isinstance(command, commands.CloseConnection):
                        self.close_connection(command.connection, False)
                    elif isinstance(command, commands.StartHook):
                        if call_now(self, command):
                            if command.blocking:
                                pending.append(events.HookCompleted(command))
                            continue
                        asyncio_utils.create_task(
                            self.hook_task(command),
                            name=f"handle_hook({command.name})",
                            keep_ref=True,
                            client=self.client.peername,
                        )
                    elif isinstance(command, commands.Log):
                        self.log(command.message, command.level)
                    else:
                        raise RuntimeError(f"Unexpected command: {command}")
            except Exception:
                self.log("mitmproxy has crashed!", logging.ERROR, exc_info=True)


ORIGINAL = server.ConnectionHandler.server_event  # what `server_event` copies


def install() -> None:
    """In either order with writes.install(): its wrapper (the flush after each event) calls
    this server_event instead of mitmproxy's."""
    cls = server.ConnectionHandler
    if getattr(cls, _MARK, False):
        return
    writes.ORIGINAL_SERVER_EVENT = server_event
    if not writes.installed():
        cls.server_event = server_event  # type: ignore[method-assign]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(server.ConnectionHandler, _MARK, False))

