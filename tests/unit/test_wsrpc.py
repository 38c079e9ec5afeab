"""One rule, every transport: protocol upgrades on rules with `mcp:`/`jsonrpc:` (decide(),
the loader, fixtures, explain) and the messages of a WebSocket on such a rule
(sandgate.stages.wsrpc; the frames it cannot judge: sandgate.mitm.guards.wscontrol). End to end:
tests/integration/test_ws_rpc.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import wsproto
import wsproto.events as ws_events
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.test import tflow

from sandgate.decision import decide
from sandgate.errors import Code
from sandgate.mitm.guards import wscontrol
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo
from sandgate.rpc.jsonrpc import parse
from sandgate.stages.flow import CallState
from sandgate.stages.forward import upgrade_asked
from sandgate.stages.wsrpc import MAX_PENDING_LISTS, WsRpc, from_server, judge_client
from tests.support.wsgate import Gate, audited, hook, make_gate, ws_flow
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(100), deadline=None, database=None)

POLICY = """
version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
  other: {vault: secret/data/other, field: token}
identities:
  agent:
    rules:
      - {name: chain, hosts: [rpc.example.com], paths: [/ws], websocket: true,
         jsonrpc: {methods: ["eth_*"], deny_methods: [eth_sendRawTransaction]},
         inject: {headers: {x-api-key: "{{ secrets.gh }}"}}}
      - {name: chain-post, hosts: [rpc.example.com], paths: [/post],
         jsonrpc: {methods: ["eth_*"]}}
      - {name: mcp, hosts: [mcp.example.com], paths: [/mcp], websocket: true,
         mcp: {tools: [list_issues, "get_*"], deny_tools: [delete_repo]},
         inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}}
      - {name: mcp-admin, hosts: [mcp.example.com], paths: [/mcp], websocket: true,
         mcp: {tools: [admin_*]},
         inject: {headers: {authorization: "Bearer {{ secrets.other }}"}}}
      - {name: plain, hosts: [plain.example.com]}
  mixed:
    rules:
      - {name: wide, hosts: ["*.example.com"]}
      - {name: chain-post, hosts: [rpc.example.com], jsonrpc: {methods: ["eth_*"]}}
  watcher:
    mode: report
    rules:
      - {name: chain, hosts: [rpc.example.com], paths: [/ws], websocket: true,
         jsonrpc: {methods: [eth_blockNumber]}}
"""


def _info(host: str, path: str, upgrade: str | None = "websocket") -> RequestInfo:
    return RequestInfo("https", host, 443, "GET", path, upgrade=upgrade)


WS = _info("rpc.example.com", "/ws")
POST_ONLY = _info("rpc.example.com", "/post")
MCP = _info("mcp.example.com", "/mcp")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    d: Path = tmp_path_factory.mktemp("pol")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


# ---------------------------------------------------------------- the upgrade, in decide()


@pytest.mark.parametrize(("identity", "info", "code"), [
    ("agent", POST_ONLY, Code.UPGRADE_REFUSED),  # no websocket: true
    ("agent", _info("rpc.example.com", "/ws", "h2c"), Code.UPGRADE_REFUSED),  # not WebSocket
    ("agent", _info("rpc.example.com", "/ws", "websocket2"), Code.UPGRADE_REFUSED),
    ("mixed", _info("rpc.example.com", "/x"), Code.UPGRADE_REFUSED),  # whichever rule allows
    ("agent", WS, None),
    ("agent", MCP, None),
    ("agent", _info("plain.example.com", "/"), None),  # no mcp:/jsonrpc:: unchanged
    ("mixed", _info("www.example.com", "/"), None),
])
def test_an_upgrade_on_a_call_rule_needs_websocket_true(policy: Policy, identity: str,
                                                        info: RequestInfo,
                                                        code: Code | None) -> None:
    d = decide(policy, identity, info)
    assert d.code == code, d.reason
    if code is not None:
        assert not d.allowed and d.rule is not None and d.hint
        assert "upgrade" not in d.reason or info.upgrade in d.reason
        if info.upgrade == "websocket":
            assert f"add `websocket: true` to rule '{d.rule.name}'" in d.hint
        else:
            assert d.hint.startswith("only WebSocket can be judged")
    # the same request without the upgrade is what it always was
    assert decide(policy, identity, dataclasses.replace(info, upgrade=None)).allowed


def test_an_upgrade_refused_in_report_mode_stays_refused(policy: Policy) -> None:
    from sandgate.decision import reported

    d = decide(policy, "watcher", _info("rpc.example.com", "/ws", "h2c"))
    assert d.code == Code.UPGRADE_REFUSED and not reported(policy, "watcher", d)


@SETTINGS
@given(st.sampled_from(["agent", "mixed", "watcher"]),
       st.sampled_from(["rpc.example.com", "mcp.example.com", "plain.example.com",
                        "www.example.com"]),
       st.sampled_from(["/ws", "/post", "/mcp", "/", "/x"]),
       st.sampled_from([None, "websocket", "h2c", "tls/1.0"]))
def test_an_allowed_upgrade_matches_only_opted_in_call_rules(identity: str, host: str,
                                                             path: str,
                                                             upgrade: str | None) -> None:
    """Whatever the request: an upgrade decide() allows matches no rule with mcp:/jsonrpc:
    except ones saying websocket: true, and only to WebSocket."""
    pol = _policy()
    info = RequestInfo("https", host, 443, "GET", path, upgrade=upgrade)
    d = decide(pol, identity, info)
    if not d.allowed or upgrade is None:
        return
    matching = [r for r in pol.identities[identity].rules
                if r.matches_host(host) and (r.paths is None or any(p.matches(path)
                                                                    for p in r.paths))]
    for r in matching:
        assert r.call is None or (r.call.websocket and upgrade == "websocket"), r.name
    if any(r.call is not None for r in matching):
        assert d.call_limit is not None  # its messages are judged


@functools.cache
def _policy() -> Policy:
    """POLICY loaded once (hypothesis tests cannot take a module fixture)."""
    d = Path(tempfile.mkdtemp())
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


@pytest.mark.parametrize(("method", "headers", "want"), [
    ("GET", {"connection": "Upgrade", "upgrade": "websocket"}, "websocket"),
    ("GET", {"connection": "keep-alive, Upgrade", "upgrade": "WebSocket"}, "websocket"),
    ("GET", {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c",
             "http2-settings": "AA"}, "h2c"),
    ("GET", {"http2-settings": "AA"}, "h2c"),
    ("GET", {"upgrade": "websocket"}, "websocket"),  # no Connection: refused later all the same
    ("POST", {"connection": "Upgrade", "upgrade": "websocket"}, "websocket"),
    ("GET", {"upgrade": "TLS/1.0, websocket"}, "tls/1.0"),
    ("GET", {}, None),
])
def test_the_upgrade_asked_for(method: str, headers: dict[str, str], want: str | None) -> None:
    req = tflow.tflow().request
    req.method = method
    for k, v in headers.items():
        req.headers[k] = v
    assert upgrade_asked(req) == want


# ---------------------------------------------------------------- the rule key


@pytest.mark.parametrize(("rule", "fragment"), [
    ("{name: r, hosts: [a.example.com], websocket: true}",
     "goes with `mcp:`, `jsonrpc:` or `llm:`"),
    ("{name: r, hosts: [a.example.com], websocket: false}",
     "goes with `mcp:`, `jsonrpc:` or `llm:`"),
    ("{name: r, hosts: [a.example.com], action: ask, websocket: true, mcp: {}}",
     "cannot take `websocket: true`"),
    ("{name: r, hosts: [a.example.com], websocket: yes please, mcp: {}}", "websocket"),
    ("{name: r, hosts: [a.example.com], methods: [POST], websocket: true, jsonrpc: {}}",
     "a WebSocket is opened by a GET"),
])
def test_the_websocket_key_is_checked(tmp_path: Path, rule: str, fragment: str) -> None:
    (tmp_path / "p.yaml").write_text(f"version: v1\nidentities:\n  a:\n    rules:\n"
                                     f"      - {rule}\n")
    with pytest.raises(PolicyError) as e:
        load_policy_dir(tmp_path)
    assert fragment in str(e.value)


FIXTURES = """
tests:
  - {identity: agent, request: GET https://rpc.example.com/post, websocket: true,
     expect: deny, code: upgrade_refused}
  - {identity: agent, request: GET https://rpc.example.com/ws, websocket: true,
     expect: allow, rule: chain, inject: [gh]}
  - {identity: agent, request: GET https://rpc.example.com/ws, websocket: true,
     jsonrpc: {method: eth_sendRawTransaction}, expect: deny, code: denied_by_rule}
  - {identity: agent, request: GET https://rpc.example.com/post, jsonrpc: {method: eth_call},
     expect: allow}
"""


def test_fixtures_judge_the_upgrade_and_its_messages(tmp_path: Path) -> None:
    from sandgate.policy.fixtures import run_policy_tests

    (tmp_path / "p.yaml").write_text(POLICY + FIXTURES)
    results = run_policy_tests(load_policy_dir(tmp_path))
    assert [r.passed for r in results] == [True] * 4, [r.message for r in results]


def test_a_websocket_fixture_is_a_get(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY + "tests:\n  - {identity: agent, request: POST "
                                     "https://rpc.example.com/ws, websocket: true, "
                                     "expect: allow}\n")
    with pytest.raises(PolicyError, match="a WebSocket is opened by a GET request"):
        load_policy_dir(tmp_path)


@pytest.mark.parametrize(("extra", "decision", "code"), [
    (["--websocket", "GET", "https://rpc.example.com/post"], "deny", "upgrade_refused"),
    (["--websocket", "GET", "https://rpc.example.com/ws"], "allow", None),
    (["--websocket", "--rpc-method", "eth_sendRawTransaction", "GET",
      "https://rpc.example.com/ws"], "deny", "denied_by_rule"),
    (["GET", "https://rpc.example.com/post"], "allow", None),
])
def test_explain_takes_websocket(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 extra: list[str], decision: str, code: str | None) -> None:
    from sandgate.cli import main

    (tmp_path / "p.yaml").write_text(POLICY)
    rc = main(["explain", "--policies", str(tmp_path), "--identity", "agent", *extra])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["decision"], doc["code"]) == (decision, code), doc
    assert rc == (0 if decision == "allow" else 1)
    assert "websocket" in doc["jsonrpc"]
    assert ("opening a WebSocket" in doc["request"]) == ("--websocket" in extra)


# ---------------------------------------------------------------- the messages (wsrpc)


def _ws(policy: Policy, identity: str = "agent", info: RequestInfo = WS) -> WsRpc:
    head = decide(policy, identity, info)
    assert head.allowed or identity == "watcher", head.reason
    return WsRpc(head, identity == "watcher", CallState(policy, identity, info))


def _msg(i: Any, method: str, params: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if i is not None:
        out["id"] = i
    if params is not None:
        out["params"] = params
    return out


def _send(ws: WsRpc, doc: Any, *, text: bool = True, fragmented: bool = False,
          limit: int = 65536) -> Any:
    return judge_client(ws, json.dumps(doc).encode(), text, fragmented, limit)


def test_an_allowed_call_goes_on_and_a_denied_one_does_not(policy: Policy) -> None:
    ws = _ws(policy)
    v = _send(ws, _msg(1, "eth_blockNumber"))
    assert v.forward and v.outcomes == ["allow"] and v.refused is None
    v = _send(ws, _msg(2, "eth_sendRawTransaction", ["0x01"]))
    assert not v.forward and v.refused is not None
    assert v.refused.code == Code.DENIED_BY_RULE and "eth_sendRawTransaction" in v.refused.reason
    assert v.call is not None and v.call.ids == (2,) and v.outcomes == ["deny"]
    v = _send(ws, _msg(None, "net_version"))  # a notification: refused, no id to answer
    assert not v.forward and v.refused is not None and v.call is not None and not v.call.ids


def test_a_batch_is_refused_whole(policy: Policy) -> None:
    v = _send(_ws(policy), [_msg(1, "eth_blockNumber"), _msg(2, "eth_sendRawTransaction")])
    assert not v.forward and v.outcomes == ["batch", "deny"]
    assert v.call is not None and v.call.batch and v.call.ids == (1, 2)


@pytest.mark.parametrize(("content", "text", "fragmented", "limit", "fragment"), [
    (b'{"jsonrpc":"2.0","id":1,"method":"eth_call"}', False, False, 1000, "binary"),
    (b'{"jsonrpc":"2.0","id":1,"method":"eth_call"}', True, True, 1000, "several frames"),
    (b'{"jsonrpc":"2.0","id":1,"method":"eth_call"}', True, False, 10, "larger than"),
    (b"eth_call please", True, False, 1000, "not valid JSON"),
    (b'{"jsonrpc":"2.0","id":1,"method":"eth_call","id":2}', True, False, 1000, "repeats"),
    (b'{"id":1,"method":"eth_call"}', True, False, 1000, "not JSON-RPC 2.0"),
])
def test_what_cannot_be_judged_closes(policy: Policy, content: bytes, text: bool,
                                      fragmented: bool, limit: int, fragment: str) -> None:
    v = judge_client(_ws(policy), content, text, fragmented, limit)
    assert not v.forward and v.close is not None and fragment in v.close.reason
    assert v.close.code in (Code.BAD_REQUEST, Code.TOO_LARGE) and v.close.hint


def test_report_mode_forwards_a_refused_call(policy: Policy) -> None:
    v = _send(_ws(policy, "watcher"), _msg(1, "eth_sendRawTransaction"))
    assert v.forward and v.reported and v.refused is None


def test_a_call_another_rule_allows_is_not_sent_with_the_upgrades_credentials(
        policy: Policy) -> None:
    ws = _ws(policy, info=MCP)  # opened under rule mcp (secret gh)
    assert ws.head.rule is not None and ws.head.rule.name == "mcp"
    v = _send(ws, _msg(1, "tools/call", {"name": "admin_reset", "arguments": {}}))
    assert decide(policy, "agent", MCP, v.call).rule_name == "mcp-admin"
    assert not v.forward and v.refused is not None and "other credentials" in v.refused.reason
    assert _send(ws, _msg(2, "tools/call", {"name": "get_me"})).forward


def test_list_answers_are_filtered_once_and_pending_lists_are_bounded(policy: Policy) -> None:
    ws = _ws(policy, info=MCP)
    assert _send(ws, _msg(7, "tools/list")).forward
    tools = [{"name": n} for n in ("list_issues", "get_me", "delete_repo", "create_issue")]
    answer = json.dumps({"jsonrpc": "2.0", "id": 7, "result": {"tools": tools}}).encode()
    new, refused = from_server(ws, answer, True, False)
    assert refused is None and new is not None
    assert [t["name"] for t in json.loads(new)["result"]["tools"]] == ["list_issues", "get_me"]
    assert ws.lists.lists == {}  # answered: forgotten
    other = json.dumps({"jsonrpc": "2.0", "id": 8, "result": {"tools": tools}}).encode()
    assert from_server(ws, other, True, False) == (None, None)  # not a list call of ours
    for i in range(MAX_PENDING_LISTS):
        assert _send(ws, _msg(i, "tools/list")).forward
    v = _send(ws, _msg("one more", "tools/list"))
    assert v.close is not None and "await their answer" in v.close.reason


@pytest.mark.parametrize(("content", "text", "fragmented", "fragment"), [
    (b'{"jsonrpc":"2.0","id":1,"result":1}', False, False, "binary frame"),
    (b'{"jsonrpc":"2.0","id":1,"result":1}', True, True, "several frames"),
    (b"hello", True, False, "not JSON"),
])
def test_a_server_message_that_cannot_be_filtered_closes(policy: Policy, content: bytes,
                                                         text: bool, fragmented: bool,
                                                         fragment: str) -> None:
    new, refused = from_server(_ws(policy), content, text, fragmented)
    assert new is None and refused is not None and fragment in refused.reason
    assert refused.code == Code.UPSTREAM_ERROR


METHODS = ["eth_blockNumber", "eth_call", "eth_sendRawTransaction", "net_version", "ping"]


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(METHODS), st.booleans()), min_size=1, max_size=5),
       st.booleans())
def test_a_message_goes_on_exactly_when_decide_allows_it_as_a_body(
        entries: list[tuple[str, bool]], batch: bool) -> None:
    """The WebSocket judges what the POST path judges: the same decide(), the same call."""
    pol = _policy()
    msgs = [_msg(i if has_id else None, m) for i, (m, has_id) in enumerate(entries)]
    doc: Any = msgs if batch else msgs[0]
    content = json.dumps(doc).encode()
    v = judge_client(_ws(pol), content, True, False, 65536)
    post = decide(pol, "agent", dataclasses.replace(WS, method="POST", upgrade=None),
                  parse(content))
    assert v.close is None and v.forward == post.allowed
    assert (v.refused is None) == post.allowed


# ---------------------------------------------------------------- the frames (wscontrol)


def _server_side(flow: Any) -> Any:
    from mitmproxy.proxy.layers import websocket as ws_layer

    conn = ws_layer.WebsocketConnection(wsproto.ConnectionType.SERVER,
                                        conn=flow.client_conn)
    setattr(conn, wscontrol._TAG, (flow, True))
    client = wsproto.Connection(wsproto.ConnectionType.CLIENT)
    return conn, client


def test_fragments_are_noted_and_a_close_is_sent_on_request() -> None:
    flow = tflow.twebsocketflow()
    conn, client = _server_side(flow)
    conn.receive_data(client.send(ws_events.TextMessage(data="ab", message_finished=False)))
    conn.receive_data(client.send(ws_events.TextMessage(data="cd")))
    conn.receive_data(client.send(ws_events.TextMessage(data="whole")))
    events = wscontrol._events(conn)
    first = next(events)
    assert isinstance(first, ws_events.TextMessage) and not first.message_finished
    assert isinstance(next(events), ws_events.TextMessage)  # "cd": the message is complete
    assert wscontrol.fragmented(flow, True) and not wscontrol.fragmented(flow, True)
    assert not wscontrol.fragmented(flow, False)
    whole = next(events)
    assert isinstance(whole, ws_events.TextMessage) and whole.data == "whole"
    assert not wscontrol.fragmented(flow, True)  # one frame
    # the message hook asks for the close: the next event read is the close, nothing after it
    wscontrol.close(flow, 1008, "sandgate: bad_request " + "x" * 200)
    close = next(events)
    assert isinstance(close, ws_events.CloseConnection) and close.code == 1008
    assert len((close.reason or "").encode()) <= wscontrol.REASON_MAX
    assert list(events) == []


# ---------------------------------------------------------------- narrower_than proofs

PAIR = """
version: v1
identities:
  agent:
    rules:
      - {{name: gh, hosts: [mcp.example.com], paths: [/mcp], {agent}}}
  bash-tool:
    narrower_than: agent
    rules:
      - {{name: gh, hosts: [mcp.example.com], paths: [/mcp], {bash}}}
"""


@pytest.mark.parametrize(("agent", "bash", "counter"), [
    ("websocket: true, mcp: {}", "mcp: {}", None),
    ("websocket: true, mcp: {}", "websocket: true, mcp: {}", None),
    ("mcp: {}", "websocket: true, mcp: {}", "GET https://mcp.example.com:443/mcp opening a "
     "WebSocket"),
    # a WebSocket the other identity allows only without judging it is still narrower: the
    # narrow one judges every message, but the other forwards every message
    ("max_request_bytes: 64k", "websocket: true, mcp: {}", None),
    # the narrow one judges nothing (the first gap found: a body that is no call)
    ("mcp: {}", "max_request_bytes: 64k", "a body that is not a JSON-RPC call"),
    ("websocket: true, mcp: {tools: [a]}", "websocket: true, mcp: {tools: [a, b]}",
     "tool b"),
])
def test_narrower_than_covers_websockets(tmp_path: Path, agent: str, bash: str,
                                         counter: str | None) -> None:
    from sandgate.review.proofs import prove

    (tmp_path / "p.yaml").write_text(PAIR.format(agent=agent, bash=bash))
    (result,) = prove(load_policy_dir(tmp_path))
    assert result.ok == (counter is None), str(result)
    if counter is not None:
        assert result.counterexample is not None and counter in result.counterexample, result


def test_the_reach_diff_names_a_websocket_gained_or_lost() -> None:
    from sandgate.review.callproofs import calls_gained

    pol = _policy()
    rule = pol.identities["agent"].rules[1]  # chain-post: jsonrpc: without websocket
    assert rule.call is not None and not rule.call.websocket
    opened = dataclasses.replace(rule, call=dataclasses.replace(rule.call, websocket=True))
    assert calls_gained(rule, opened) == ["a WebSocket"]
    assert calls_gained(opened, rule) == []
    plain = dataclasses.replace(rule, call=None)
    assert "a WebSocket" not in (calls_gained(plain, opened) or [])


# ---------------------------------------------------------------- the hook (s70_scrub)


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gate:
    from sandgate.stages import wsrpc

    return make_gate(tmp_path, monkeypatch, _policy(), wsrpc)


def _rpc_flow(gate: Gate, info: RequestInfo = WS) -> Any:
    return ws_flow(gate, info, calls=True)


def test_the_hook_forwards_refuses_answers_and_audits(gate: Gate) -> None:
    flow = _rpc_flow(gate)
    ok = hook(gate, flow, json.dumps(_msg(1, "eth_blockNumber")).encode())
    assert not ok.dropped and gate.injected == []
    bad = hook(gate, flow, json.dumps(_msg(2, "eth_sendRawTransaction")).encode())
    assert bad.dropped
    (answer,) = gate.injected
    doc = json.loads(answer)
    assert doc["id"] == 2 and doc["error"]["code"] == -32003
    assert doc["error"]["data"]["sandgate"]["code"] == "denied_by_rule"
    events = audited(gate)
    assert [(e["decision"], e["rpc"][0]["method"]) for e in events] == [
        ("allow", "eth_blockNumber"), ("deny", "eth_sendRawTransaction")]
    assert events[1]["code"] == "denied_by_rule" and events[1]["rule"] == "chain"
    # Sandgate's own answer, coming back through the hook, is not judged again
    assert not hook(gate, flow, answer, from_client=False).dropped


def test_the_hook_closes_on_what_it_cannot_judge(gate: Gate) -> None:
    flow = _rpc_flow(gate)
    binary = hook(gate, flow, json.dumps(_msg(1, "eth_call")).encode(), text=False)
    assert binary.dropped
    assert flow.metadata[wscontrol.CLOSE_KEY][0] == 1008
    assert audited(gate)[-1]["code"] == "bad_request"
    later = hook(gate, flow, json.dumps(_msg(2, "eth_call")).encode())
    assert later.dropped  # nothing after it goes


def test_the_hook_fails_closed(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandgate.stages import wsrpc

    def boom(*args: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(wsrpc, "judge_client", boom)
    flow = _rpc_flow(gate)
    msg = hook(gate, flow, json.dumps(_msg(1, "eth_blockNumber")).encode())
    assert msg.dropped and flow.metadata[wscontrol.CLOSE_KEY][0] == 1008


def test_the_hook_filters_list_answers(gate: Gate) -> None:
    flow = _rpc_flow(gate, MCP)
    assert not hook(gate, flow, json.dumps(_msg(5, "tools/list")).encode()).dropped
    tools = [{"name": n} for n in ("get_me", "delete_repo")]
    answer = hook(gate, flow, json.dumps({"jsonrpc": "2.0", "id": 5,
                                           "result": {"tools": tools}}).encode(),
                   from_client=False)
    assert [t["name"] for t in json.loads(answer.content)["result"]["tools"]] == ["get_me"]


def test_check_names_websocket_fixtures(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    from sandgate.cli import main

    (tmp_path / "p.yaml").write_text(POLICY + FIXTURES)
    assert main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "agent GET https://rpc.example.com/post [WebSocket] -> deny" in out
    assert ("agent GET https://rpc.example.com/ws [WebSocket: method eth_sendRawTransaction] "
            "-> deny") in out
    assert "agent GET https://rpc.example.com/post [method eth_call] -> allow" in out


def test_a_message_that_cannot_be_audited_is_not_forwarded(
        gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail closed: once the audit log cannot be written, an allowed call is dropped and the
    WebSocket closed (as no new request is forwarded then), not sent unaudited."""
    from tests.support.wsgate import break_audit

    flow = _rpc_flow(gate)
    assert not hook(gate, flow, json.dumps(_msg(1, "eth_blockNumber")).encode()).dropped
    break_audit(gate, monkeypatch)
    msg = hook(gate, flow, json.dumps(_msg(2, "eth_blockNumber")).encode())
    assert msg.dropped
    assert flow.metadata[wscontrol.CLOSE_KEY][0] == 1008
    assert gate.injected == []
    assert hook(gate, flow, json.dumps(_msg(3, "eth_blockNumber")).encode()).dropped
