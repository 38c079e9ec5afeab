"""Each upstream dial knows the flow that asked for it.

`server_connect` (stages/s60_dial.py) lets a dial go only to the address the request was
judged and pinned for, and tells TLS the name to verify. mitmproxy's hook gives it the
`Server` and the client connection, not the flow. Keeping "this address may be dialled, with
this name" per client connection let one request use another's answer: over HTTP/2 to the
proxy port, one connection carries many CONNECT streams (tunnels), each with its own caller,
rule and name; two tunnels to two names on one IP (or one name under rules with different
`private_cidrs`) could pin in turn, and the first one's dial then read the second one's name
and address. Here the dial is bound to its flow instead, so nothing shared can race.

mitmproxy 12.3.1 makes every upstream connection of an HTTP layer in
`HttpLayer.get_connection`, on behalf of the stream that asked (`command_sources[event]`),
and the new connection's `OpenConnection` passes up through that generator before any task
dials it. The wrapper records `Server id -> the asking stream's flow` there; `take` hands
it to `server_connect` once. A dial with no such record (none is expected: every HTTP dial
comes through here; passthrough tunnels are judged by their tunnel record) is refused there.

Its entry in sandgate.mitm.registry pins the source this wrapper was written against: a
mitmproxy that changes it fails `test_mitm_registry.py::test_source_is_pinned[dialorigin]`.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import http as http_layer

_MARK = "_sandgate_dialorigin"
# Dials asked for and not yet at server_connect. One entry lives from the layer's request for a
# connection to its hook (the same event-loop turn, or the next); the bound only matters if a
# dial task were cancelled before its hook, which would otherwise leave entries behind.
MAX_PENDING = 4096
_origin: dict[str, http.HTTPFlow] = {}

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


def take(server: connection.Server) -> http.HTTPFlow | None:
    """The flow whose request asked for this dial (once: the record is removed)."""
    return _origin.pop(server.id, None)


def forget(server: connection.Server) -> None:
    _origin.pop(server.id, None)


def note(server: connection.Server, flow: http.HTTPFlow) -> None:
    """`flow`'s request asked for the dial of `server` (the wrapper below; unit tests)."""
    _origin[server.id] = flow
    while len(_origin) > MAX_PENDING:
        del _origin[next(iter(_origin))]


def _wrap_get_connection(original: Any) -> Any:
    def get_connection(self: Any, event: Any, *, reuse: bool = True) -> Generator[Any, Any, None]:
        stream = self.command_sources.get(event)
        flow = getattr(stream, "flow", None)
        gen = original(self, event, reuse=reuse)
        # Drive the generator by hand: a value sent back to this one goes on to the original.
        try:
            command = next(gen)
            while True:
                if isinstance(flow, http.HTTPFlow) and isinstance(command,
                                                                   commands.OpenConnection):
                    note(command.connection, flow)
                reply = yield command
                command = gen.send(reply)
        except StopIteration:
            return

    get_connection.__wrapped__ = original  # type: ignore[attr-defined]
    return get_connection


def install() -> None:
    layer = http_layer.HttpLayer
    if getattr(layer, _MARK, False):
        return
    layer.get_connection = _wrap_get_connection(layer.get_connection)  # type: ignore[method-assign]
    setattr(layer, _MARK, True)


def installed() -> bool:
    return bool(getattr(http_layer.HttpLayer, _MARK, False))
