"""One socket write per connection per mitmproxy event, instead of one per piece.

mitmproxy turns each event (a chunk read) into commands, and writes every `SendData` to its
socket at once: a request or response goes out as a TLS record and a `send()` for its head,
another for its body, sometimes a third. Profiled under keep-alive load those sends were a
fifth of Sandgate's CPU (on loopback a send also pays for the receiving side).

`Batched` wraps each connection's StreamWriter: `write` collects, and the pieces leave as one
write when the event is done (`server_event` returns) or before anything else is done with the
writer (drain, close, write_eof, ...: any other attribute flushes first), so the bytes, their
order and the backpressure are what they were; only the number of syscalls changes. Nothing waits
for more data: a flush happens at the end of the same event, before the loop runs anything else.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mitmproxy.proxy import events, server

_MARK = "_sandgate_writes"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


class Batched:
    __slots__ = ("parts", "raw")

    def __init__(self, raw: asyncio.StreamWriter) -> None:
        self.raw = raw
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            parts, self.parts = self.parts, []
            self.raw.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def is_closing(self) -> bool:  # asked before every write: no flush needed to answer it
        return self.raw.is_closing()

    def __getattr__(self, name: str) -> Any:
        self.flush()  # drain, close, write_eof, get_extra_info, transport: in order, after writes
        return getattr(self.raw, name)


class _Transports(dict[Any, Any]):
    """ConnectionHandler.transports, wrapping each StreamWriter as it is registered."""

    def __setitem__(self, conn: Any, io: Any) -> None:
        w = io.writer
        if isinstance(w, asyncio.StreamWriter) or getattr(type(w), "BATCHED", False):
            io.writer = Batched(w)  # the client's, and the upstream's (wirelimits._TimedWriter)
        super().__setitem__(conn, io)


def flush(handler: Any) -> None:
    for io in list(handler.transports.values()):
        w = io.writer
        if type(w) is Batched and w.parts:
            w.flush()


ORIGINAL_INIT = server.ConnectionHandler.__init__
ORIGINAL_SERVER_EVENT = server.ConnectionHandler.server_event


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    ORIGINAL_INIT(self, *args, **kwargs)
    self.transports = _Transports(self.transports)


async def _server_event(self: Any, event: events.Event) -> None:
    try:
        await ORIGINAL_SERVER_EVENT(self, event)
    finally:
        flush(self)


def install() -> None:
    cls = server.ConnectionHandler
    if getattr(cls, _MARK, False):
        return
    cls.__init__ = _init  # type: ignore[method-assign]
    cls.server_event = _server_event  # type: ignore[method-assign]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(server.ConnectionHandler, _MARK, False))
