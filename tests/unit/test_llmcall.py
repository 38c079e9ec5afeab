"""sandgate.llm.llmcall: which API a request calls, what it asks for, what its answer spent."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.llm.llmcall import (
    CallUnreadable,
    Usage,
    UsageReader,
    read_call,
    recognise,
    with_max_tokens,
    with_usage_chunk,
)

counts = st.integers(min_value=0, max_value=10**7)
models = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1,
                 max_size=30)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


def run(reader: UsageReader, chunks: list[bytes]) -> bytes:
    return b"".join(reader.feed(c) for c in chunks) + reader.end()


def sse(*docs: object, names: tuple[str, ...] = ()) -> bytes:
    out = b""
    for i, d in enumerate(docs):
        ev = f"event: {names[i]}\n" if i < len(names) else ""
        out += f"{ev}data: {json.dumps(d)}\n\n".encode()
    return out


@pytest.mark.parametrize("method,host,path,declared,api", [
    ("POST", "api.anthropic.com", "/v1/messages", None, "anthropic"),
    ("POST", "api.anthropic.com", "/v1/messages/count_tokens", None, None),
    ("GET", "api.anthropic.com", "/v1/messages", None, None),
    ("POST", "api.openai.com", "/v1/chat/completions", None, "openai-chat"),
    ("POST", "api.openai.com", "/v1/responses", None, "openai-responses"),
    ("POST", "api.openai.com", "/v1/files", None, None),
    ("POST", "generativelanguage.googleapis.com",
     "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", None, "gemini"),
    ("POST", "llm.internal", "/v1/chat/completions", None, None),  # unknown host, undeclared
    ("POST", "llm.internal", "/openai/v1/chat/completions", "openai", "openai-chat"),
    ("POST", "API.ANTHROPIC.COM.", "/v1/messages", None, "anthropic"),
])
def test_recognise(method, host, path, declared, api):
    assert recognise(method, host, path, declared) == api


@given(model=models, cap=st.one_of(st.none(), counts), stream=st.booleans())
def test_read_call_reads_what_the_body_says(model, cap, stream):
    for api, key in (("anthropic", "max_tokens"), ("openai-chat", "max_completion_tokens"),
                     ("openai-responses", "max_output_tokens")):
        doc: dict[str, object] = {"model": model, "stream": stream, "messages": []}
        if cap is not None:
            doc[key] = cap
        c = read_call(api, "/v1/x", json.dumps(doc).encode())  # type: ignore[arg-type]
        assert (c.model, c.max_tokens, c.stream) == (model, cap, stream)


@given(a=counts, b=counts)
def test_two_spellings_of_the_cap_count_as_the_larger(a, b):
    body = json.dumps({"model": "m", "max_tokens": a, "max_completion_tokens": b}).encode()
    assert read_call("openai-chat", "/v1/chat/completions", body).max_tokens == max(a, b)


def test_gemini_model_and_stream_come_from_the_path():
    body = json.dumps({"contents": [], "generationConfig": {"maxOutputTokens": 77}}).encode()
    c = read_call("gemini", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", body)
    assert (c.model, c.max_tokens, c.stream) == ("gemini-2.5-pro", 77, True)
    c = read_call("gemini", "/v1beta/models/gemini-2.5-pro:generateContent", b"{}")
    assert (c.model, c.max_tokens, c.stream) == ("gemini-2.5-pro", None, False)


@pytest.mark.parametrize("body,why", [
    (b'{"model": "a", "model": "b"}', "given twice"),
    (b'{"model": "a", "max_tokens": 5, "max_tokens": 999999}', "given twice"),
    (b'["model"]', "not a JSON object"),
    (b"model=a", "not JSON"),
    (b'{"model": 5}', "model is not a string"),
    (b'{"model": "a", "max_tokens": 1.5}', "not a whole number"),
    (b'{"model": "a", "max_tokens": true}', "not a whole number"),
    (b'{"model": "a", "max_tokens": "10"}', "not a whole number"),
    (b'{"model": "a", "stream": "yes"}', "stream"),
])
def test_unreadable_bodies_are_refused_not_guessed(body, why):
    with pytest.raises(CallUnreadable, match=why):
        read_call("anthropic", "/v1/messages", body)


@given(cap=st.integers(min_value=1, max_value=10**6), had=st.one_of(st.none(), counts))
def test_lowering_sets_every_spelling(cap, had):
    for api, path in (("anthropic", "/v1/messages"), ("openai-chat", "/v1/chat/completions"),
                      ("openai-responses", "/v1/responses"),
                      ("gemini", "/v1beta/models/g:generateContent")):
        doc: dict[str, object] = {"model": "m"}
        if had is not None:
            if api == "openai-chat":
                doc["max_tokens"] = had
                doc["max_completion_tokens"] = had
            elif api == "gemini":
                doc["generationConfig"] = {"maxOutputTokens": had, "temperature": 0}
            else:
                doc["max_tokens" if api == "anthropic" else "max_output_tokens"] = had
        out = with_max_tokens(api, json.dumps(doc).encode(), cap)  # type: ignore[arg-type]
        assert read_call(api, path, out).max_tokens == cap  # type: ignore[arg-type]


def test_usage_chunk_asked_for_keeps_other_options():
    out = json.loads(with_usage_chunk(b'{"model":"m","stream":true,'
                                      b'"stream_options":{"x":1}}'))
    assert out["stream_options"] == {"x": 1, "include_usage": True}


# --- usage ---------------------------------------------------------------------------------

@given(inp=counts, cached=counts, created=counts, out1=counts, out2=counts,
       cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_anthropic_stream_usage_whatever_the_chunking(inp, cached, created, out1, out2, cuts):
    body = sse(
        {"type": "message_start", "message": {"id": "m", "usage": {
            "input_tokens": inp, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": created, "output_tokens": out1}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                              "text": "hi"}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": out2}},
        {"type": "message_stop"},
        names=("message_start", "content_block_delta", "message_delta", "message_stop"))
    reader = UsageReader("anthropic", "text/event-stream", "/v1/messages")
    assert run(reader, split(body, cuts)) == body  # passed on unchanged
    assert reader.usage == Usage(inp + cached + created, max(out1, out2), cached)


@given(prompt=counts, completion=counts, cached=counts, reasoning=counts,
       cuts=st.lists(st.integers(min_value=0), max_size=12), crlf=st.booleans())
def test_openai_usage_chunk_read_and_taken_out(prompt, completion, cached, reasoning, cuts,
                                               crlf):
    chunks = [{"id": "c", "choices": [{"index": 0, "delta": {"content": "hel"}}]},
              {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    usage = {"id": "c", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning}}}
    nl = "\r\n" if crlf else "\n"
    seen = "".join(f"data: {json.dumps(c)}{nl}{nl}" for c in chunks).encode()
    done = f"data: [DONE]{nl}{nl}".encode()
    body = seen + f"data: {json.dumps(usage)}{nl}{nl}".encode() + done
    reader = UsageReader("openai-chat", "text/event-stream; charset=utf-8",
                         "/v1/chat/completions", drop_usage_chunk=True)
    assert run(reader, split(body, cuts)) == seen + done  # what the client would have seen
    assert reader.usage == Usage(prompt, completion, cached, reasoning)
    assert reader.dropped == 1
    kept = UsageReader("openai-chat", "text/event-stream", "/v1/chat/completions")
    assert run(kept, split(body, cuts)) == body  # asked for by the client: kept
    assert kept.usage == Usage(prompt, completion, cached, reasoning)


@given(totals=st.lists(st.tuples(counts, counts, counts), min_size=1, max_size=5),
       cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_gemini_json_array_stream_last_usage_counts(totals, cuts):
    docs = [{"candidates": [{"content": {"parts": [{"text": "x"}]}}],
             "usageMetadata": {"promptTokenCount": p, "candidatesTokenCount": c,
                               "thoughtsTokenCount": t}} for p, c, t in totals]
    body = json.dumps(docs, indent=1).encode()
    path = "/v1beta/models/gemini-2.5-flash:streamGenerateContent"
    reader = UsageReader("gemini", "application/json", path)
    assert run(reader, split(body, cuts)) == body
    p, c, t = totals[-1]
    assert reader.usage == Usage(p, c + t, 0, t)


def test_json_answers():
    r = UsageReader("openai-responses", "application/json", "/v1/responses")
    body = json.dumps({"object": "response", "usage": {
        "input_tokens": 10, "output_tokens": 20, "input_tokens_details": {"cached_tokens": 4},
        "output_tokens_details": {"reasoning_tokens": 7}}}).encode()
    assert run(r, [body[:5], body[5:]]) == body
    assert r.usage == Usage(10, 20, 4, 7)
    r = UsageReader("openai-responses", "text/event-stream", "/v1/responses")
    run(r, [sse({"type": "response.created", "response": {"usage": None}},
                {"type": "response.completed", "response": {"usage": {
                    "input_tokens": 3, "output_tokens": 5}}})])
    assert r.usage == Usage(3, 5)
    r = UsageReader("anthropic", "application/json", "/v1/messages")
    run(r, [b'{"type": "error", "error": {}}'])
    assert r.usage is None
    r = UsageReader("anthropic", "application/json", "/v1/messages")
    run(r, [b'not json'])
    assert r.usage is None


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=8))
def test_never_raises_and_never_changes_what_it_does_not_drop(data, cuts):
    for api in ("anthropic", "openai-chat", "openai-responses", "gemini"):
        for ctype in ("text/event-stream", "application/json", "application/x-ndjson"):
            r = UsageReader(api, ctype, "/x:streamGenerateContent")  # type: ignore[arg-type]
            assert run(r, split(data, cuts)) == data


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)


def _as_json_loads_reads(body: bytes) -> object:
    """What read_call saw before its decoder was reused: json.loads with the pairs hook."""
    from sandgate.llm.llmcall import _no_duplicates

    try:
        doc = json.loads(body, object_pairs_hook=_no_duplicates)
    except CallUnreadable as e:
        return ("unreadable", str(e))
    except (ValueError, RecursionError):
        return ("unreadable", "the body is not JSON")
    return doc if isinstance(doc, dict) else ("unreadable", "the body is not a JSON object")


@given(doc=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
       encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-16",
                                 "utf-32-le", "utf-32-be", "utf-32"]),
       dup=st.booleans(), junk=st.binary(max_size=4))
def test_a_body_reads_as_json_loads_reads_it(doc, encoding, dup, junk):
    """The call's body is read by one reused decoder exactly as json.loads (with the
    duplicate-key check) reads bytes: the same document, or the same refusal, whatever its
    encoding (a BOM, UTF-16/32) or trailing bytes."""
    from sandgate.llm.llmcall import _document

    text = json.dumps(doc, ensure_ascii=False)
    if dup and doc:
        text = text[:-1] + ", " + json.dumps(next(iter(doc))) + ": 1}"  # a key given twice
    for body in (text.encode(encoding, "surrogatepass"), text.encode("utf-8") + junk):
        try:
            got: object = _document(body)
        except CallUnreadable as e:
            got = ("unreadable", str(e))
        assert got == _as_json_loads_reads(body)
