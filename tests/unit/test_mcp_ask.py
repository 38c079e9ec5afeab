"""Issue 38: an `mcp:` on an `action: ask` rule holds the calls, not the session's
housekeeping; a refused tool call names the rule that came closest to allowing it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.decision import decide, judge
from sandgate.errors import Code
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import Policy, glob_matches
from sandgate.request import RequestInfo
from sandgate.rpc.jsonrpc import Call, Message, method_call, parse, tool_call

POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: gh-ask, action: ask, hosts: [mcp.example.com], methods: [GET, POST, DELETE],
         paths: [/mcp], mcp: {tools: [create_issue, list_issues]}}
  mixed:
    rules:
      - {name: gh-me, hosts: [mcp.example.com], paths: [/mcp], mcp: {tools: [get_me]}}
      - {name: gh-read, hosts: [mcp.example.com], paths: [/mcp],
         mcp: {tools: [list_issues, get_issue], arguments: {repo: "acme/*"}}}
"""
STRICT = """
version: v1
identities:
  strict:
    rules:
      - {name: gh-ask-all, action: ask, hosts: [mcp.example.com], methods: [GET, POST, DELETE],
         paths: [/mcp], mcp: {tools: [list_issues], ask_housekeeping: true}}
"""


def req(method: str = "POST") -> RequestInfo:
    return RequestInfo("https", "mcp.example.com", 443, method, "/mcp")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    d: Path = tmp_path_factory.mktemp("pol")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    d: Path = tmp_path_factory.mktemp("strict")
    (d / "p.yaml").write_text(STRICT)
    return load_policy_dir(d)


@pytest.mark.parametrize("call", [
    method_call("initialize"), method_call("server/discover"),
    method_call("notifications/initialized"), method_call("ping"),
    method_call("tools/list"), method_call("prompts/list"), method_call("resources/list"),
    # an answer to the server's request (sampling, elicitation) is not a call
    Call((Message("response", None, 7),)),
    parse(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"},'
          b' {"jsonrpc": "2.0", "method": "notifications/initialized"}]'),
], ids=["initialize", "server/discover", "initialized", "ping", "tools/list", "prompts/list",
        "resources/list", "response", "batch"])
def test_housekeeping_is_not_held(policy: Policy, call: Call) -> None:
    d = decide(policy, "agent", req(), call)
    assert d.allowed and not d.ask and d.rule_name == "gh-ask", d.reason
    assert "housekeeping is not held" in d.reason


@pytest.mark.parametrize("call", [method_call("initialize"), method_call("tools/list")])
def test_ask_housekeeping_holds_it(strict: Policy, call: Call) -> None:
    held = decide(strict, "strict", req(), call)
    assert held.allowed and held.ask and held.rule_name == "gh-ask-all"


@pytest.mark.parametrize("call", [
    tool_call("create_issue"), tool_call("list_issues"),
    # one call in a batch of housekeeping holds the batch
    parse(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"},'
          b' {"jsonrpc": "2.0", "id": 2, "method": "tools/call",'
          b' "params": {"name": "create_issue"}}]'),
], ids=["create_issue", "list_issues", "batch-with-a-call"])
def test_calls_are_held(policy: Policy, call: Call) -> None:
    d = decide(policy, "agent", req(), call)
    assert d.allowed and d.ask and d.rule_name == "gh-ask"


def test_bodiless_stream_and_session_end_are_not_held(policy: Policy, strict: Policy) -> None:
    # the GET event stream and the DELETE ending the session carry no call
    for method in ("GET", "DELETE"):
        d = decide(policy, "agent", req(method))
        assert d.allowed and not d.ask and d.call_limit is not None, method
        assert decide(strict, "strict", req(method)).ask
    # a POST's head is held until its body is judged (the proxy decides again with the call)
    assert decide(policy, "agent", req()).ask


def test_explain_agrees(policy: Policy) -> None:
    v = judge(policy, "agent", "POST", "https://mcp.example.com/mcp", {},
              call=method_call("initialize"))
    assert v.decision.outcome == "allow"
    v = judge(policy, "agent", "POST", "https://mcp.example.com/mcp", {},
              call=tool_call("create_issue"))
    assert v.decision.outcome == "ask"


def test_the_list_is_the_documented_one() -> None:
    from sandgate.policy.model import MCP_HOUSEKEEPING

    assert MCP_HOUSEKEEPING == ("initialize", "server/discover", "notifications/*", "ping",
                                "tools/list", "resources/list", "resources/templates/list",
                                "prompts/list", "logging/setLevel")
    for m in ("tools/call", "resources/read", "prompts/get", "completion/complete",
              "resources/subscribe", "sampling/createMessage"):
        assert not any(glob_matches(p, m) for p in MCP_HOUSEKEEPING), m


def test_ask_housekeeping_only_on_ask_rules(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: [mcp.example.com], mcp: {ask_housekeeping: true}}\n")
    with pytest.raises(PolicyError, match="`ask_housekeeping` only applies to `action: ask`"):
        load_policy_dir(tmp_path)


def test_a_refused_call_names_the_rule_that_came_closest(policy: Policy) -> None:
    # gh-me comes first but does not list get_issue; gh-read lists it and refuses the
    # argument: the refusal is gh-read's (main named gh-me and told to add the tool to it)
    d = decide(policy, "mixed", req(), tool_call("get_issue", {"repo": "evil/app"}))
    assert not d.allowed and d.code == Code.NO_RULE
    assert "in rule 'gh-read'" in d.reason and "argument repo" in d.reason, d.reason
    assert "gh-me" not in d.reason and "gh-me" not in (d.hint or "")
    assert "(arguments)" in (d.hint or ""), d.hint
    # a tool no rule lists is still refused naming the first rule
    d = decide(policy, "mixed", req(), tool_call("delete_repo"))
    assert "`tools` does not list it in rule 'gh-me'" in d.reason


# globs_meet (lint's deny_tools check) against brute force: two call-level globs meet iff
# some name matches both; a shortest such name is no longer than the two globs together.
_GLOB = st.text(alphabet="ab*?", max_size=5)


@given(_GLOB, _GLOB)
def test_globs_meet_agrees_with_brute_force(a: str, b: str) -> None:
    from sandgate.review.lint_mcp import globs_meet

    names = ("".join(p) for n in range(len(a) + len(b) + 1)
             for p in itertools.product("abc", repeat=n))
    brute = any(glob_matches(a, s) and glob_matches(b, s) for s in names)
    assert globs_meet(a, b) == brute == globs_meet(b, a)


def test_report_says_what_an_mcp_ask_rule_holds(policy: Policy, strict: Policy) -> None:
    from sandgate.review.report import build_report

    def notes(p: Policy, identity: str) -> str:
        (ir,) = [i for i in build_report(p, "t").identities if i.name == identity]
        return " ".join(n for e in ir.entries for n in e.notes)

    assert "not held, only the calls wait for approval" in notes(policy, "agent")
    assert "held too, ask_housekeeping" in notes(strict, "strict")
