"""sandgate.scrub.wsjoin: WebSocket text deltas joined by the client, scrubbed, in order.

The relay is modelled the way mitmproxy's WebSocket layer works: the hook sees each upstream
message, a dropped one is not relayed, an injected one comes back through the hook (marked
injected) after the messages already queued, and is relayed as it is. Fakes only."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from sandgate.scrub.scrubber import HOLD_AFTER, SecretSet
from sandgate.scrub.wsjoin import WsJoin
from tests.unit.fuzz import examples

KEY = "FAKE-realtime-key-0123456789"
SET = SecretSet({"openai": KEY})


class Relay:
    """Upstream messages in; what the client receives out."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bool]] = []
        self._injected: list[tuple[bytes, bool]] = []
        self.join = WsJoin(SET, lambda payload, text: self._injected.append((payload, text)))

    def _hook(self, msg: WebSocketMessage) -> None:
        self.join.message(msg)
        if not msg.dropped:
            self.sent.append((msg.content, msg.is_text))

    def upstream(self, content: bytes, text: bool = True, burst: bool = False) -> None:
        """One message from the upstream; `burst`: it came in the same read as the one before,
        before any injection was processed."""
        if not burst:
            self.settle()
        self._hook(WebSocketMessage(Opcode.TEXT if text else Opcode.BINARY, False, content))

    def settle(self) -> None:
        while self._injected:
            payload, text = self._injected.pop(0)
            self._hook(WebSocketMessage(Opcode.TEXT if text else Opcode.BINARY, False, payload,
                                        injected=True))


def delta(d: str) -> bytes:
    return json.dumps({"type": "response.output_text.delta", "item_id": "it",
                       "output_index": 0, "content_index": 0, "delta": d}).encode()


def joined(sent: list[tuple[bytes, bool]]) -> str:
    return "".join(json.loads(p)["delta"] for p, text in sent if text)


def test_a_message_with_no_candidate_is_relayed_as_it_came():
    r = Relay()
    r.upstream(delta("hello"))
    assert r.sent == [(delta("hello"), True)] and r.join.holding == 0


def test_a_key_split_across_messages_is_redacted_and_order_kept():
    r = Relay()
    r.upstream(delta("key: " + KEY[:12]))
    assert r.sent == [] and r.join.holding == 1
    r.upstream(b"\x00binary", text=False)  # waits behind the held one
    r.upstream(delta(KEY[12:] + " ok"))
    r.settle()
    assert joined(r.sent) == "key: [REDACTED:openai] ok"
    assert r.sent[1] == (b"\x00binary", False)
    assert r.join.replacements == 1


@given(cuts=st.lists(st.integers(0, 60), max_size=20), bursts=st.lists(st.booleans()))
@settings(max_examples=examples(100), deadline=None, database=None)
def test_any_split_and_any_interleaving_with_injections(cuts, bursts):
    text = "a " + KEY + " b"
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    r = Relay()
    for i, (a, b) in enumerate(itertools.pairwise(points)):
        r.upstream(delta(text[a:b]), burst=bursts[i] if i < len(bursts) else False)
    r.settle()
    out = joined(r.sent)
    assert KEY not in out and KEY[:HOLD_AFTER] not in out
    assert out.startswith("a ") and out.endswith("[REDACTED:openai] b")


def test_a_message_someone_else_injected_is_not_taken_for_ours():
    """Another part of Sandgate may inject a message to the client (a JSON-RPC error): it
    passes, and does not count as one of the held messages coming back."""
    r = Relay()
    r.upstream(delta(KEY[:12]))
    r.upstream(delta(KEY[12:]), burst=True)  # released: injected, not yet back
    for _ in range(2):
        r._hook(WebSocketMessage(Opcode.TEXT, False, b"other", injected=True))
    r.upstream(delta(" tail"), burst=True)  # must still queue behind ours
    r.settle()
    texts = [p for p, _ in r.sent if p != b"other"]
    assert joined([(p, True) for p in texts]) == "[REDACTED:openai] tail"
