"""sandgate.scrub.deltas: events cut out of a byte stream exactly, and the keys a client joins their
string values under, per provider format. No secret values here (see test_joined.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.scrub.deltas import (
    TEXT_KEY,
    ArrayFramer,
    Event,
    LineFramer,
    SseFramer,
    parse,
    stream_format,
    with_leaves,
)
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(100), deadline=None, database=None)


def _feed(framer: SseFramer | LineFramer | ArrayFramer, body: bytes, cuts: list[int]
          ) -> tuple[list[Event], bytes]:
    events: list[Event] = []
    pos = 0
    for cut in sorted(set(cuts)):
        events += framer.feed(body[pos:cut])
        pos = cut
    events += framer.feed(body[pos:])
    return events, b"".join(e.raw for e in framer.end())


def test_stream_format_by_content_type():
    assert stream_format("text/event-stream; charset=utf-8") == "sse"
    assert stream_format("application/x-ndjson") == "ndjson"
    assert stream_format("application/jsonl") == "ndjson"
    assert stream_format("application/json-seq") == "json-seq"
    assert stream_format("application/json") is None
    path = "/v1beta/models/gemini-2.0-flash:streamGenerateContent"
    assert stream_format("application/json; charset=UTF-8", path) == "json-array"
    assert stream_format("text/plain") is None


SSE = (b"event: a\ndata: {\"x\": 1}\n\n: comment\r\n\r\n"
       b"data: one\ndata: two\rid: 7\r\r"
       b"data:no-space\n\n")


@given(st.lists(st.integers(0, len(SSE)), max_size=12))
@SETTINGS
def test_sse_events_are_cut_exactly_at_blank_lines_however_chunked(cuts):
    events, rest = _feed(SseFramer(), SSE, cuts)
    assert rest == b""
    assert b"".join(e.raw for e in events) == SSE
    assert [e.payload for e in events] == [b'{"x": 1}', None, b"one\ntwo", b"no-space"]


def test_sse_byte_order_mark_is_skipped():
    (ev,) = SseFramer().feed(b"\xef\xbb\xbfdata: a\n\n")
    assert ev.payload == b"a"


def test_sse_a_trailing_cr_waits_for_its_lf():
    f = SseFramer()
    assert f.feed(b"data: a\n\r") == []  # "\r" then maybe "\n": not yet an empty line
    (ev,) = f.feed(b"\n")
    assert ev.raw == b"data: a\n\r\n"


def test_sse_rebuild_keeps_other_fields_and_terminators():
    (ev,) = SseFramer().feed(b"event: x\r\ndata: a\r\ndata: b\r\nid: 1\r\n\r\n")
    assert ev.rebuild(b"new\nlines") == b"event: x\r\ndata: new\r\ndata: lines\r\nid: 1\r\n\r\n"


def test_unfinished_event_is_returned_at_the_end_as_an_event():
    f = SseFramer()
    assert f.feed(b"data: whole\n\ndata: cut") != []
    (last,) = f.end()
    assert last.raw == b"data: cut" and last.payload == b"cut"
    f.feed(b"data: a\r\r")  # the last CR may not be followed by LF: the end settles it
    assert [e.payload for e in f.end()] == [b"a"]
    g = LineFramer("ndjson")
    assert g.feed(b'{"a":"no newline"}') == []
    (unterminated,) = g.end()
    assert unterminated.payload == b'{"a":"no newline"}'
    assert unterminated.rebuild(b"{}") == b"{}"


NDJSON = b'{"a":"x"}\n\n{"a":"y"}\r\n{"a":"z'


@given(st.lists(st.integers(0, len(NDJSON)), max_size=8))
@SETTINGS
def test_ndjson_lines_however_chunked(cuts):
    events, rest = _feed(LineFramer("ndjson"), NDJSON, cuts)
    assert b"".join(e.raw for e in events) + rest == NDJSON
    assert [e.payload for e in events] == [b'{"a":"x"}', None, b'{"a":"y"}']
    assert events[2].rebuild(b'{"a":"w"}') == b'{"a":"w"}\r\n'


def test_json_seq_records():
    (ev,) = LineFramer("json-seq").feed(b'\x1e{"a":"x"}\n')
    assert ev.payload == b'{"a":"x"}' and ev.rebuild(b"1") == b"\x1e1\n"


GEMINI = (b'[{"candidates": [{"content": {"parts": [{"text": "a]}\\" ,"}]}}]}\n'
          b',\r\n{"x": [1, {"y": "}"}]}, 7 ,"s"\n]\n')


@given(st.lists(st.integers(0, len(GEMINI)), max_size=12))
@SETTINGS
def test_json_array_elements_however_chunked(cuts):
    f = ArrayFramer()
    events, rest = _feed(f, GEMINI, cuts)
    assert not f.passthrough
    assert b"".join(e.raw for e in events) + rest == GEMINI
    assert [json.loads(e.payload or b"") for e in events] == json.loads(GEMINI)
    for e in events:
        assert e.rebuild(b"{}") == e.raw[:e.start] + b"{}" + e.raw[e.end:]


def test_json_body_that_is_no_array_passes():
    f = ArrayFramer()
    assert f.feed(b'  {"a": [1,') == [] and f.passthrough


def keys(doc: object) -> list[tuple[object, ...]]:
    parsed = parse(json.dumps(doc).encode())
    assert parsed is not None
    return [k for k, _, _ in parsed.leaves]


def test_anthropic_deltas_are_keyed_per_content_block():
    for field in ("text", "partial_json", "thinking"):
        ev = {"type": "content_block_delta", "index": 3, "delta": {"type": "x", field: "v"}}
        assert ("anthropic", 3, field) in keys(ev)
    start = {"type": "content_block_start", "index": 3,
             "content_block": {"type": "text", "text": "first"}}
    assert ("anthropic", 3, "text") in keys(start)  # joined with the deltas after it
    stop = parse(b'{"type":"content_block_stop","index":3}')
    assert stop is not None and stop.ended == [("anthropic", 3)]


def test_openai_chat_deltas_are_keyed_per_choice_and_tool_call():
    ev = {"choices": [{"index": 1, "delta": {
        "content": "a", "refusal": "b",
        "tool_calls": [{"index": 4, "function": {"arguments": "c", "name": "n"}}]}}]}
    ks = keys(ev)
    assert ("chat", 1, "content") in ks and ("chat", 1, "refusal") in ks
    assert ("chat", 1, "tool_calls", 4, "function", "arguments") in ks
    done = parse(b'{"choices":[{"index":1,"delta":{},"finish_reason":"stop"}]}')
    assert done is not None and done.ended == [("chat", 1)]


@pytest.mark.parametrize("typ", ["response.output_text.delta",
                                 "response.function_call_arguments.delta",
                                 "response.reasoning_summary_text.delta",
                                 "response.audio_transcript.delta"])
def test_openai_responses_and_realtime_deltas_are_keyed_per_item(typ):
    ev = {"type": typ, "item_id": "it", "output_index": 0, "content_index": 2, "delta": "x"}
    item = ("it", 0, 2, None)
    assert keys(ev) == [("json", "type"), ("json", "item_id"),
                        ("responses", typ.removesuffix("delta"), *item)]
    done = parse(json.dumps({**ev, "type": typ.replace(".delta", ".done")}).encode())
    assert done is not None and done.ended == [("responses", typ.removesuffix("delta"), *item)]


def test_gemini_text_parts_are_keyed_per_candidate():
    ev = {"candidates": [{"index": 0, "content": {"role": "model", "parts": [
        {"text": "a"}, {"text": "b", "thought": True}]}}]}
    assert keys(ev).count(("gemini", 0, "text")) == 2


def test_other_json_joins_by_path_and_text_as_text():
    assert keys({"params": {"delta": "x"}}) == [("json", "params", "delta")]
    text = parse(b"plain 42")
    assert text is not None and text.leaves == [(TEXT_KEY, (), "plain 42")]
    number = parse(b"2024")  # a number is a text delta too
    assert number is not None and number.leaves == [(TEXT_KEY, (), "2024")]
    done = parse(b"[DONE]")
    assert done is not None and done.leaves == [] and done.ended == [()]
    assert parse(b"\xff") is None


def test_with_leaves_reencodes_only_the_document():
    parsed = parse(b'{"a": {"b": "old"}, "c": "\\u00e9"}')
    assert parsed is not None
    assert with_leaves(parsed, {("a", "b"): "new \"q\""}) == \
        '{"a":{"b":"new \\"q\\""},"c":"é"}'.encode()
    lone = parse(b'{"t": "\\ud83d"}')  # half an emoji: escaped, still valid JSON
    assert lone is not None and json.loads(with_leaves(lone, {("t",): "\ud83d!"})) == \
        {"t": "\ud83d!"}
