"""One rule, every transport: a WebSocket on a `jsonrpc:`/`mcp:` rule, end to end.

Found on main (issue 34): a rule with `jsonrpc:` or `mcp:` judged POST bodies only; a
WebSocket upgrade to the same URL under the same rule was forwarded, and
`eth_sendRawTransaction` and `tools/call delete_repo` sent over it were executed (the audit said
`GET allow`).

A real `sandgate run` with OpenBao, a real JSON-RPC server over WebSocket (aiohttp, TLS,
tests/support/wsrpcserver.py) and real clients: aiohttp's WebSocket client, and a wsproto
client (tests/support/wsclient.py) for the frames aiohttp does not send on demand (binary,
fragmented). Without `websocket: true` the upgrade is refused (403 upgrade_refused); with it
every message is judged: a refused call never reaches the server and the client gets the
JSON-RPC error the POST path returns; a batch is judged whole; a tools/list answer is filtered;
a message that cannot be judged closes the WebSocket with 1008.

Address: 127.0.48.1 rpc.ws.test; run inside `unshare -n` like every non-Docker integration test.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import wsproto.events as ev

from tests.integration.admin_support import Admin, wait_for
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    Proxy,
)
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret
from tests.support.tunnel import h1_in_tunnel, proxy_auth, split_response
from tests.support.wsclient import WsprotoClient
from tests.support.wsrpcserver import WsRpcServer

pytestmark = pytest.mark.integration

IP, HOST = "127.0.48.1", "rpc.ws.test"

RULE = f"hosts: [{HOST}], private_cidrs: [{IP}/32], " \
    "inject: {headers: {x-api-key: '{{ secrets.anthropic }}'}}"
CHAIN = "jsonrpc: {methods: ['eth_*'], deny_methods: [eth_sendRawTransaction]}"
MCP = "mcp: {tools: [list_issues, 'get_*'], deny_tools: [delete_repo]}"

POLICY = f"""
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
identities:
  agent:
    rules:
      - {{name: chain-post-only, paths: [/closed], {RULE}, {CHAIN}}}
      - {{name: mcp-post-only, paths: [/mcp-closed], {RULE}, {MCP}}}
      - {{name: chain, paths: [/rpc], websocket: true, {RULE}, {CHAIN}}}
      - {{name: mcp, paths: [/mcp], websocket: true, {RULE}, {MCP}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, proxy_stack) -> Iterator[tuple[Proxy,
                                                                                   WsRpcServer,
                                                                                   Admin]]:
    tmp = tmp_path_factory.mktemp("wsrpc")
    pki = make_pki(tmp / "pki", [HOST])
    server = WsRpcServer(IP, 443, str(pki.cert), str(pki.key)).start()
    running = proxy_stack("wsrpc-proxy", pki, policy={"wsrpc.yaml": POLICY}, resolve={HOST: IP},
                          admin=True)
    try:
        yield running.proxy, server, running.admin
    finally:
        try:
            running.stop()  # and no secret in its log or audit
        finally:
            server.stop()


def _rpc(i: int | None, method: str, params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if i is not None:
        msg["id"] = i
    if params is not None:
        msg["params"] = params
    return msg


async def _exchange(proxy: Proxy, path: str, sends: list[Any], answers: int) -> list[Any]:
    """Open a WebSocket to `path` through Sandgate (aiohttp), send each message as one text
    frame, and read `answers` messages back (parsed JSON). Bounded: 20 s in all."""
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    got: list[Any] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        auth = {"Proxy-Authorization": proxy_auth("agent", proxy.token("agent"))}
        async with session.ws_connect(f"wss://{HOST}{path}", proxy=proxy.url, ssl=ctx,
                                      proxy_headers=auth) as ws:
            for msg in sends:
                await ws.send_str(json.dumps(msg))
            while len(got) < answers:
                frame = await ws.receive(timeout=10)
                assert frame.type == aiohttp.WSMsgType.TEXT, (frame.type, got)
                got.append(json.loads(frame.data))
    return got


def exchange(proxy: Proxy, path: str, sends: list[Any], answers: int) -> list[Any]:
    return asyncio.run(_exchange(proxy, path, sends, answers))


def _ws_events(proxy: Proxy, path: str) -> list[dict[str, Any]]:
    return [e for e in proxy.audit() if e.get("event") == "websocket"
            and (e.get("path") or "").startswith(path)]


# ---------------------------------------------------------------- the upgrade


@pytest.mark.parametrize("path", ["/closed", "/mcp-closed"])
def test_websocket_on_a_call_rule_without_opt_in_is_refused_readably(stack, path: str) -> None:
    proxy, server, _ = stack
    before = len(server.upgrades)
    raw = h1_in_tunnel(proxy, "agent", proxy.token("agent"), f"{HOST}:443", (
        f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    ).encode(), timeout=5)
    status, headers, body = split_response(raw)
    assert b" 403 " in status, raw[:300]
    assert headers["x-sandgate-reason"] == "upgrade_refused"
    doc = json.loads(body)
    assert doc["code"] == "upgrade_refused"
    assert "websocket: true" in doc["hint"]
    assert len(server.upgrades) == before  # nothing reached the server
    event = proxy.wait_audit(lambda e: e.get("event") == "request" and e.get("path") == path
                             and e.get("code") == "upgrade_refused")
    assert event["decision"] == "deny"


def test_the_handshake_is_bound_to_the_mcp_session_as_a_post_is(stack) -> None:
    proxy, server, _ = stack
    before = len(server.upgrades)
    raw = h1_in_tunnel(proxy, "agent", proxy.token("agent"), f"{HOST}:443", (
        f"GET /mcp HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Mcp-Session-Id: sgs1.c2Vzc2lvbi1vZi1hbm90aGVy.AAAAAAAAAAAAAAAAAAAAAA\r\n\r\n"
    ).encode(), timeout=5)
    status, headers, _ = split_response(raw)
    assert b" 403 " in status and headers["x-sandgate-reason"] == "session_mismatch", raw[:300]
    assert len(server.upgrades) == before


def test_other_upgrades_are_refused_even_with_websocket_true(stack) -> None:
    proxy, server, _ = stack
    before = len(server.upgrades)
    raw = h1_in_tunnel(proxy, "agent", proxy.token("agent"), f"{HOST}:443", (
        f"GET /rpc HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n").encode(), timeout=5)
    status, headers, _ = split_response(raw)
    assert b" 403 " in status and headers["x-sandgate-reason"] == "upgrade_refused", raw[:300]
    assert len(server.upgrades) == before


# ---------------------------------------------------------------- JSON-RPC messages


def test_allowed_calls_go_through_and_a_denied_one_never_reaches_the_server(stack) -> None:
    proxy, server, _ = stack
    got = exchange(proxy, "/rpc", [
        _rpc(1, "eth_blockNumber"),
        _rpc(2, "eth_sendRawTransaction", ["0xf86c0a8502540be400"]),
        _rpc(None, "eth_sendRawTransaction", ["0xf86c0a8502540be401"]),  # no id: no answer
        _rpc(3, "net_version"),  # `methods` does not list it
        _rpc(4, "eth_chainId"),  # the WebSocket still works after refusals
    ], answers=4)
    by_id = {m["id"]: m for m in got}
    assert by_id[1]["result"] == "0x10" and by_id[4]["result"] == "0x10"
    denied = by_id[2]["error"]
    assert denied["code"] == -32003
    assert denied["data"]["sandgate"]["code"] == "denied_by_rule"
    assert "eth_sendRawTransaction" in denied["message"]
    assert by_id[3]["error"]["data"]["sandgate"]["code"] == "no_rule"
    assert "eth_sendRawTransaction" not in server.methods
    assert "net_version" not in server.methods
    # the upgrade carried the rule's credential, as a POST would
    assert server.upgrades[-1][1]["x-api-key"] == ANTHROPIC_KEY
    # each judged message is audited like a POST call, naming its method
    wait_for(lambda: len(_ws_events(proxy, "/rpc")) >= 5, 5, "five websocket audit events")
    rpc = [(c["method"], c["decision"], e["decision"], e.get("code"))
           for e in _ws_events(proxy, "/rpc") for c in e["rpc"]]
    assert ("eth_blockNumber", "allow", "allow", None) in rpc
    assert ("eth_sendRawTransaction", "deny", "deny", "denied_by_rule") in rpc
    assert ("net_version", "deny", "deny", "no_rule") in rpc
    assert sum(1 for r in rpc if r[0] == "eth_sendRawTransaction") == 2


def test_messages_are_counted_and_explained_by_the_admin_api(stack) -> None:
    proxy, _, admin = stack
    key = ("sandgate_rpc_calls_total", (("decision", "deny"), ("identity", "agent"),
                                        ("method", "eth_sendRawTransaction"), ("tool", "none")))
    before = wait_for(lambda: admin.metrics() or None, 10, "metrics").get(key, 0)
    got = exchange(proxy, "/rpc", [_rpc(30, "eth_sendRawTransaction", ["0x02"])], answers=1)
    assert got[0]["error"]["data"]["sandgate"]["code"] == "denied_by_rule"
    wait_for(lambda: admin.metrics().get(key, 0) == before + 1, 10, "the message counted")
    for path, body, code in [
        ("/closed", {}, "upgrade_refused"),
        ("/rpc", {"rpc_method": "eth_sendRawTransaction"}, "denied_by_rule"),
        ("/rpc", {"rpc_method": "eth_chainId"}, None),
    ]:
        status, doc = admin.post("/v1/explain", {"identity": "agent", "method": "GET",
                                                 "url": f"https://{HOST}{path}",
                                                 "websocket": True, **body})
        assert status == 200 and doc["code"] == code, doc
        assert doc["request"].endswith("(opening a WebSocket)")
    status, doc = admin.post("/v1/explain", {"identity": "agent", "method": "GET",
                                             "url": f"https://{HOST}/rpc", "websocket": "yes"})
    assert status == 400 and doc["error"] == "bad_request"


def test_a_batch_is_judged_whole(stack) -> None:
    proxy, server, _ = stack
    before = list(server.methods)
    got = exchange(proxy, "/rpc", [
        [_rpc(10, "eth_blockNumber"), _rpc(11, "eth_sendRawTransaction", ["0x01"])],
        [_rpc(12, "eth_blockNumber"), _rpc(13, "eth_chainId")],
    ], answers=2)
    refused, allowed = got
    assert [m["id"] for m in refused] == [10, 11]
    assert all(m["error"]["data"]["sandgate"]["code"] == "denied_by_rule" for m in refused)
    assert [m["result"] for m in allowed] == ["0x10", "0x10"]
    assert server.methods[len(before):] == ["eth_blockNumber", "eth_chainId"]
    event = proxy.wait_audit(lambda e: e.get("event") == "websocket" and any(
        c.get("id") == 11 for c in e.get("rpc") or ()))
    assert [c["decision"] for c in event["rpc"]] == ["batch", "deny"]


def test_server_notifications_pass(stack) -> None:
    proxy, _, _ = stack
    got = exchange(proxy, "/rpc", [_rpc(20, "eth_subscribe", ["newHeads"])], answers=2)
    assert got[0] == {"jsonrpc": "2.0", "id": 20, "result": "0x1"}
    assert got[1]["method"] == "eth_subscription"


# ---------------------------------------------------------------- MCP


def test_mcp_over_websocket_lists_filtered_tools_and_refuses_a_denied_tool(stack) -> None:
    proxy, server, _ = stack
    got = exchange(proxy, "/mcp", [
        _rpc(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                               "clientInfo": {"name": "t", "version": "1"}}),
        _rpc(None, "notifications/initialized"),
        _rpc(2, "tools/list"),
        _rpc(3, "tools/call", {"name": "delete_repo", "arguments": {"repo": "acme/app"}}),
        _rpc(4, "tools/call", {"name": "get_me", "arguments": {}}),
    ], answers=4)
    by_id = {m["id"]: m for m in got}
    assert [t["name"] for t in by_id[2]["result"]["tools"]] == ["get_issue", "get_me",
                                                                "list_issues"]
    assert by_id[3]["error"]["data"]["sandgate"]["code"] == "denied_by_rule"
    assert "tool delete_repo" in by_id[3]["error"]["message"]
    text = by_id[4]["result"]["content"][0]["text"]
    assert "REDACTED" in text  # the key the server reflects is scrubbed, as in a POST answer
    assert_no_secret([json.dumps(got)], [ANTHROPIC_KEY], "the WebSocket's answers")
    assert "delete_repo" not in json.dumps([f for f in server.frames if isinstance(f, str)])
    event = proxy.wait_audit(lambda e: e.get("event") == "websocket" and any(
        c.get("tool") == "delete_repo" for c in e.get("rpc") or ()))
    assert event["decision"] == "deny" and event["code"] == "denied_by_rule"


# ---------------------------------------------------------------- what cannot be judged


def _judged_client(proxy: Proxy) -> WsprotoClient:
    return WsprotoClient(proxy, "agent", HOST, "/rpc")


# what the client sends -> what the audit's reason says
UNJUDGEABLE = {
    "binary": ([ev.BytesMessage(data=json.dumps(_rpc(1, "eth_sendRawTransaction")).encode())],
               "binary WebSocket frame"),
    "fragmented": ([ev.TextMessage(data='{"jsonrpc": "2.0", "id": 1, ', message_finished=False),
                    ev.TextMessage(data='"method": "eth_blockNumber"}')], "several frames"),
    "not json": ([ev.TextMessage(data="eth_sendRawTransaction 0x01")], "not valid JSON"),
}


@pytest.mark.parametrize("kind", sorted(UNJUDGEABLE))
def test_what_cannot_be_judged_closes_the_websocket_with_1008(stack, kind: str) -> None:
    proxy, server, _ = stack
    client = _judged_client(proxy)
    before = len(server.frames)
    try:
        frames, why = UNJUDGEABLE[kind]
        for frame in frames:
            client.send(frame)
        got = client.receive(until=lambda e: isinstance(e, ev.CloseConnection), timeout=10)
    finally:
        client.close()
    closes = [e for e in got if isinstance(e, ev.CloseConnection)]
    assert closes and closes[0].code == 1008, got
    assert server.frames[before:] == []  # nothing of it reached the server
    event = proxy.wait_audit(lambda e: e.get("event") == "websocket"
                             and e.get("code") == "bad_request" and why in e.get("reason", ""))
    assert event["decision"] == "deny"
