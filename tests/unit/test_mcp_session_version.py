"""The protocol version negotiated for an MCP session (issue 34): Sandgate reads it from the
server's initialize answer, binds it into the session id it hands out (sandgate.rpc.mcpsession,
no state), and refuses a request of that session whose MCP-Protocol-Version names another one.
Session binding itself: tests/unit/test_mcpsession.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow

from sandgate.audit import events as audit
from sandgate.decision import decide
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.policy.loader import load_policy_dir
from sandgate.request import RequestInfo
from sandgate.rpc.mcpheaders import KNOWN_VERSIONS
from sandgate.rpc.mcpsession import SessionIdError, session_key, unwrap, unwrap_bound, wrap
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.stages import context, s35_call, s70_scrub
from sandgate.stages.flow import FlowRecord

KEY = session_key(b"unit-test-token-key-not-secret!!")
HOST, PORT = "mcp.example", 80
RAW_SID = "fake-upstream-session-0001"

versions = st.sampled_from(KNOWN_VERSIONS)


@given(versions, st.binary(min_size=1, max_size=80))
def test_a_bound_id_says_its_version_and_is_never_an_unbound_one(version: str,
                                                                   sid: bytes) -> None:
    bound = wrap(KEY, "agent", HOST, PORT, sid, version)
    assert unwrap_bound(KEY, "agent", HOST, PORT, bound, KNOWN_VERSIONS) == (sid, version)
    with pytest.raises(SessionIdError):
        unwrap(KEY, "agent", HOST, PORT, bound)  # not without its version
    with pytest.raises(SessionIdError):  # nor for another identity, whatever the version
        unwrap_bound(KEY, "bash-tool", HOST, PORT, bound, KNOWN_VERSIONS)
    others = tuple(v for v in KNOWN_VERSIONS if v != version)
    with pytest.raises(SessionIdError):
        unwrap_bound(KEY, "agent", HOST, PORT, bound, others)
    unbound = wrap(KEY, "agent", HOST, PORT, sid)
    assert unwrap_bound(KEY, "agent", HOST, PORT, unbound, KNOWN_VERSIONS) == (sid, None)


def test_a_version_that_is_not_a_short_token_is_not_bound() -> None:
    for version in ("", "2025-06-18\0x", "x" * 65, "2025 06 18"):
        with pytest.raises(ValueError):
            wrap(KEY, "agent", HOST, PORT, b"sid", version)


# --- through the call stage and the response hooks ------------------------------------------

POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: gh, hosts: [mcp.example], methods: [POST, GET, DELETE], schemes: [http],
         mcp: {tools: [get_me]}}
"""
INFO = RequestInfo("http", HOST, PORT, "POST", "/mcp")
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "unit", "version": "1"}}}
CALL = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "get_me", "arguments": {}}}


@pytest.fixture
def state(tmp_path: Path) -> context.GateState:
    d = tmp_path / "pol"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(d)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    gs = context.GateState(context.GateConfig(
        policy=policy, broker=broker, identifier=Identifier(b"k" * 32),
        audit=audit.AuditLog(tmp_path / "audit.jsonl"), max_request_body=100_000))
    gs.session_key = KEY
    return gs


async def post(state: context.GateState, msg: Any, headers: dict[str, str]
               ) -> tuple[FlowRecord, http.HTTPFlow]:
    f = tflow.tflow(req=tflow.treq(method=b"POST", host=HOST, port=PORT, path=b"/mcp",
                                   content=json.dumps(msg).encode()))
    for k, v in headers.items():
        f.request.headers[k] = v
    rec = context.record(f)
    policy = state.flow_policy(rec)
    rec.caller, rec.info, rec.policy = Caller("agent", None, "token"), INFO, policy
    rec.decision = decide(policy, "agent", INFO)
    await s35_call.judge(state, f, rec)
    return rec, f


def answer(state: context.GateState, f: http.HTTPFlow, rec: FlowRecord, body: bytes,
           ctype: str, chunked: bool = True) -> http.Response:
    """The upstream's answer through the response hooks (head, then the whole body)."""
    headers = [(b"content-type", ctype.encode()), (b"mcp-session-id", RAW_SID.encode())]
    headers.append((b"transfer-encoding", b"chunked") if chunked
                   else (b"content-length", str(len(body)).encode()))
    f.response = http.Response.make(200, b"", headers)
    s70_scrub.response_headers(state, f, rec)
    assert f.response.stream is False or f.response.stream is None  # read whole
    assert RAW_SID not in str(f.response.headers)  # held back until the version is known
    f.response.content = body
    s70_scrub.finish(state, f, rec)
    return f.response


def init_result(version: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
        "protocolVersion": version, "capabilities": {},
        "serverInfo": {"name": "s", "version": "1"}}}).encode()


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
async def test_the_negotiated_version_is_bound_and_held_to(state, sse: bool) -> None:
    """The client offers 2025-11-25, the server answers 2025-06-18 (a counter-offer): the
    session is 2025-06-18, and a request of it claiming 2025-11-25 (or the stateless
    revision) is refused; the right version, or none, goes through."""
    rec, f = await post(state, INIT, {})
    body = init_result("2025-06-18")
    if sse:
        body = b"event: message\ndata: " + body + b"\n\n"
    resp = answer(state, f, rec, body, "text/event-stream" if sse else "application/json")
    issued = resp.headers["mcp-session-id"]
    assert resp.headers.get("transfer-encoding") is None
    assert int(resp.headers["content-length"]) == len(resp.content or b"")
    assert unwrap_bound(KEY, "agent", HOST, PORT, issued, KNOWN_VERSIONS)[1] == "2025-06-18"

    for version in ("2025-11-25", "2026-07-28"):
        rec, f = await post(state, CALL, {"mcp-session-id": issued,
                                          "MCP-Protocol-Version": version})
        assert rec.refused and f.response is not None and f.response.status_code == 400
        doc = json.loads(f.response.content or b"")
        assert doc["error"]["code"] == -32020
        assert "not the version negotiated for this session (2025-06-18)" in \
            doc["error"]["message"]
        assert doc["error"]["data"]["sandgate"]["code"] == "header_mismatch"
    for headers in ({"MCP-Protocol-Version": "2025-06-18"}, {}):
        rec, f = await post(state, CALL, {"mcp-session-id": issued, **headers})
        assert not rec.refused and f.request.headers["mcp-session-id"] == RAW_SID
        # the server echoes its id: handed back bound to the same version, the same id
        f.response = http.Response.make(200, b"{}", {"content-type": "application/json",
                                                      "mcp-session-id": RAW_SID})
        s70_scrub.response_headers(state, f, rec)
        assert f.response.headers["mcp-session-id"] == issued


@pytest.mark.parametrize("body", [
    init_result(None), init_result("1999-01-01"), b"not json",
    json.dumps({"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "x"}}).encode(),
], ids=["no-version", "unknown-version", "unreadable", "error"])
async def test_an_answer_naming_no_known_version_issues_an_unbound_id(state, body) -> None:
    rec, f = await post(state, INIT, {})
    resp = answer(state, f, rec, body, "application/json", chunked=False)
    issued = resp.headers["mcp-session-id"]
    assert unwrap(KEY, "agent", HOST, PORT, issued).decode() == RAW_SID
