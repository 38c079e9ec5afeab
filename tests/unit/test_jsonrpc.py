"""The JSON-RPC request parser (sandgate.rpc.jsonrpc): property tests and the strict refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.rpc.jsonrpc import CallError, id_key, parse

ids = st.one_of(st.integers(-(2**53), 2**53), st.text(max_size=20))
names = st.text(min_size=1, max_size=30)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10),
                    st.floats(allow_nan=False, allow_infinity=False))
args = st.dictionaries(st.text(max_size=10), scalars, max_size=5)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["tool", "method", "notification"]))
    if kind == "tool":
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": draw(ids), "method": "tools/call",
                               "params": {"name": draw(names), "arguments": draw(args)}}
    elif kind == "method":
        msg = {"jsonrpc": "2.0", "id": draw(ids),
               "method": draw(st.sampled_from(["ping", "tools/list", "initialize", "x/y"]))}
    else:
        msg = {"jsonrpc": "2.0", "method": "notifications/" + draw(names)}
    return msg


@given(requests())
def test_a_message_reads_back_as_sent(msg: dict[str, Any]) -> None:
    call = parse(json.dumps(msg).encode())
    (m,) = call.messages
    assert not call.batch
    assert m.method == msg["method"]
    assert m.id == msg.get("id")
    assert m.kind == ("request" if "id" in msg else "notification")
    if msg["method"] == "tools/call":
        assert m.tool == msg["params"]["name"] and m.arguments == msg["params"]["arguments"]
        assert m.args_sha256 is not None and m.args_bytes >= 2


@given(st.lists(requests(), min_size=1, max_size=6, unique_by=lambda m: id_key(
    m.get("id", "n"))))
def test_a_batch_keeps_its_messages_in_order(batch: list[dict[str, Any]]) -> None:
    call = parse(json.dumps(batch).encode())
    assert call.batch and [m.method for m in call.messages] == [b["method"] for b in batch]
    assert list(call.ids) == [b["id"] for b in batch if "id" in b]


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_are_refused_with_call_error(body: bytes) -> None:
    try:
        parse(body)
    except CallError:
        pass


@given(requests(), st.data())
def test_a_repeated_key_is_refused(msg: dict[str, Any], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(msg)))
    text = json.dumps(msg)
    value = json.dumps(msg[key])
    doubled = "{" + f'"{key}": {value}, ' + text[1:]
    with pytest.raises(CallError, match="repeats the key"):
        parse(doubled.encode())


@given(requests(), st.one_of(st.just("1.0"), st.just(2.0), st.none(), st.just("2.0 ")))
def test_only_version_2_0_is_accepted(msg: dict[str, Any], version: Any) -> None:
    msg["jsonrpc"] = version
    with pytest.raises(CallError, match=r"2\.0"):
        parse(json.dumps(msg).encode())


@pytest.mark.parametrize(("body", "fragment"), [
    (b'\xff{"jsonrpc":"2.0","method":"ping"}', "not UTF-8"),
    ('\ufeff{"jsonrpc":"2.0","method":"ping"}'.encode(), "byte order mark"),
    (b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}', "NaN"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a\\ud800"}}',
     "lone surrogate"),
    (b'{"jsonrpc":"2.0","id":1,"method":"ping"', "not valid JSON"),
    (b"[]", "batch is empty"),
    (b'[{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":1,"method":"ping"}]',
     "twice"),
    (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', "string or an integer"),
    (b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}', "string or an integer"),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', "string or an integer"),
    (b'{"jsonrpc":"2.0","id":1,"method":"ping","extra":1}', "does not define"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}', "params as an object"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":""}}', "non-empty"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"a","arguments":[]}}',
     "arguments must be an object"),
    (b'{"jsonrpc":"2.0","id":1,"result":{},"error":{}}', "exactly one"),
    (b'"ping"', "not a JSON object"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
])
def test_strict_refusals(body: bytes, fragment: str) -> None:
    with pytest.raises(CallError, match=fragment):
        parse(body)


def test_a_client_response_is_a_response() -> None:
    (m,) = parse(b'{"jsonrpc":"2.0","id":"s1","result":{}}').messages
    assert m.kind == "response" and m.method is None and m.id == "s1"
