"""sandgate.scrub.joined: what a client joins across streamed events never holds a secret.

Every secret here is random hypothesis data or an obvious fake, compared with `in` / `not in`
only, never printed. The properties put a form of a secret (every form `sandgate.secrets.forms`
lists) into a text, cut the text into deltas at arbitrary points (1-character deltas too),
frame them as each provider streams them, send the body through the real response scrubber in
arbitrary chunks, and join what leaves as the client does.
"""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Callable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mitmproxy.test import tutils

from sandgate.scrub.joined import EventStream, JoinedScrubber
from sandgate.scrub.scrubber import HOLD_AFTER, REDACTED_TEMPLATE, SecretSet
from sandgate.scrub.stream import ResponseScrubber, scrub_whole
from sandgate.secrets.forms import classified_forms
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(150), deadline=None, database=None)

# Text around a secret: no character any form of an ASCII letters-digits-dash secret has, so a
# form's prefix in the client's text can only come from the secret.
FILLER = " .,;!?é€😀\n"
SECRET = st.text(string.ascii_letters + string.digits + "-", min_size=12, max_size=40)
GEMINI_PATH = "/v1beta/models/m:streamGenerateContent"

# --------------------------------------------------------------------- formats and clients


def _dumps(obj: object) -> str:
    # Non-ASCII raw, as most APIs send it: a \\uXXXX escape's hex digits next to an all-digit
    # secret would be cut by the per-body scrub (its own behaviour, not this layer's).
    return json.dumps(obj, ensure_ascii=False)


def _sse(obj: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {_dumps(obj)}\n\n".encode()


def _anthropic(field: str) -> Callable[[str], bytes]:
    kind = {"text": "text_delta", "partial_json": "input_json_delta",
            "thinking": "thinking_delta"}[field]
    return lambda d: _sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": kind, field: d}}, "content_block_delta")


def _chat(d: str) -> bytes:
    return _sse({"id": "c1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": d}, "finish_reason": None}]})


def _chat_tool(d: str) -> bytes:
    return _sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": d}}]}}]})


def _responses(d: str) -> bytes:
    return _sse({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                 "content_index": 0, "delta": d}, "response.output_text.delta")


def _gemini(d: str) -> dict[str, object]:
    return {"candidates": [{"content": {"parts": [{"text": d}], "role": "model"},
                            "index": 0}]}


def _plain(d: str) -> bytes:
    return b"".join(b"data: " + line.encode() + b"\n" for line in d.split("\n")) + b"\n"


# name -> (content type, path, body of the deltas, the client's join of a body)
Format = tuple[str, str, Callable[[list[str]], bytes], Callable[[bytes], str]]


def _sse_data(body: bytes) -> list[str]:
    out = []
    for event in re.split(r"\r\n\r\n|\n\n|\r\r", body.decode()):
        data = [ln[5:].removeprefix(" ") for ln in re.split(r"\r\n|\n|\r", event)
                if ln.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def _sse_join(path: Callable[[dict], str]) -> Callable[[bytes], str]:  # type: ignore[type-arg]
    return lambda body: "".join(path(json.loads(d)) for d in _sse_data(body))


FORMATS: dict[str, Format] = {
    "anthropic-text": ("text/event-stream", "",
                       lambda ds: b"".join(map(_anthropic("text"), ds)),
                       _sse_join(lambda o: o["delta"]["text"])),
    "anthropic-json": ("text/event-stream", "",
                       lambda ds: b"".join(map(_anthropic("partial_json"), ds)),
                       _sse_join(lambda o: o["delta"]["partial_json"])),
    "anthropic-thinking": ("text/event-stream", "",
                           lambda ds: b"".join(map(_anthropic("thinking"), ds)),
                           _sse_join(lambda o: o["delta"]["thinking"])),
    "openai-chat": ("text/event-stream", "",
                    lambda ds: b"".join(map(_chat, ds)) + b"data: [DONE]\n\n",
                    lambda b: "".join(json.loads(d)["choices"][0]["delta"]["content"]
                                      for d in _sse_data(b) if d != "[DONE]")),
    "openai-tool-args": ("text/event-stream", "",
                         lambda ds: b"".join(map(_chat_tool, ds)),
                         _sse_join(lambda o: o["choices"][0]["delta"]["tool_calls"][0]
                                   ["function"]["arguments"])),
    "openai-responses": ("text/event-stream", "",
                         lambda ds: b"".join(map(_responses, ds)),
                         _sse_join(lambda o: o["delta"])),
    "gemini-sse": ("text/event-stream", "",
                   lambda ds: b"".join(_sse(_gemini(d)) for d in ds),
                   _sse_join(lambda o: o["candidates"][0]["content"]["parts"][0]["text"])),
    "gemini-array": ("application/json; charset=UTF-8", GEMINI_PATH,
                     lambda ds: ("[" + ",\r\n".join(_dumps(_gemini(d)) for d in ds)
                                 + "]").encode(),
                     lambda b: "".join(o["candidates"][0]["content"]["parts"][0]["text"]
                                       for o in json.loads(b))),
    "ndjson": ("application/x-ndjson", "",
               lambda ds: b"".join(_dumps({"message": {"content": d}}).encode() + b"\n"
                                   for d in ds),
               lambda b: "".join(json.loads(ln)["message"]["content"]
                                 for ln in b.decode().splitlines() if ln)),
    "json-seq": ("application/json-seq", "",
                 lambda ds: b"".join(b"\x1e" + _dumps({"params": {"delta": d}}).encode()
                                     + b"\n" for d in ds),
                 lambda b: "".join(json.loads(r)["params"]["delta"]
                                   for r in b.decode().split("\x1e") if r.strip())),
    "sse-text": ("text/event-stream", "", lambda ds: b"".join(map(_plain, ds)),
                 lambda b: "".join(_sse_data(b))),
}


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)] or [""]


def _through(secrets: SecretSet, fmt: Format, body: bytes, chunks: list[int]) -> bytes:
    ctype, path, _, _ = fmt
    resp = tutils.tresp(content=b"")
    resp.headers["content-type"] = ctype
    del resp.headers["content-length"]
    scrubber = ResponseScrubber(secrets, "identity", resp, "HTTP/1.1", path)
    out: list[bytes] = []
    pos = 0
    for cut in sorted({c % (len(body) + 1) for c in chunks}):
        if cut > pos:
            out += scrubber(body[pos:cut])
            pos = cut
    out += scrubber(body[pos:])
    out += scrubber(b"")
    return b"".join(out)


def _form_text(secret: str, pick: int) -> str:
    forms = sorted(classified_forms(secret.encode()))
    return forms[pick % len(forms)].decode("ascii")


# ------------------------------------------------------------------------------ properties


def _candidate_in(secret: str, text: str) -> bool:
    """Does `text` hold the first HOLD_AFTER bytes of a form (what may make a delta wait)?"""
    return any(f[:HOLD_AFTER].decode() in text for f in classified_forms(secret.encode()))


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(secret=SECRET, pick=st.integers(0, 200),
       before=st.text(FILLER, max_size=12), after=st.text(FILLER, max_size=12),
       cuts=st.lists(st.integers(0, 200), max_size=30) | st.just(list(range(200))),
       chunks=st.lists(st.integers(0, 4000), max_size=12))
@SETTINGS
def test_a_form_cut_anywhere_never_reaches_the_client_join(name, secret, pick, before, after,
                                                           cuts, chunks):
    """Any split points, all of them too (1-character deltas), any chunking of the bytes."""
    fmt = FORMATS[name]
    form = _form_text(secret, pick)
    secrets = SecretSet({"k": secret})
    body = fmt[2](_cut(before + form + after, cuts))
    joined = fmt[3](_through(secrets, fmt, body, chunks))
    marker = REDACTED_TEMPLATE.format(name="k")
    for other in classified_forms(secret.encode()):
        assert other.decode("ascii") not in joined
        if len(other) > HOLD_AFTER:  # the bound: at most HOLD_AFTER - 1 leading bytes leave
            assert other[:HOLD_AFTER].decode("ascii") not in joined
    # exactly: the text, what may have left of the form before holding, the marker (and,
    # when a shorter form began earlier inside a periodic one, the rest of the longer form)
    assert joined.startswith(before) and joined.endswith(after)
    middle = joined[len(before):len(joined) - len(after)]
    leading = middle[:middle.index(marker)]
    assert form.startswith(leading) and len(leading) < HOLD_AFTER
    assert form.endswith(middle[middle.rindex(marker) + len(marker):])


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(secret=SECRET, text=st.text(string.printable.replace("\r", "") + "é😀", max_size=60),
       cuts=st.lists(st.integers(0, 100), max_size=30))
@SETTINGS
def test_text_without_a_secret_leaves_byte_identical_and_at_once(name, secret, text, cuts):
    fmt = FORMATS[name]
    if fmt[0] != "text/event-stream":
        return  # event by event below; the array and line framings are covered by the join
    assume(not _candidate_in(secret, text))
    secrets = SecretSet({"k": secret})
    stream = EventStream(secrets, "sse")
    deltas = _cut(text, cuts)
    for d in deltas:
        event = fmt[2]([d])
        assert stream.feed(event) == event  # each event leaves as it completes, unchanged
    assert stream.flush() == b"" and stream.replacements == 0


@given(secret=SECRET, text=st.text(string.printable.replace("\r", "") + "é😀", max_size=60),
       cuts=st.lists(st.integers(0, 100), max_size=30),
       chunks=st.lists(st.integers(0, 4000), max_size=12))
@SETTINGS
def test_text_without_a_secret_is_byte_identical_in_every_framing(secret, text, cuts, chunks):
    assume(not _candidate_in(secret, text))
    secrets = SecretSet({"k": secret})
    for fmt in FORMATS.values():
        body = fmt[2](_cut(text, cuts))
        assert _through(secrets, fmt, body, chunks) == body


# ------------------------------------------------------------------------------ examples

KEY = "FAKE-joined-key-0123456789"
SET = SecretSet({"anthropic": KEY})


def test_a_key_split_in_two_anthropic_deltas_is_redacted_in_the_join():
    fmt = FORMATS["anthropic-text"]
    body = fmt[2](["Your key: " + KEY[:13], KEY[13:] + " (keep it safe)"])
    assert KEY[:13] in body.decode() and KEY not in body.decode()  # no event holds it whole
    joined = fmt[3](_through(SET, fmt, body, []))
    assert joined == "Your key: [REDACTED:anthropic] (keep it safe)"


def test_events_wait_only_while_the_candidate_is_long_enough():
    stream = EventStream(SET, "sse")
    first = _anthropic("text")("key " + KEY[:HOLD_AFTER - 1])
    assert stream.feed(first) == first  # 7 leading bytes: still under the bound, not held
    assert stream.feed(_anthropic("text")(KEY[HOLD_AFTER - 1:HOLD_AFTER + 3])) == b""
    assert stream.holding == 1
    out = stream.feed(_anthropic("text")(KEY[HOLD_AFTER + 3:] + "!"))
    assert FORMATS["anthropic-text"][3](out) == "[REDACTED:anthropic]!"
    assert stream.holding == 0 and stream.replacements == 1


def test_a_candidate_that_turns_out_harmless_is_released_unchanged():
    stream = EventStream(SET, "sse")
    held = _anthropic("text")(KEY[:12])
    assert stream.feed(held) == b""
    nxt = _anthropic("text")(" no, not that")
    assert stream.feed(nxt) == held + nxt


def test_a_candidate_is_released_when_its_block_ends_or_the_stream_ends():
    stream = EventStream(SET, "sse")
    held = _anthropic("text")(KEY[:12])
    assert stream.feed(held) == b""
    stop = _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    assert stream.feed(stop) == held + stop
    again = EventStream(SET, "sse")
    assert again.feed(held) == b"" and again.flush() == held


def test_other_blocks_wait_behind_a_held_one_and_keep_their_order():
    stream = EventStream(SET, "sse")
    a = _anthropic("text")(KEY[:12])
    b = _sse({"type": "content_block_delta", "index": 1,
              "delta": {"type": "text_delta", "text": "other block"}})
    assert stream.feed(a) == b"" and stream.feed(b) == b""
    c = _anthropic("text")(KEY[12:])
    out = stream.feed(c)
    texts = [json.loads(d)["delta"]["text"] for d in _sse_data(out)]
    assert texts == ["[REDACTED:anthropic]", "other block", ""]


def test_the_queue_is_bounded():
    stream = EventStream(SET, "sse")
    assert stream.feed(_anthropic("text")(KEY[:12])) == b""
    filler = _sse({"type": "ping", "pad": "x" * 70_000})
    assert stream.feed(filler) != b"" and stream.holding == 0


def test_choices_and_tool_calls_join_separately():
    def chunk(i: int, d: str) -> bytes:
        return _sse({"choices": [{"index": i, "delta": {"content": d}}]})
    stream = EventStream(SET, "sse")
    out = stream.feed(chunk(0, KEY[:12]) + chunk(1, "x" + KEY[12:]) + chunk(0, KEY[12:]))
    out += stream.flush()
    joined: dict[int, str] = {0: "", 1: ""}
    for d in _sse_data(out):
        c = json.loads(d)["choices"][0]
        joined[c["index"]] += c["delta"]["content"]
    assert joined == {0: "[REDACTED:anthropic]", 1: "x" + KEY[12:]}


def test_a_json_escaped_form_inside_partial_json_deltas():
    secrets = SecretSet({"k": "FAKE/slash-key-0123"})
    fmt = FORMATS["anthropic-json"]
    args = '{"cmd": "FAKE\\/slash-key-0123"}'  # the JSON a tool call's input is built from
    body = fmt[2]([args[:20], args[20:]])
    assert fmt[3](_through(secrets, fmt, body, [])) == '{"cmd": "[REDACTED:k]"}'
    # a first delta ending 6 bytes into the form is under the bound: those 6 leave
    body = fmt[2]([args[:15], args[15:]])
    assert fmt[3](_through(secrets, fmt, body, [])) == '{"cmd": "FAKE\\/[REDACTED:k]"}'


def test_non_ascii_secret_split_inside_a_character_sequence():
    secrets = SecretSet({"k": "FAKÉ-ключ-0123"})
    fmt = FORMATS["openai-chat"]
    body = fmt[2](["a FAKÉ-кл", "ю", "ч-0123 b"])
    assert fmt[3](_through(secrets, fmt, body, [5, 77])) == "a [REDACTED:k] b"


def test_small_known_length_stream_is_scrubbed_whole_and_joined():
    fmt = FORMATS["openai-responses"]
    body = fmt[2]([KEY[:10], KEY[10:]])
    resp = tutils.tresp(content=body)
    resp.headers["content-type"] = "text/event-stream"
    assert scrub_whole(resp, SET) == 1
    assert fmt[3](resp.raw_content or b"") == "[REDACTED:anthropic]"
    assert resp.headers["content-length"] == str(len(resp.raw_content or b""))


def test_websocket_messages_join_per_realtime_item():
    joined: JoinedScrubber[int] = JoinedScrubber(SET)

    def msg(d: str) -> bytes:
        return _dumps({"type": "response.text.delta", "item_id": "i", "output_index": 0,
                           "content_index": 0, "delta": d}).encode()

    assert joined.feed(1, msg("hi ")) == [(1, None)]
    assert joined.feed(2, msg(KEY[:12])) == []
    out = joined.feed(3, msg(KEY[12:] + "."))
    assert [i for i, _ in out] == [2, 3]
    assert [json.loads(p or b"")["delta"] for _, p in out] == ["[REDACTED:anthropic]", "."]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "index", "delta", "text", "choices", "item_id", "candidates",
                         "content", "parts", "tool_calls", "function", "arguments"]),
        inner, max_size=4),
    max_leaves=12)


@given(docs=st.lists(JSON, max_size=6), noise=st.binary(max_size=40),
       chunks=st.lists(st.integers(0, 2000), max_size=8))
@SETTINGS
def test_any_json_events_or_bytes_pass_unchanged_and_never_raise(docs, noise, chunks):
    """Odd shapes in provider-looking fields (an index that is a list, choices that are not a
    list, ...) and bytes that are no event at all: nothing raises, nothing changes."""
    for name in ("sse-text", "ndjson", "gemini-array"):
        fmt = FORMATS[name]
        if name == "sse-text":
            body = b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in docs) + noise
        elif name == "ndjson":
            body = b"".join(json.dumps(d).encode() + b"\n" for d in docs) + noise
        else:
            body = ("[" + ",".join(json.dumps(d) for d in docs) + "]").encode()
        assert _through(SET, fmt, body, chunks) == body


def test_deeply_nested_event_is_passed_not_walked():
    deep = b"data: " + b"[" * 5000 + b"]" * 5000 + b"\n\n"
    stream = EventStream(SET, "sse")
    assert stream.feed(deep) == deep


@pytest.mark.parametrize("doc", [
    {"type": "response.output_text.delta", "item_id": [1], "delta": "a"},
    {"type": "content_block_delta", "index": {"a": 1}, "delta": {"text": "a"}},
    {"choices": {"x": {"index": [0], "delta": {"tool_calls": {"y": {"index": {}}}}}}},
    {"candidates": [{"index": [], "content": {"parts": [{"text": "a"}]}}]},
])
def test_provider_fields_of_the_wrong_type_never_raise(doc):
    event = b"data: " + json.dumps(doc).encode() + b"\n\n"
    stream = EventStream(SET, "sse")
    assert stream.feed(event) == event


@pytest.mark.parametrize("terminator", [b"", b"\r", b"\n"])
def test_the_last_event_is_joined_even_unterminated(terminator):
    """Clients differ on an event the stream ends inside (NDJSON readers parse a last line
    with no newline): it completes a key like any other."""
    stream = EventStream(SET, "ndjson")
    held = json.dumps({"message": {"content": KEY[:12]}}).encode() + b"\n"
    assert stream.feed(held) == b""
    last = json.dumps({"message": {"content": KEY[12:]}}).encode() + terminator
    out = stream.feed(last) + stream.flush()
    assert KEY[:HOLD_AFTER] not in out.decode() and b"[REDACTED:anthropic]" in out
    sse = EventStream(SET, "sse")
    assert sse.feed(_anthropic("text")(KEY[:12])) == b""
    tail = _anthropic("text")(KEY[12:]).rstrip(b"\n") + terminator
    out = sse.feed(tail) + sse.flush()
    assert KEY[:HOLD_AFTER] not in out.decode() and b"[REDACTED:anthropic]" in out


def test_mcp_progress_messages_join_per_path():
    """MCP's streamable HTTP: JSON-RPC notifications as server-sent events with ids; the
    string at one path in successive messages is one text to a client that prints them."""
    def note(i: int, text: str) -> bytes:
        doc = {"jsonrpc": "2.0", "method": "notifications/message",
               "params": {"level": "info", "data": text}}
        return f"id: {i}\nevent: message\ndata: {json.dumps(doc)}\n\n".encode()
    stream = EventStream(SET, "sse")
    out = stream.feed(note(1, "token " + KEY[:9]) + note(2, KEY[9:]))
    out += stream.feed(note(3, " end")) + stream.flush()
    assert b"id: 1\nevent: message\ndata: " in out and b"id: 3\n" in out
    texts = [json.loads(d)["params"]["data"] for d in _sse_data(out)]
    assert "".join(texts) == "token [REDACTED:anthropic] end"
