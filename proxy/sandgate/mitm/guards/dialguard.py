"""Every upstream dial gets its answer: no request waits for ever on a dial that died.

mitmproxy 11.0.2's `ConnectionHandler.open_connection` runs each dial in its own task. The
layer that asked for the connection (`OpenConnection`, a blocking command) is paused until the
task sends it `OpenConnectionCompleted`. Between the TCP connect and that event the task does
more than mitmproxy's error handling covers: it asserts the connection's peername and awaits
the `server_connected` hook. If anything there raises, or the task is cancelled there (a
`drain_writers` of the client connection cancels the handler of a server connection whose
writer failed, and the connection is registered before the hook runs), the task ends without
the event: the layer stays paused, the request gets no answer, and no upstream timeout ends it
(nothing reads the connection). An upstream that resets right after accepting hit exactly this
under load (`wirelimits` now turns that case into the reset it is; this guard is for the rest).

The wrapper answers the dial when the task ends and the asking layer is still paused on it:
the connection is closed and forgotten, marked with an error, and the layer gets
`OpenConnectionCompleted` with that error, so the request ends as a failed dial does (502
`upstream_error`). Nothing was sent upstream: the layers had not been told the connection
exists. Cancellation is re-raised (mitmproxy's own dial error path does the same).

`install()` is idempotent; `installed()` lets a unit test pin the wrapper in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer, server

_MARK = "_sandgate_dialguard"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


FAILED = "sandgate: the upstream connection failed before it could be used"


def waiting(command: commands.OpenConnection) -> bool:
    """Is the layer that asked for this connection still paused, waiting for its answer?"""
    asker = command.blocking
    return (isinstance(asker, layer.Layer) and asker._paused is not None
            and asker._paused.command is command)


async def _answer(handler: Any, command: commands.OpenConnection, error: str) -> None:
    conn = command.connection
    io = handler.transports.get(conn)
    if io is not None and io.handler is asyncio.current_task():
        handler.transports.pop(conn)  # later commands for it are dropped, as for a closed one
        if io.writer is not None:
            with contextlib.suppress(OSError):  # already dead: nothing more to close
                io.writer.close()
    conn.error = conn.error or error
    conn.state = ConnectionState.CLOSED
    await handler.server_event(events.OpenConnectionCompleted(command, conn.error))


def _wrap(original: Any) -> Any:
    async def open_connection(self: Any, command: commands.OpenConnection) -> None:
        try:
            await original(self, command)
        except asyncio.CancelledError:
            if waiting(command):
                self.log(f"{FAILED}: the dial was cancelled", logging.WARNING)
                await _answer(self, command, f"{FAILED} (cancelled)")
            raise
        except Exception as e:
            if not waiting(command):
                raise
            self.log(f"{FAILED}: {type(e).__name__}", logging.ERROR,
                     exc_info=(type(e), e, e.__traceback__))
            await _answer(self, command, f"{FAILED} ({type(e).__name__})")
        else:
            if waiting(command):  # returned without answering: not expected, but never hang
                await _answer(self, command, FAILED)

    open_connection.__wrapped__ = original  # type: ignore[attr-defined]
    return open_connection


def install() -> None:
    cls = server.ConnectionHandler
    if getattr(cls, _MARK, False):
        return
    cls.open_connection = _wrap(cls.open_connection)  # type: ignore[method-assign]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(server.ConnectionHandler, _MARK, False))
