"""A message's head and body leave the HTTP layer as one piece of data, not two.

mitmproxy's HTTP/1 layer sends a request or a response as separate `SendData` commands: the
head, then the body (then the chunked trailer). Inside a TLS tunnel each one travels up through
every layer and becomes its own TLS record (an SSL_write, a BIO read, a command per layer);
profiled under keep-alive load that was a few percent of the CPU per request, on both sides.

`_coalesced` wraps the HTTP layer's event handling: consecutive `SendData` commands to the same
connection, yielded by one event with no other command between them, leave as one `SendData`
with the bytes joined in order. Anything else (another command, another connection, the end of
the event) sends what is held first, so every byte goes out in the same order, in the same
event, before anything that followed it; only the number of pieces changes. Nothing is held
across events and nothing waits for more data (a streamed body's chunks arrive in separate
events and go out as they did). Pieces over `MAX_JOIN` are not copied into a join.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import http as http_layer

_MARK = "_sandgate_coalesce"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


MAX_JOIN = 64 * 1024  # larger pieces go as they are (a whole-body download is not copied)


def _coalesced(gen: Generator[Any, Any, None]) -> Generator[Any, Any, None]:
    held: commands.SendData | None = None
    parts: list[bytes] = []
    size = 0
    reply: Any = None
    while True:
        try:
            command = gen.send(reply)
        except StopIteration:
            break
        reply = None
        if type(command) is commands.SendData:
            n = len(command.data)
            if held is not None and command.connection is held.connection \
                    and size + n <= MAX_JOIN:
                parts.append(command.data)
                size += n
                continue
            if held is not None:
                yield _joined(held, parts)
            if n <= MAX_JOIN:
                held, parts, size = command, [command.data], n
                continue
            held = None
            yield command
            continue
        if held is not None:
            yield _joined(held, parts)
            held = None
        reply = yield command
    if held is not None:
        yield _joined(held, parts)


def _joined(first: commands.SendData, parts: list[bytes]) -> commands.SendData:
    if len(parts) == 1:
        return first
    return commands.SendData(first.connection, b"".join(parts))


def _wrap(original: Any) -> Any:
    def _handle_event(self: Any, event: Any) -> Generator[Any, Any, None]:
        return _coalesced(original(self, event))

    return _handle_event


def install() -> None:
    cls = http_layer.HttpLayer
    if getattr(cls, _MARK, False):
        return
    cls._handle_event = _wrap(cls._handle_event)  # type: ignore[method-assign]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(http_layer.HttpLayer, _MARK, False))
