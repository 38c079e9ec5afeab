"""Every WebSocket frame is a channel: ping, pong and close payloads are judged like messages.

mitmproxy 12.3.1 gives addons a hook for data messages only (`websocket_message`); its
WebSocket layer (mitmproxy/proxy/layers/websocket.py, `WebsocketLayer.relay_messages`) relays
a Ping, a Pong and a Close frame's reason as it read them, and logs a ping's payload. A close
reason (up to 123 bytes) or a ping payload (up to 125) has room for any API key, both ways.

So the wsproto connections the layer reads from are patched: each control event read from one
side passes through the flow's handler (`HANDLER_KEY` in flow.metadata, set by the addon when
the WebSocket starts) before the layer sees it, logs it or relays it:

* from the server: the payload is scrubbed (and cut back to what a control frame can carry);
* from the client: a payload carrying a credential is not relayed (a ping or pong is dropped,
  a close goes on without its reason) and the addon audits the exfiltration and silences the
  stream, as for a message.

With no handler (a flow the addon never saw start) every control payload is emptied: fail
closed.

Two more things ride on the same patch, for WebSockets whose messages are judged one by one
(sandgate.stages.wsrpc): a data message that arrives in more than one frame is noted
(`fragmented`: mitmproxy hands the hook the reassembled message only), and the addon may ask
for the WebSocket to be closed (`close`): the next event read is then a close with that code,
which the layer sends to both sides before it ends the flow.

The patch touches two functions whose exact source is pinned (sandgate.mitm.registry, checked
again at start); a test fails when mitmproxy's or wsproto's code changes, so an upgrade is
looked at, not trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import wsproto.events as ws_events
from mitmproxy import http
from mitmproxy.proxy.layers import websocket as ws_layer
from wsproto.connection import Connection

log = logging.getLogger("sandgate")

HANDLER_KEY = "sandgate.websocket_control"
FRAGMENTED_KEY = "sandgate.websocket_fragmented"  # sides (from_client) whose message had frames
CLOSE_KEY = "sandgate.websocket_close"  # (code, reason) the addon closes the WebSocket with
_TAG = "_sandgate_side"  # on each WebsocketConnection: (flow, from_client)
_MARK = "_sandgate_control_patched"

# What a control frame can carry (RFC 6455 5.5): 125 bytes; a close reason 123 after its code.
PING_MAX = 125
REASON_MAX = 123

Handler = Callable[[bool, bytes], "bytes | None"]
"""(from_client, payload) -> the payload to relay, or None: do not relay it."""

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


def _payload(event: ws_events.Event) -> bytes:
    if isinstance(event, ws_events.CloseConnection):
        return (event.reason or "").encode("utf-8", "surrogatepass")
    assert isinstance(event, ws_events.Ping | ws_events.Pong)
    return bytes(event.payload)


def _cut_utf8(data: bytes, limit: int) -> str:
    return data[:limit].decode("utf-8", "ignore")


def _with_payload(event: ws_events.Event, payload: bytes) -> ws_events.Event:
    if isinstance(event, ws_events.CloseConnection):
        return ws_events.CloseConnection(code=event.code,
                                         reason=_cut_utf8(payload, REASON_MAX) or None)
    if isinstance(event, ws_events.Ping):
        return ws_events.Ping(payload=payload[:PING_MAX])
    return ws_events.Pong(payload=payload[:PING_MAX])


def judged(event: ws_events.Event, from_client: bool,
           handler: Handler | None) -> ws_events.Event | None:
    """The control event to relay in place of `event`, or None to relay nothing."""
    payload = _payload(event)
    if not payload:
        return event
    try:
        out = handler(from_client, payload) if handler is not None else b""
    except Exception:
        log.exception("sandgate: judging a WebSocket control frame failed; emptying it")
        out = b""
    if out is None:
        if isinstance(event, ws_events.CloseConnection):
            return ws_events.CloseConnection(code=event.code)  # the close must still happen
        return None
    return event if out == payload else _with_payload(event, out)


_CONTROL = (ws_events.Ping, ws_events.Pong, ws_events.CloseConnection)


def fragmented(flow: http.HTTPFlow, from_client: bool) -> bool:
    """Did the message the hook now holds from this side arrive in more than one frame? (The
    note is taken: the next message starts afresh.)"""
    sides: set[bool] | None = flow.metadata.get(FRAGMENTED_KEY)
    if not sides or from_client not in sides:
        return False
    sides.discard(from_client)
    return True


def close(flow: http.HTTPFlow, code: int, reason: str) -> None:
    """Close the WebSocket both ways with `code` as soon as the layer reads on (right after the
    message hook that asks for it); the first request wins."""
    flow.metadata.setdefault(CLOSE_KEY, (code, _cut_utf8(reason.encode(), REASON_MAX)))


def _events(self: Any) -> Generator[ws_events.Event, None, None]:
    side = getattr(self, _TAG, None)
    flow, from_client = side if side is not None else (None, False)
    for event in Connection.events(self):
        if isinstance(event, _CONTROL):
            handler = flow.metadata.get(HANDLER_KEY) if flow is not None else None
            replaced = judged(event, from_client, handler)
            if replaced is None:
                continue
            event = replaced
        elif (isinstance(event, ws_events.Message) and flow is not None
              and event.frame_finished and not event.message_finished):
            flow.metadata.setdefault(FRAGMENTED_KEY, set()).add(from_client)
        yield event
        asked = flow.metadata.get(CLOSE_KEY) if flow is not None else None
        if asked is not None:  # relay_messages sends it to both sides and ends the flow
            yield ws_events.CloseConnection(code=asked[0], reason=asked[1] or None)
            return


def install() -> None:
    """Patch mitmproxy's WebSocket layer once (before any connection)."""
    layer = ws_layer.WebsocketLayer
    if getattr(layer, _MARK, False):
        return
    original = layer.relay_messages

    def relay_messages(self: Any, event: Any) -> Any:
        flow: http.HTTPFlow = self.flow
        setattr(self.client_ws, _TAG, (flow, True))
        setattr(self.server_ws, _TAG, (flow, False))
        return (yield from original(self, event))

    relay_messages.__wrapped__ = original  # type: ignore[attr-defined]
    layer.relay_messages = relay_messages  # type: ignore[method-assign]
    ws_layer.WebsocketConnection.events = _events
    setattr(layer, _MARK, True)


def installed() -> bool:
    return bool(getattr(ws_layer.WebsocketLayer, _MARK, False))
