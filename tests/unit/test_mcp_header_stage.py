"""The call stage answering MCP metadata headers that disagree with the body (issue 34): `400`
with a JSON-RPC HeaderMismatch error (-32020) for each id, audited as `header_mismatch`, never
forwarded. Uses only what the stage had before the check existed, so it runs against the old
code too (where these requests went through). The check itself: tests/unit/test_mcpheaders.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from sandgate.audit import events as audit
from sandgate.decision import decide
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.policy.loader import load_policy_dir
from sandgate.request import RequestInfo
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.stages import context, s35_call
from sandgate.stages.flow import FlowRecord

MODERN = "2026-07-28"
HEADER_MISMATCH = -32020  # MCP's HeaderMismatch


def body(method: str, i: int | None = 1, version: str | None = None, **params: Any
         ) -> dict[str, Any]:
    p: dict[str, Any] = dict(params)
    if version is not None:
        p["_meta"] = {"io.modelcontextprotocol/protocolVersion": version,
                      "io.modelcontextprotocol/clientCapabilities": {}}
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if i is not None:
        msg["id"] = i
    if p:
        msg["params"] = p
    return msg


POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: gh, hosts: [mcp.example], methods: [POST, GET], schemes: [http],
         mcp: {tools: [get_me, delete_repo]}}
"""
INFO = RequestInfo("http", "mcp.example", 80, "POST", "/mcp")


@pytest.fixture
def state(tmp_path: Path) -> context.GateState:
    d = tmp_path / "pol"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(d)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    return context.GateState(context.GateConfig(
        policy=policy, broker=broker, identifier=Identifier(b"k" * 32),
        audit=audit.AuditLog(tmp_path / "audit.jsonl"), max_request_body=100_000))


async def judge(state: context.GateState, msg: Any, headers: dict[str, str],
                method: bytes = b"POST") -> tuple[FlowRecord, http.HTTPFlow]:
    content = json.dumps(msg).encode() if msg is not None else b""
    f = tflow.tflow(req=tflow.treq(method=method, host="mcp.example", port=80, path=b"/mcp",
                                   content=content))
    f.request.headers.clear()
    f.request.headers["content-type"] = "application/json"
    for k, v in headers.items():
        f.request.headers.add(k, v)
    rec = context.record(f)
    policy = state.flow_policy(rec)
    rec.caller, rec.info, rec.policy = Caller("agent", None, "token"), INFO, policy
    rec.decision = decide(policy, "agent", INFO)
    await s35_call.judge(state, f, rec)
    return rec, f


async def test_mcp_name_naming_another_tool_than_the_body_is_refused(state) -> None:
    """The found item: the body calls delete_repo, the header says get_me (a server or gateway
    routing on the header would act on one, Sandgate judged the other). Both tools are allowed
    here, so only the disagreement refuses it; on main it went through."""
    msg = body("tools/call", 7, name="delete_repo", arguments={})
    rec, f = await judge(state, msg, {"Mcp-Method": "tools/call", "Mcp-Name": "get_me"})
    assert rec.refused and f.response is not None
    assert f.response.status_code == 400
    assert f.response.headers["x-sandgate-reason"] == "header_mismatch"
    doc = json.loads(f.response.content or b"")
    assert doc["id"] == 7 and doc["error"]["code"] == HEADER_MISMATCH
    assert "Mcp-Name 'get_me' does not match" in doc["error"]["message"]
    sandgate = doc["error"]["data"]["sandgate"]
    assert sandgate["code"] == "header_mismatch" and "Mcp-Method" in sandgate["hint"]
    assert rec.refusal is not None and rec.refusal.code == "header_mismatch"
    assert rec.call is not None and rec.call.fields()["rpc"][0]["decision"] == "deny"


async def test_mcp_method_disagreeing_with_the_body_is_refused(state) -> None:
    rec, f = await judge(state, body("tools/list", 3), {"Mcp-Method": "ping"})
    assert rec.refused and f.response is not None and f.response.status_code == 400
    assert json.loads(f.response.content or b"")["id"] == 3


async def test_a_mismatch_without_an_id_is_answered_with_a_null_id(state) -> None:
    rec, f = await judge(state, body("notifications/initialized", None),
                         {"Mcp-Method": "notifications/cancelled"})
    assert rec.refused and f.response is not None and f.response.status_code == 400
    assert json.loads(f.response.content or b"")["id"] is None
    rec, f = await judge(state, None, {"Mcp-Method": "tools/call"}, method=b"GET")
    assert rec.refused and f.response is not None and f.response.status_code == 400


async def test_a_batch_is_answered_for_every_id(state) -> None:
    msgs = [body("tools/call", 1, name="get_me"), body("tools/call", 2, name="delete_repo")]
    rec, f = await judge(state, msgs, {"Mcp-Method": "tools/call", "Mcp-Name": "get_me"})
    assert rec.refused and f.response is not None and f.response.status_code == 400
    assert [e["id"] for e in json.loads(f.response.content or b"")] == [1, 2]


async def test_agreeing_headers_go_on_to_the_policy(state) -> None:
    rec, f = await judge(state, body("tools/call", 1, version=MODERN, name="get_me"),
                         {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call",
                          "Mcp-Name": "get_me"})
    assert not rec.refused and f.response is None
    rec, f = await judge(state, body("tools/call", 1, name="search_code"),
                         {"Mcp-Method": "tools/call", "Mcp-Name": "search_code"})
    assert rec.refused and f.response is not None and f.response.status_code == 200
    assert json.loads(f.response.content or b"")["error"]["code"] == -32003  # the policy's
