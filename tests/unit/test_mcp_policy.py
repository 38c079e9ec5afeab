"""`mcp:` / `jsonrpc:` rules: the loader's checks and decide() on calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.decision import decide
from sandgate.errors import Code
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo
from sandgate.rpc.jsonrpc import Call, Message, method_call, parse, tool_call

POLICY = """
version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
identities:
  agent:
    rules:
      - {name: gh-mcp, hosts: [mcp.example.com], methods: [GET, POST, DELETE], paths: [/mcp],
         mcp: {tools: [list_issues, "get_*"], deny_tools: [delete_repo]},
         inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}}
      - {name: other-mcp, hosts: [mcp.example.com], paths: [/mcp],
         mcp: {tools: ["*"], deny_tools: ["admin_*"]}}
  scoped:
    rules:
      - {name: scoped, hosts: [mcp.example.com], paths: [/mcp],
         mcp: {tools: [list_issues], arguments: {repo: "acme/*"}, prompts: [summary],
               resources: ["file:///docs/*"]}}
  narrow:
    rules:
      - {name: narrow, hosts: [mcp.example.com], paths: [/mcp],
         mcp: {methods: [initialize, "notifications/*", tools/call], tools: [list_issues],
               max_body: 1k}}
  rpc:
    rules:
      - {name: chain, hosts: [rpc.example.com], jsonrpc: {methods: ["eth_get*", eth_call],
         deny_methods: [eth_getLogs]}}
      - {name: plain, hosts: [plain.example.com]}
"""

MCP = RequestInfo("https", "mcp.example.com", 443, "POST", "/mcp")
RPC = RequestInfo("https", "rpc.example.com", 443, "POST", "/")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    d: Path = tmp_path_factory.mktemp("pol")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


def test_the_head_needs_its_call_judged(policy: Policy) -> None:
    d = decide(policy, "agent", MCP)
    assert d.allowed and d.rule_name == "gh-mcp" and d.call_limit == 64 * 1024
    assert decide(policy, "narrow", MCP).call_limit == 1024
    assert decide(policy, "rpc", RequestInfo("https", "plain.example.com", 443, "GET",
                                             "/")).call_limit is None
    assert policy.identities["narrow"].rules[0].max_request_bytes == 1024


@pytest.mark.parametrize(("identity", "call", "allowed", "code", "rule"), [
    ("agent", tool_call("list_issues"), True, None, "gh-mcp"),
    ("agent", tool_call("get_me"), True, None, "gh-mcp"),
    # not in gh-mcp's tools, but other-mcp allows any tool: the first allowing rule wins
    ("agent", tool_call("create_issue"), True, None, "other-mcp"),
    # deny entries win over every allow, in any matching rule
    ("agent", tool_call("delete_repo"), False, Code.DENIED_BY_RULE, "gh-mcp"),
    ("agent", tool_call("admin_panel"), False, Code.DENIED_BY_RULE, "other-mcp"),
    ("agent", method_call("initialize"), True, None, "gh-mcp"),
    ("agent", method_call("notifications/initialized"), True, None, "gh-mcp"),
    ("agent", method_call("resources/read", "file:///x"), False, Code.NO_RULE, None),
    ("scoped", tool_call("list_issues", {"repo": "acme/app"}), True, None, "scoped"),
    ("scoped", tool_call("list_issues", {"repo": "evil/app"}), False, Code.NO_RULE, None),
    ("scoped", tool_call("list_issues", {"repo": 7}), False, Code.NO_RULE, None),
    ("scoped", tool_call("list_issues", {}), False, Code.NO_RULE, None),
    ("scoped", method_call("prompts/get", "summary"), True, None, "scoped"),
    ("scoped", method_call("prompts/get", "other"), False, Code.NO_RULE, None),
    ("scoped", method_call("resources/read", "file:///docs/a/b"), True, None, "scoped"),
    ("narrow", method_call("ping"), False, Code.NO_RULE, None),
    ("narrow", method_call("tools/list"), False, Code.NO_RULE, None),
    ("narrow", tool_call("list_issues"), True, None, "narrow"),
    ("rpc", method_call("eth_getBalance"), True, None, "chain"),
    ("rpc", method_call("eth_getLogs"), False, Code.DENIED_BY_RULE, "chain"),
    ("rpc", method_call("eth_sendTransaction"), False, Code.NO_RULE, None),
])
def test_calls(policy: Policy, identity: str, call: Call, allowed: bool, code: Code | None,
               rule: str | None) -> None:
    d = decide(policy, identity, RPC if identity == "rpc" else MCP, call)
    assert (d.allowed, d.code, d.rule_name) == (allowed, code, rule), d.reason
    assert d.call_limit is None
    if not allowed:
        assert d.reason.startswith(f"{call.messages[0].shown} is not permitted for {identity}")
        assert d.hint


def test_the_refusal_names_the_tool_and_identity(policy: Policy) -> None:
    d = decide(policy, "agent", MCP, tool_call("delete_repo"))
    assert d.reason == ("tool delete_repo is not permitted for agent: deny_tools lists "
                        "'delete_repo' in rule 'gh-mcp'")


def test_one_denied_entry_refuses_the_batch(policy: Policy) -> None:
    call = parse(b'[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get_me"}},'
                 b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":'
                 b'{"name":"delete_repo"}}]')
    d = decide(policy, "agent", MCP, call)
    assert not d.allowed and d.code == Code.DENIED_BY_RULE and "delete_repo" in d.reason
    assert decide(policy, "agent", MCP, Call(call.messages[:1], batch=True)).allowed


def test_a_client_response_is_not_a_call(policy: Policy) -> None:
    assert decide(policy, "narrow", MCP, Call((Message("response", id=3),))).allowed


BROKEN: list[tuple[str, str, str]] = [
    ("{name: r, action: deny, hosts: [h.example], mcp: {tools: [x]}}", "rules[0].mcp",
     "deny rule cannot have `mcp:`"),
    ("{name: r, hosts: [h.example], mcp: {}, jsonrpc: {}}", "rules[0].jsonrpc",
     "either `mcp:` or `jsonrpc:`"),
    ("{name: r, hosts: [h.example], mcp: {max_body: 17m}}", "rules[0].mcp.max_body",
     "between 1 byte and 16m"),
    ("{name: r, hosts: [h.example], mcp: {methods: [ping], tools: [x]}}", "rules[0].mcp.tools",
     "has no effect"),
    ("{name: r, hosts: [h.example], mcp: {tools: [' x']}}", "rules[0].mcp.tools[0]",
     "not a name or glob"),
    ("{name: r, hosts: [h.example], passthrough: true, mcp: {}}", "rules[0].passthrough",
     "mcp"),
    ("{name: r, hosts: [h.example], mcp: {tool: [x]}}", "rules[0].mcp.tool", ""),
]


@pytest.mark.parametrize(("rule", "field", "fragment"), BROKEN)
def test_loader_errors_are_located(tmp_path: Path, rule: str, field: str,
                                   fragment: str) -> None:
    text = f"version: v1\nidentities:\n  a:\n    rules:\n      - {rule}\n"
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    problems = [p for p in ei.value.problems if p.field == f"identities.a.{field}"]
    assert problems, [str(p) for p in ei.value.problems]
    assert fragment in problems[0].message and problems[0].line == 5


@pytest.mark.parametrize(("fixture", "fragment"), [
    ("mcp: {tool: x, method: ping}", "exactly one"),
    ("mcp: {method: tools/call}", "tools/call is written"),
    ("mcp: {method: prompts/get}", "needs `name`"),
])
def test_fixture_call_errors(tmp_path: Path, fixture: str, fragment: str) -> None:
    text: Any = ("version: v1\nidentities:\n  a:\n    rules:\n      - {name: r, hosts: "
                 "[h.example], mcp: {}}\ntests:\n  - {identity: a, request: POST "
                 f"https://h.example/mcp, expect: allow, {fixture}}}\n")
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    assert any(fragment in p.message for p in ei.value.problems), ei.value.problems


# --- narrower_than over tool sets (sandgate.review.callproofs) --------------------------------

PAIR = """
version: v1
identities:
  agent:
    rules:
      - {{name: gh, hosts: [mcp.example.com], paths: [/mcp], mcp: {agent}}}
  bash-tool:
    narrower_than: agent
    rules:
      - {{name: gh, hosts: [mcp.example.com], paths: [/mcp], mcp: {bash}}}
"""


@pytest.mark.parametrize(("agent", "bash", "counter"), [
    ('{tools: [list_issues, "get_*"]}', "{tools: [list_issues, get_me]}", None),
    ('{tools: [list_issues, "get_*"]}', '{tools: ["get_*", create_issue]}',
     "tool create_issue"),
    ('{tools: ["*"], deny_tools: ["*_repo"]}', '{tools: ["*"]}', "tool _repo"),
    ('{tools: ["get_*"]}', '{tools: ["*_me"]}', "tool _me"),
    ("{tools: [a], arguments: {repo: 'acme/*'}}", "{tools: [a]}", "tool a"),
    ("{tools: [a], arguments: {repo: 'acme/*'}}", "{tools: [a], arguments: {repo: 'acme/x*'}}",
     None),
    ("{methods: [initialize, tools/call]}", "{}", "method notifications/"),
    ("{prompts: ['s*']}", "{prompts: [summary]}", None),
    ("{}", "{prompts: [summary]}", "prompt summary"),
    # the other judges calls and refuses a body that is none; the narrow one reads no body
    ("{methods: ['*']}", None, "a body that is not a JSON-RPC call"),
])
def test_narrower_than_covers_tool_sets(tmp_path: Path, agent: str, bash: str | None,
                                        counter: str | None) -> None:
    from sandgate.review.proofs import prove

    text = PAIR.format(agent=agent, bash=bash or "{}")
    if bash is None:  # a rule without mcp: (its body limit the same as the other's)
        text = text.replace(", mcp: {}}\n", ", max_request_bytes: 64k}\n")
    (tmp_path / "p.yaml").write_text(text)
    (result,) = prove(load_policy_dir(tmp_path))
    assert result.ok == (counter is None), str(result)
    if counter is not None:
        assert result.counterexample is not None and counter in result.counterexample, result


@given(st.lists(st.text("ab*?", min_size=1, max_size=4), min_size=1, max_size=3),
       st.text("abc", min_size=1, max_size=6))
def test_glob_witnesses_realise_every_match_vector(patterns: list[str], text: str) -> None:
    from sandgate.policy.model import glob_matches
    from sandgate.review.callproofs import glob_witnesses

    witnesses = glob_witnesses(patterns)
    assert witnesses is not None

    def vec(s: str) -> tuple[bool, ...]:
        return tuple(glob_matches(p, s) for p in patterns)

    assert vec(text) in {vec(w) for w in witnesses}


def test_lint_warns_on_tool_globs_the_server_does_not_list(tmp_path: Path) -> None:
    from sandgate.review.lint import lint_dir

    (tmp_path / "pol").mkdir()
    (tmp_path / "pol" / "p.yaml").write_text(POLICY)
    listing = tmp_path / "tools.json"
    listing.write_text('{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": '
                       '"list_issues"}, {"name": "get_me"}, {"name": "delete_repository"}]}}')
    everything = lint_dir(tmp_path / "pol", [f"mcp.example.com={listing}"])
    # the second rule's tools: ["*"] makes the first's list restrict nothing (issue 38)
    assert [f.field for f in everything if f.code == "mcp-tools-any"] == [
        "identities.agent.rules[1].mcp.tools"]
    found = [f for f in everything if ".mcp." in f.field and f.code != "mcp-tools-any"]
    fields = sorted(f.field for f in found)
    assert fields == ["identities.agent.rules[0].mcp.deny_tools[0]",
                      "identities.agent.rules[1].mcp.deny_tools[0]"]  # delete_repo, admin_*
    assert "refuses nothing" in found[0].message and "delete_repository" in found[0].fix
    assert not [f for f in lint_dir(tmp_path / "pol", [f"other.example={listing}"])
                if ".mcp." in f.field and f.code != "mcp-tools-any"]  # another host's listing
    listing.write_text('{"tools": 3}')
    with pytest.raises(ValueError, match="not a tools/list answer"):
        lint_dir(tmp_path / "pol", [str(listing)])


def test_the_documented_example_checks_proves_and_lints_clean() -> None:
    from sandgate.policy.fixtures import run_policy_tests
    from sandgate.review.lint import lint_dir
    from sandgate.review.proofs import prove

    example = Path(__file__).parents[2] / "docs" / "examples" / "mcp"
    policy = load_policy_dir(example)
    assert all(r.passed for r in run_policy_tests(policy))
    assert [str(r) for r in prove(policy)] == [
        "proof ok: mcp-bash-tool narrower than mcp-agent",
        "proof ok: secret github-mcp only to mcp.example.com"]
    assert lint_dir(example) == []


def test_diff_replays_the_recorded_calls(tmp_path: Path) -> None:
    import json

    from sandgate.review.traffic import diff, read_audit

    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old_dir.mkdir()
    new_dir.mkdir()
    (old_dir / "p.yaml").write_text(POLICY)
    (new_dir / "p.yaml").write_text(POLICY.replace('deny_tools: ["admin_*"]',
                                                   'deny_tools: ["admin_*", "create_*"]'))
    event = {"event": "request", "identity": "agent", "method": "POST", "scheme": "https",
             "host": "mcp.example.com", "port": 443, "path": "/mcp", "decision": "allow",
             "secrets": [], "rpc": [{"kind": "request", "method": "tools/call", "id": 1,
                                     "tool": "create_issue", "decision": "allow"}]}
    plain = {**event, "rpc": [{"kind": "request", "method": "tools/call", "id": 2,
                               "tool": "get_me", "decision": "allow"}]}
    traffic = read_audit([json.dumps(event), json.dumps(plain), json.dumps({**event,
                                                                              "rpc": 3})])
    assert [u.reason for u in traffic.unreplayable] == [
        "invalid field: rpc (not a list of calls)"]
    res = diff(load_policy_dir(old_dir), load_policy_dir(new_dir), traffic)
    (change,) = res.changes
    assert change.request.endswith("[tool create_issue]") and change.kinds[0] == "allow->deny"
    assert res.unchanged == 1


@pytest.mark.parametrize(("tool", "args", "method", "error"), [
    ("a", None, "ping", "not both"),
    (None, "{}", None, "goes with"),
    ("a", "[1]", None, "must be a JSON object"),
    ("a", "{x", None, "not JSON"),
    ("", None, None, "non-empty"),
])
def test_explain_call_options_are_checked(tool: str | None, args: str | None,
                                          method: str | None, error: str) -> None:
    import argparse

    from sandgate.rpc.call_cli import call_from_args

    with pytest.raises(ValueError, match=error):
        call_from_args(argparse.Namespace(mcp_tool=tool, mcp_args=args, rpc_method=method,
                                          mcp_resource=None))


def test_explain_judges_the_call_as_the_proxy_does(policy: Policy) -> None:
    import argparse

    from sandgate.explain.answer import explain
    from sandgate.rpc.call_cli import call_from_args, call_from_values

    ns = argparse.Namespace(mcp_tool="list_issues", mcp_args=None, rpc_method=None,
                            mcp_resource=None)
    out, allowed = explain(policy, "scoped", "POST", "https://mcp.example.com/mcp",
                           call=call_from_args(ns))
    assert not allowed and "argument repo is missing" in out["reason"]  # {} as the proxy sees
    out, allowed = explain(policy, "scoped", "POST", "https://mcp.example.com/mcp",
                           call=call_from_values("list_issues", {"repo": "acme/a"}, None))
    assert allowed and out["call"] == "tool list_issues"
    assert out["mcp"]["arguments"] == {"repo": "acme/*"}
    with pytest.raises(ValueError, match="mcp_args must be a JSON object"):
        call_from_values("a", [1], None)


GATEWAY_POLICY = """\
version: v1
secrets:
  gh: {vault: "secret/data/sandboxes/{{ sandbox }}/mcp", field: token}
identities:
  agent:
    rules:
      - {name: gh-mcp, hosts: [mcp.example.com], methods: [POST], paths: [/mcp],
         mcp: {tools: ['get_*'], deny_tools: [delete_repo]},
         inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}}
      - {name: pt, hosts: [tunnel.example.com], passthrough: true}
gateways:
  - {prefix: /gh, upstream: https://mcp.example.com, token_header: x-api-key}
"""


@pytest.mark.parametrize(("extra", "decision", "code"), [
    (["--sandbox", "sb1", "--mcp-tool", "get_issue"], "allow", None),
    (["--mcp-tool", "get_issue"], "deny", "sandbox_required"),  # the sandbox step still runs
    (["--sandbox", "sb1", "--mcp-tool", "delete_repo"], "deny", "denied_by_rule"),
    (["--sandbox", "sb1", "--mcp-tool", "create_issue"], "deny", "no_rule"),
])
def test_explain_call_with_gateway_and_sandbox(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               extra: list[str], decision: str,
                                               code: str | None) -> None:
    """--mcp-tool goes with --gateway and --sandbox: one judgement, as the gateway does it."""
    import json

    from sandgate.cli import main

    (tmp_path / "p.yaml").write_text(GATEWAY_POLICY)
    rc = main(["explain", "--policies", str(tmp_path), "--identity", "agent", "--gateway",
               *extra, "POST", "/gh/mcp"])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["decision"], doc["code"]) == (decision, code), doc
    assert doc["gateway"] == "/gh" and doc["call"].startswith("tool ")
    assert rc == (0 if decision == "allow" else 1)


def test_explain_call_inside_a_passthrough_tunnel_is_never_seen(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from sandgate.cli import main

    (tmp_path / "p.yaml").write_text(GATEWAY_POLICY)
    rc = main(["explain", "--policies", str(tmp_path), "--identity", "agent", "--mcp-tool",
               "delete_repo", "POST", "https://tunnel.example.com/mcp"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["decision"] == "tunnel"
    assert "the proxy never sees the body" in doc["call"]
