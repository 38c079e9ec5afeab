"""MCP's Mcp-Method / Mcp-Name / MCP-Protocol-Version against the body (sandgate.rpc.mcpheaders).
The call stage answering a disagreement: tests/unit/test_mcp_header_stage.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sandgate.rpc.jsonrpc import VERSION_META, Call, parse
from sandgate.rpc.mcpheaders import HeaderMismatch, check, decode_name

MODERN = "2026-07-28"


def body(method: str, i: int | None = 1, version: str | None = None, **params: Any
         ) -> dict[str, Any]:
    p: dict[str, Any] = dict(params)
    if version is not None:
        p["_meta"] = {VERSION_META: version, "io.modelcontextprotocol/clientCapabilities": {}}
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if i is not None:
        msg["id"] = i
    if p:
        msg["params"] = p
    return msg


def call(*msgs: dict[str, Any]) -> Call:
    return parse(json.dumps(msgs[0] if len(msgs) == 1 else list(msgs)).encode())


def lookup(headers: dict[str, str | list[str]]) -> Any:
    folded = {k.lower(): ([v] if isinstance(v, str) else v) for k, v in headers.items()}
    return lambda name: folded.get(name, [])


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


def header_form(name: str) -> str:
    """What a conforming client sends for a name (the spec's Value Encoding)."""
    plain = all(0x20 <= ord(c) <= 0x7E for c in name) and name == name.strip()
    return name if plain and not (name.startswith("=?base64?") and name.endswith("?=")) \
        else b64(name)


TOOL = body("tools/call", name="get_me", arguments={})
MODERN_TOOL = body("tools/call", version=MODERN, name="get_me", arguments={})


@pytest.mark.parametrize(("headers", "msgs"), [
    ({}, [TOOL]),  # a 2025 client sends none of them
    ({"Mcp-Method": "tools/call", "Mcp-Name": "get_me"}, [TOOL]),
    ({"MCP-Protocol-Version": "2025-06-18"}, [TOOL]),
    ({"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "get_me"},
     [MODERN_TOOL]),
    ({"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/list"},
     [body("tools/list", version=MODERN, cursor="c2")]),
    ({"Mcp-Method": "tools/call", "Mcp-Name": b64("get_me")}, [TOOL]),  # the base64 form
    ({"mcp-method": "resources/read", "MCP-NAME": "file:///a b"},  # names are case-blind
     [body("resources/read", uri="file:///a b")]),
    ({"Mcp-Method": "resources/subscribe", "Mcp-Name": "file:///x"},
     [body("resources/subscribe", uri="file:///x")]),
    ({"Mcp-Method": "tools/call"}, [TOOL, body("tools/call", 2, name="list_issues")]),
    ({"MCP-Protocol-Version": MODERN}, [body("notifications/initialized", None)]),
    ({"MCP-Protocol-Version": "2025-11-25"}, []),  # the GET stream, the DELETE
    ({"MCP-Protocol-Version": MODERN, "Mcp-Method": "resources/subscribe"},  # not required
     [body("resources/subscribe", version=MODERN, uri="file:///x")]),
], ids=["none", "2025-with-headers", "version-only", "modern-call", "modern-list-page",
        "base64-name", "case-blind-names", "subscribe", "batch-all-agree",
        "modern-notification", "no-body", "modern-subscribe-without-name"])
def test_headers_that_agree_with_the_body_pass(headers: dict[str, str],
                                               msgs: list[dict[str, Any]]) -> None:
    check(lookup(headers), call(*msgs) if msgs else None)


@pytest.mark.parametrize(("headers", "msgs", "says"), [
    ({"Mcp-Method": "tools/list"}, [TOOL], "does not match the body's method 'tools/call'"),
    ({"Mcp-Method": "tools/call", "Mcp-Name": "list_issues"}, [TOOL],
     "Mcp-Name 'list_issues' does not match the params.name of the body's tools/call"),
    ({"Mcp-Name": "get_me"}, [body("tools/list")], "names nothing"),
    ({"Mcp-Name": "get_me"}, [{"jsonrpc": "2.0", "id": 4, "result": {}}], "names nothing"),
    ({"Mcp-Method": "tools/call"}, [], "carries no JSON-RPC message"),
    ({"Mcp-Method": ["tools/call", "tools/call"]}, [TOOL], "given 2 times"),
    ({"Mcp-Name": ["get_me", "delete_repo"]}, [TOOL], "given 2 times"),
    ({"MCP-Protocol-Version": ["2025-06-18", "2025-06-18"]}, [TOOL], "given 2 times"),
    ({"MCP-Protocol-Version": "2099-01-01"}, [TOOL], "not a protocol revision Sandgate knows"),
    ({"MCP-Protocol-Version": "2025-06-18", "Mcp-Method": "tools/call", "Mcp-Name": "get_me"},
     [MODERN_TOOL], "does not match the body's io.modelcontextprotocol/protocolVersion"),
    ({"Mcp-Method": "tools/call", "Mcp-Name": "get_me"}, [MODERN_TOOL],
     "has no MCP-Protocol-Version header"),
    ({"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "get_me"},
     [TOOL], "needs io.modelcontextprotocol/protocolVersion in params._meta"),
    ({"MCP-Protocol-Version": MODERN, "Mcp-Name": "get_me"}, [MODERN_TOOL],
     "requires the Mcp-Method header"),
    ({"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call"}, [MODERN_TOOL],
     "requires the Mcp-Name header on tools/call"),
    ({"Mcp-Method": "tools/call"}, [TOOL, body("tools/list", 2)],
     "does not match the body's method 'tools/list'"),
    ({"Mcp-Method": "tools/call", "Mcp-Name": "get_me"},
     [TOOL, body("tools/call", 2, name="delete_repo")], "'delete_repo'"),
    # "get_m" is Z2V0X20=; Z2V0X21= decodes to it too (unused low bits), but is not canonical
    ({"Mcp-Name": "=?base64?Z2V0X21=?="}, [body("tools/call", name="get_m")], "not canonical"),
    ({"Mcp-Name": "=?base64?!!!?="}, [TOOL], "not base64"),
    ({"Mcp-Name": "=?base64?/w==?="}, [TOOL], "not UTF-8"),
    ({"Mcp-Name": "g\u00e9t_me"}, [TOOL], "cannot carry plain"),
], ids=["method", "name", "name-on-list", "name-on-response", "method-no-body",
        "method-twice", "name-twice", "version-twice", "unknown-version", "version-vs-meta",
        "meta-without-header", "modern-without-meta", "modern-no-method", "modern-no-name",
        "batch-method", "batch-name", "b64-noncanonical", "b64-junk", "b64-not-utf8",
        "plain-non-ascii"])
def test_headers_that_disagree_are_refused(headers: dict[str, str | list[str]],
                                           msgs: list[dict[str, Any]], says: str) -> None:
    with pytest.raises(HeaderMismatch) as ei:
        check(lookup(headers), call(*msgs) if msgs else None)
    assert says in str(ei.value)


def test_the_version_of_the_session_must_be_the_one_sent() -> None:
    headers = lookup({"MCP-Protocol-Version": "2025-06-18"})
    assert check(headers, call(TOOL), session_version="2025-06-18") == "2025-06-18"
    with pytest.raises(HeaderMismatch, match="negotiated for this session"):
        check(headers, call(TOOL), session_version="2025-11-25")
    check(lookup({}), call(TOOL), session_version="2025-11-25")  # no header: nothing to agree


names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


@given(names)
def test_any_name_sent_as_the_spec_encodes_it_agrees(name: str) -> None:
    c = call(body("tools/call", name=name))
    assert decode_name(header_form(name)) == name
    check(lookup({"Mcp-Method": "tools/call", "Mcp-Name": header_form(name)}), c)


@given(names, names)
def test_a_header_naming_another_tool_is_always_refused(name: str, other: str) -> None:
    assume(name != other)
    c = call(body("tools/call", name=name))
    with pytest.raises(HeaderMismatch):
        check(lookup({"Mcp-Method": "tools/call", "Mcp-Name": header_form(other)}), c)
