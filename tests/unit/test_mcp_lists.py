"""List answers through the call stage, in both MCP revisions (issue 34): every page filtered
(the request that carries a cursor is a list call like the first), resource templates and
server/discover filtered too, and a filtered result never marked cacheable beyond its caller
(`cacheScope`). The request is judged by the stage and its answer filtered as the response side
does (sandgate.stages.rpccalls.filter_whole); SSE chunking: tests/unit/test_mcp_stage.py."""

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
from sandgate.stages.rpccalls import filter_whole

MODERN = "2026-07-28"
POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: m, hosts: [mcp.example], methods: [POST], schemes: [http],
         mcp: {methods: [initialize, server/discover, "*/list", tools/call, resources/read,
                         prompts/get],
               tools: [list_issues, "get_*"], resources: ["file:///projects/*"],
               prompts: [summary]}}
"""
INFO = RequestInfo("http", "mcp.example", 80, "POST", "/mcp")
TOOLS = [{"name": n, "inputSchema": {"type": "object"}} for n in
         ("list_issues", "get_me", "delete_repo", "create_issue")]


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


def request(method: str, i: int, modern: bool, **params: Any
            ) -> tuple[dict[str, Any], dict[str, str]]:
    """A list request as a 2025 session's client sends it, or as a 2026-07-28 one does (the
    version in params._meta, the metadata headers mirroring the body)."""
    p = dict(params)
    headers: dict[str, str] = {}
    if modern:
        p["_meta"] = {"io.modelcontextprotocol/protocolVersion": MODERN,
                      "io.modelcontextprotocol/clientCapabilities": {}}
        headers = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    msg: dict[str, Any] = {"jsonrpc": "2.0", "id": i, "method": method}
    if p:
        msg["params"] = p
    return msg, headers


async def answered(state: context.GateState, msg: dict[str, Any], headers: dict[str, str],
                   result: Any, sse: bool = False) -> tuple[FlowRecord, Any]:
    """Judge the request through the call stage, then filter the server's answer to it."""
    f = tflow.tflow(req=tflow.treq(method=b"POST", host="mcp.example", port=80, path=b"/mcp",
                                   content=json.dumps(msg).encode()))
    for k, v in headers.items():
        f.request.headers[k] = v
    rec = context.record(f)
    policy = state.flow_policy(rec)
    rec.caller, rec.info, rec.policy = Caller("agent", None, "token"), INFO, policy
    rec.decision = decide(policy, "agent", INFO)
    await s35_call.judge(state, f, rec)
    assert not rec.refused
    answer = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result})
    if sse:
        content = f"event: message\ndata: {answer}\n\n".encode()
        ctype = "text/event-stream"
    else:
        content, ctype = answer.encode(), "application/json"
    resp = http.Response.make(200, content, {"content-type": ctype})
    filter_whole(rec, resp)
    text = (resp.content or b"").decode()
    if sse:
        text = text.split("data: ", 1)[1]
    return rec, json.loads(text)["result"]


@pytest.mark.parametrize("modern", [False, True], ids=["2025", "2026-07-28"])
async def test_every_page_is_filtered_and_keeps_its_cursor(state, modern: bool) -> None:
    """Page 1 (no cursor) and page 2 (the cursor page 1 gave) are each filtered; a page left
    empty keeps nextCursor, so the client goes on to the next page and sees what it may."""
    pages = [({}, {"tools": TOOLS[:2], "nextCursor": "p2"}),
             ({"cursor": "p2"}, {"tools": TOOLS[2:], "nextCursor": "p3"}),
             ({"cursor": "p3"}, {"tools": [{"name": "get_issue", "inputSchema": {}}]})]
    seen = []
    for i, (params, result) in enumerate(pages, 1):
        _, out = await answered(state, *request("tools/list", i, modern, **params), result)
        seen.append(([t["name"] for t in out["tools"]], out.get("nextCursor")))
    assert seen == [(["list_issues", "get_me"], "p2"), ([], "p3"), (["get_issue"], None)]


@pytest.mark.parametrize("modern", [False, True], ids=["2025", "2026-07-28"])
async def test_resource_templates_are_filtered(state, modern: bool) -> None:
    templates = [{"uriTemplate": "file:///projects/{name}", "name": "project"},
                 {"uriTemplate": "file:///{path}", "name": "anything"},
                 {"uriTemplate": "db://{table}", "name": "db"}]
    rec, out = await answered(state, *request("resources/templates/list", 1, modern),
                              {"resourceTemplates": templates})
    assert [t["name"] for t in out["resourceTemplates"]] == ["project"]
    assert rec.call is not None and rec.call.removed == 2


async def test_lists_server_discover_carries_are_filtered(state) -> None:
    result = {"resultType": "complete", "supportedVersions": [MODERN],
              "capabilities": {"tools": {}}, "serverInfo": {"name": "s", "version": "1"},
              "tools": TOOLS, "prompts": [{"name": "summary"}, {"name": "leak"}],
              "ttlMs": 60000, "cacheScope": "public"}
    _, out = await answered(state, *request("server/discover", 1, True), result)
    assert [t["name"] for t in out["tools"]] == ["list_issues", "get_me"]
    assert [p["name"] for p in out["prompts"]] == ["summary"]
    assert out["capabilities"] == {"tools": {}} and out["ttlMs"] == 60000
    assert out["cacheScope"] == "private"


async def test_a_discover_result_without_lists_is_left_as_it_is(state) -> None:
    result = {"resultType": "complete", "supportedVersions": [MODERN], "capabilities": {},
              "serverInfo": {"name": "s", "version": "1"}, "ttlMs": 5, "cacheScope": "public"}
    _, out = await answered(state, *request("server/discover", 1, True), result)
    assert out == result  # nothing per identity in it: public stays public


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("given", "expected"), [
    ({"ttlMs": 300000, "cacheScope": "public"}, {"ttlMs": 300000, "cacheScope": "private"}),
    ({"ttlMs": 300000, "cacheScope": "shared"}, {"ttlMs": 300000, "cacheScope": "private"}),
    ({"ttlMs": 300000}, {"ttlMs": 300000, "cacheScope": "private"}),
    ({"ttlMs": 0, "cacheScope": "private"}, {"ttlMs": 0, "cacheScope": "private"}),
    ({}, {}),
], ids=["public", "unknown-scope", "ttl-without-scope", "private", "no-hints"])
async def test_a_filtered_list_is_cacheable_by_its_caller_only(state, given, expected,
                                                               sse: bool) -> None:
    """cacheScope "public" would let a shared cache or gateway serve this identity's view of
    the list to another identity: narrowed to "private". ttlMs is kept: it says how long the
    list stays fresh, which filtering does not change."""
    _, out = await answered(state, *request("tools/list", 1, True),
                            {"tools": TOOLS, **given}, sse=sse)
    assert {k: out[k] for k in ("ttlMs", "cacheScope") if k in out} == expected
    assert [t["name"] for t in out["tools"]] == ["list_issues", "get_me"]


async def test_a_list_that_is_not_a_list_is_not_passed_on(state) -> None:
    """A tools member the filter cannot read as a list of entries would reach the client
    unfiltered: the answer is dropped instead (the response hook then kills the flow)."""
    with pytest.raises(ValueError):
        await answered(state, *request("tools/list", 1, False),
                       {"tools": {"0": {"name": "delete_repo"}}})
