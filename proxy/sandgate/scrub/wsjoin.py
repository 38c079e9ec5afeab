"""WebSocket text deltas (realtime APIs) scrubbed of what the client joins across messages.

Each message from the upstream is already scrubbed on its own (`s70_scrub.websocket_message`);
this adds `sandgate.scrub.joined` over the sequence. mitmproxy relays the message its hook is given,
one at a time, so a message that must wait is dropped and, once settled, sent again by
injection (`inject.websocket`), rewritten or as it was, together with every message that
waited behind it, in order. Injected messages come back through the hook (marked `injected`)
and pass as they are (ours are told from other injected ones by their content, in the order
sent); while some are still on their way, every new message from the upstream is queued behind
them the same way, so none overtakes another.

The common case costs nothing extra: a message with no candidate, while nothing waits, leaves
as it came.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mitmproxy.websocket import WebSocketMessage

from sandgate.scrub.joined import JoinedScrubber
from sandgate.scrub.scrubber import SecretSet

Inject = Callable[[bytes, bool], None]
"""Send (payload, is_text) to the client as a new message, after those sent before."""


class WsJoin:
    def __init__(self, secrets: SecretSet, inject: Inject) -> None:
        self._joined: JoinedScrubber[WebSocketMessage] = JoinedScrubber(secrets)
        self._inject = inject
        self._in_flight: deque[bytes] = deque()  # what we injected and the hook has not seen

    @property
    def replacements(self) -> int:
        return self._joined.replacements

    @property
    def holding(self) -> int:
        return self._joined.holding

    def message(self, message: WebSocketMessage) -> None:
        """An upstream message, scrubbed alone already: relayed, held (dropped) or replaced by
        injections."""
        if message.injected:
            if self._in_flight and message.content == self._in_flight[0]:
                self._in_flight.popleft()  # ours: decided when it was sent
            return
        released = self._joined.feed(message, message.content if message.is_text else None)
        if not self._in_flight and released == [(message, None)]:
            return  # leaves as it came, now
        message.drop()
        for msg, new in released:
            payload = msg.content if new is None else new
            self._in_flight.append(payload)
            self._inject(payload, msg.is_text)
