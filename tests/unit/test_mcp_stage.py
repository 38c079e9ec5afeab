"""The call stage's response side: list answers filtered, JSON and SSE, however chunked
(sandgate.stages.rpccalls). Session ids: tests/unit/test_mcpsession.py."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo
from sandgate.stages.flow import CallState
from sandgate.stages.rpccalls import _filter_json, _SseFilter

POLICY = """
version: v1
identities:
  bash-tool:
    rules:
      - {name: m, hosts: [mcp.example.com], paths: [/mcp], mcp: {tools: [list_issues, "get_*"],
         deny_tools: [get_secret], prompts: [summary]}}
"""
INFO = RequestInfo("https", "mcp.example.com", 443, "POST", "/mcp")
TOOLS = [{"name": n, "inputSchema": {}} for n in
         ("list_issues", "get_me", "get_secret", "delete_repo", "create_issue")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    d: Path = tmp_path_factory.mktemp("pol")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


def state(policy: Policy, lists: dict[str, str]) -> CallState:
    s = CallState(policy, "bash-tool", INFO)
    s.lists = lists
    return s


def test_json_list_answer_is_filtered(policy: Policy) -> None:
    st_ = state(policy, {"1": "tools/list", '"p"': "prompts/list"})
    body = json.dumps([
        {"jsonrpc": "2.0", "id": 1, "result": {"tools": TOOLS, "nextCursor": "c2"}},
        {"jsonrpc": "2.0", "id": "p", "result": {"prompts": [{"name": "summary"},
                                                              {"name": "other"}]}},
        {"jsonrpc": "2.0", "id": 9, "result": {"tools": TOOLS}},  # not a list call of ours
    ]).encode()
    out = json.loads(_filter_json(st_, body))
    assert [t["name"] for t in out[0]["result"]["tools"]] == ["list_issues", "get_me"]
    assert out[0]["result"]["nextCursor"] == "c2"  # pagination untouched
    assert [p["name"] for p in out[1]["result"]["prompts"]] == ["summary"]
    assert len(out[2]["result"]["tools"]) == 5
    assert st_.removed == 4


def test_an_unreadable_list_answer_is_not_passed_on(policy: Policy) -> None:
    with pytest.raises(ValueError):
        _filter_json(state(policy, {"1": "tools/list"}),
                     b'{"jsonrpc":"2.0","id":1,"result":{"tools":[], "tools":[]}}')


SSE = ("event: message\r\nid: e1\r\ndata: " + json.dumps(
    {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}) + "\r\n\r\n"
    + "event: message\nid: e2\ndata: " + json.dumps(
        {"jsonrpc": "2.0", "id": 4, "result": {"tools": TOOLS}}) + "\n\n").encode()


@given(st.lists(st.integers(0, len(SSE)), max_size=8))
def test_sse_list_answer_is_filtered_however_it_is_chunked(cuts: list[int]) -> None:
    policy = _policy()  # hypothesis and function-scoped fixtures do not mix
    flt = _SseFilter(state(policy, {"4": "tools/list"}))
    bounds = sorted(set([0, *cuts, len(SSE)]))
    out = b"".join(flt.feed(SSE[a:b]) for a, b in itertools.pairwise(bounds))
    out += flt.feed(b"")
    events = [e for e in out.decode().split("\n\n") if e]
    assert len(events) == 2
    assert "notifications/progress" in events[0] and "id: e1" in events[0]
    data = json.loads(events[1].split("data: ", 1)[1])
    assert [t["name"] for t in data["result"]["tools"]] == ["list_issues", "get_me"]
    assert "id: e2" in events[1]


_CACHE: dict[str, Policy] = {}


def _policy() -> Policy:
    if "p" not in _CACHE:
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "p.yaml").write_text(POLICY)
            _CACHE["p"] = load_policy_dir(d)
    return _CACHE["p"]


def test_call_metric_labels_are_bounded_by_the_policy(policy: Policy) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from sandgate.audit import events as A
    from sandgate.metrics import Metrics

    m = Metrics(lambda: policy)
    rpc = [{"kind": "request", "method": "tools/call", "id": 1, "tool": "get_me",
            "decision": "batch"},
           {"kind": "request", "method": "tools/call", "id": 2, "tool": "sk-evil/x",
            "decision": "deny"},
           {"kind": "request", "method": "evil/method?x", "id": 3, "decision": "deny"}]
    m.on_audit("request", {A.IDENTITY: "bash-tool", A.RULE: "m", A.DECISION: "deny",
                           A.CODE: "no_rule", "rpc": rpc})
    samples = {tuple(sorted(s.labels.items())): s.value
               for fam in text_string_to_metric_families(m.render().decode())
               for s in fam.samples if s.name == "sandgate_rpc_calls_total"}
    assert samples == {
        (("decision", "batch"), ("identity", "bash-tool"), ("method", "tools/call"),
         ("tool", "get_*")): 1,
        (("decision", "deny"), ("identity", "bash-tool"), ("method", "tools/call"),
         ("tool", "unknown")): 1,
        (("decision", "deny"), ("identity", "bash-tool"), ("method", "unknown"),
         ("tool", "none")): 1,
    }


def test_audit_scrubs_the_sandbox_strings_of_calls() -> None:
    from sandgate.audit import events as A
    from sandgate.scrub.scrubber import SecretSet

    value = "test-mcp-REAL-token-5e1d"
    fields = A.scrub_fields({"rpc": [{"method": "tools/call", "tool": f"x{value}",
                                      "id": value, "decision": "deny"}]},
                            SecretSet({"gh": value}))
    assert value not in repr(fields)
    assert fields["rpc"][0]["decision"] == "deny"
