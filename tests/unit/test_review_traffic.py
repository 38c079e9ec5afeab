"""`sandgate diff`: recorded traffic replayed against an old and a new policy.

The audit log is written by sandgate.audit.events.AuditLog with flow_fields' fields (tests/unit/
audit_log.py). The new policy plants exactly four flips (a removed method, a narrowed path, an
added deny rule, a changed injecting rule) among an unchanged majority; diff must report those
four and nothing else, and account for every line it could not replay.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sandgate.policy.loader import load_policy_dir
from sandgate.review.traffic import diff, format_diff, read_audit
from tests.support.cli import run_cli
from tests.unit.audit_log import Recorder

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]

OLD = """\
version: v1
secrets:
  anthropic: {vault: secret/data/llm/anthropic, field: api_key}
  anthropic-batch: {vault: secret/data/llm/anthropic-batch, field: api_key}
identities:
  agent:
    rules:
      - name: llm
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
      - name: repo
        hosts: [api.github.com]
        methods: [GET, DELETE]
        paths: [/repos/**]
      - name: packages
        hosts: [pypi.org, files.pythonhosted.org]
        methods: [GET]
  tool:
    rules:
      - {name: docs, hosts: [docs.python.org], methods: [GET]}
"""

NEW = (OLD
       # 1. a removed method
       .replace("methods: [GET, DELETE]", "methods: [GET]")
       # 2. a narrowed path
       .replace("        hosts: [pypi.org, files.pythonhosted.org]\n        methods: [GET]\n",
                "        hosts: [pypi.org, files.pythonhosted.org]\n        methods: [GET]\n"
                "        paths: [/simple/**, /packages/**]\n")
       # 3. an added deny
       .replace("      - {name: docs, hosts: [docs.python.org], methods: [GET]}\n",
                "      - {name: docs, hosts: [docs.python.org], methods: [GET]}\n"
                "      - {name: no-py2, action: deny, hosts: [docs.python.org], "
                "paths: ['/2/**']}\n")
       # 4. a changed injecting rule
       .replace('"{{ secrets.anthropic }}"', '"{{ secrets.anthropic-batch }}"'))


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "p.yaml").write_text(OLD)
    (new / "p.yaml").write_text(NEW)
    assert OLD != NEW and NEW.count("no-py2") == 1 and "/simple/**" in NEW
    return old, new


def _recording() -> Recorder:
    r = Recorder()
    r.event("policy", outcome="ok", trigger="start", version="abc", previous=None, files=[])
    # The unchanged majority.
    r.connect("agent", "api.anthropic.com:443", rule="llm")
    r.request("agent", "GET", "https://api.github.com/repos/o/r/issues?state=open&page=2", n=20,
              rule="repo")
    r.request("agent", "GET", "https://pypi.org/simple/requests/", n=15, rule="packages")
    r.request("agent", "GET", "https://files.pythonhosted.org/packages/ab/requests.whl", n=10,
              rule="packages")
    r.request("tool", "GET", "https://docs.python.org/3/library/json.html", n=12, rule="docs")
    r.request("tool", "POST", "https://docs.python.org/3/", decision="deny", code="no_rule")
    r.request("agent", "GET", "https://evil.example/x", decision="deny", code="no_rule")
    # The flips.
    r.request("agent", "DELETE", "https://api.github.com/repos/o/r", n=2, rule="repo")
    r.request("agent", "GET", "https://pypi.org/project/requests/", n=3, rule="packages")
    r.request("tool", "GET", "https://docs.python.org/2/library/", n=1, rule="docs")
    r.request("agent", "POST", "https://api.anthropic.com/v1/messages?beta=true", n=7,
              rule="llm", secrets=["anthropic@4"])
    # What cannot be replayed: counted and reported, never dropped.
    r.request(None, "GET", "https://pypi.org/simple/", decision="deny", code="auth_required")
    r.raw('{"event": "request", "identity": "agent", "method": "GET"')  # cut off
    r.raw('{"time": "t", "event": "request", "identity": "agent", "method": "GET", '
          '"scheme": "https", "host": "pypi.org", "port": "443", "path": "/"}')  # port a string
    r.raw('{"time": "t", "event": "request", "identity": "agent", "method": "GET", '
          '"scheme": "https", "host": "exa mple.com", "port": 443, "path": "/"}')  # bad host
    r.event("shutdown", drained=0, unfinished=0)
    return r


def test_diff_finds_the_planted_flips_and_nothing_else(tmp_path):
    old, new = _dirs(tmp_path)
    traffic = read_audit(_recording().text().splitlines(), "audit.jsonl")
    res = diff(load_policy_dir(old), load_policy_dir(new), traffic)
    got = {(c.kinds, c.identity, c.request, c.count, str(c.old), str(c.new))
           for c in res.changes}
    assert got == {
        (("allow->deny", "rule changed"), "agent", "DELETE https://api.github.com:443/repos/o/r",
         2, "allow by rule 'repo'", "deny (no_rule)"),
        (("allow->deny", "rule changed"), "agent", "GET https://pypi.org:443/project/requests/",
         3, "allow by rule 'packages'", "deny (no_rule)"),
        (("allow->deny", "rule changed"), "tool", "GET https://docs.python.org:443/2/library/",
         1, "allow by rule 'docs'", "deny by rule 'no-py2' (denied_by_rule)"),
        (("secrets changed",), "agent", "POST https://api.anthropic.com:443/v1/messages", 7,
         "allow by rule 'llm', injects anthropic", "allow by rule 'llm', injects anthropic-batch"),
    }
    assert res.changed == 13
    assert res.unchanged == 1 + 20 + 15 + 10 + 12 + 1 + 1
    assert res.replayed == res.changed + res.unchanged
    assert res.kind_counts() == {"allow->deny": 6, "rule changed": 6, "secrets changed": 7}
    # Every unreplayable line is accounted for, with its line number and why.
    reasons = {u.line: u.reason for u in res.unreplayable}
    assert len(reasons) == 4, reasons
    assert any("identity" in r and "before the caller was identified" in r
               for r in reasons.values())
    assert any(r.startswith("not JSON") for r in reasons.values())
    assert any("port" in r for r in reasons.values())
    assert any("cannot be parsed" in r for r in reasons.values())
    assert dict(res.other_events) == {"policy": 1, "shutdown": 1}
    text = format_diff(res, "old", "new")
    assert "4 not replayable" in text and "13 changed (4 distinct" in text


def test_diff_of_a_policy_with_itself_changes_nothing(tmp_path):
    old, _new = _dirs(tmp_path)
    traffic = read_audit(_recording().text().splitlines())
    pol = load_policy_dir(old)
    res = diff(pol, pol, traffic)
    assert res.changes == [] and res.replayed == res.unchanged > 0


def test_diff_code_changed_and_report_mode(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    base = ("version: v1\nidentities:\n  a:\n{mode}    rules:\n"
            "      - {{name: site, hosts: [example.com], methods: [GET]}}\n{deny}"
            "  b:\n    rules:\n"
            "      - {{name: site, hosts: [example.com], methods: [GET]}}\n{deny}")
    (old / "p.yaml").write_text(base.format(mode="", deny=""))
    (new / "p.yaml").write_text(base.format(
        mode="    mode: report\n",
        deny="      - {name: no-admin, action: deny, hosts: [example.com], paths: ['/admin']}\n"))
    r = Recorder()
    r.request("a", "POST", "https://example.com/x", decision="deny", code="no_rule")
    r.request("a", "GET", "https://example.com/admin", rule="site")
    r.request("b", "POST", "https://example.com/admin", decision="deny", code="no_rule")
    res = diff(load_policy_dir(old), load_policy_dir(new), read_audit(r.text().splitlines()))
    kinds = {(c.identity, c.request): c.kinds for c in res.changes}
    assert kinds == {
        ("a", "POST https://example.com:443/x"): ("deny->report",),
        ("a", "GET https://example.com:443/admin"): ("allow->report", "rule changed"),
        ("b", "POST https://example.com:443/admin"): ("rule changed", "code changed"),
    }


def test_diff_resolve_runs_the_address_step(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    rule = "      - {{name: db, hosts: [db.example.com], methods: [GET]{extra}}}\n"
    head = "version: v1\nidentities:\n  a:\n    rules:\n"
    (old / "p.yaml").write_text(head + rule.format(extra=", private_cidrs: [10.0.0.0/8]"))
    (new / "p.yaml").write_text(head + rule.format(extra=""))
    r = Recorder()
    r.request("a", "GET", "https://db.example.com/x", rule="db", dialed="10.1.1.1:443")
    traffic = read_audit(r.text().splitlines())
    po, pn = load_policy_dir(old), load_policy_dir(new)
    assert diff(po, pn, traffic).changes == []  # names are resolved at request time
    res = diff(po, pn, traffic, {"db.example.com": "10.1.1.1"})
    assert [(c.kinds, c.new.code) for c in res.changes] == [
        (("allow->deny",), "internal_address")]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=ROOT, stdin=stdin)


def test_diff_cli_text_json_and_exit_codes(tmp_path):
    old, new = _dirs(tmp_path)
    log = tmp_path / "audit.jsonl"
    log.write_text(_recording().text())
    r = _cli("diff", str(old), str(new), "--traffic", str(log))
    assert r.returncode == 1, r.stderr
    assert "allow->deny + rule changed  x2  agent  DELETE https://api.github.com:443/repos/o/r" \
        in r.stdout
    assert "not replayable: " in r.stdout
    r = _cli("diff", str(old), str(new), "--traffic", str(log), "--format", "json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["changed"] == 13 and doc["distinct_changes"] == 4
    assert doc["not_replayable"] == 4 and len(doc["not_replayable_events"]) == 4
    r = _cli("diff", str(old), str(old), "--traffic", "-", "--format", "json",
             stdin=_recording().text())
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["changes"] == []
    r = _cli("diff", str(old), str(tmp_path / "missing"), "--traffic", str(log))
    assert r.returncode == 2


# --- explain --batch ---------------------------------------------------------------------------


BATCH = """\
# identity method url
coding-agent POST https://api.anthropic.com/v1/messages
coding-agent GET https://pypi.org/simple/requests/   # trailing comment

bash-tool POST https://api.anthropic.com/v1/messages
bash-tool GET
web-fetch GET not-a-url
bash-tool CONNECT pypi.org:443
"""


def test_explain_batch_one_json_object_per_request_line(tmp_path):
    f = tmp_path / "batch.txt"
    f.write_text(BATCH)
    r = _cli("explain", "--policies", "policies", "--batch", str(f))
    assert r.returncode == 1, r.stderr
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [d["line"] for d in docs] == [2, 3, 5, 6, 7, 8]
    by_line = {d["line"]: d for d in docs}
    assert by_line[2]["decision"] == "allow" and by_line[2]["rule"] == "anthropic"
    assert by_line[3]["decision"] == "allow"
    assert by_line[5]["decision"] == "deny" and by_line[5]["code"] == "no_rule"
    assert "error" in by_line[6] and "error" in by_line[7]
    assert by_line[8]["request"] == "CONNECT pypi.org:443" and by_line[8]["passthrough"] is False
    # The same fields as a single explain.
    single = _cli("explain", "--policies", "policies", "--identity", "coding-agent", "POST",
                  "https://api.anthropic.com/v1/messages")
    assert {k: v for k, v in by_line[2].items() if k != "line"} == json.loads(single.stdout)
    assert f"{f}:6: malformed" in r.stderr and f"{f}:7: malformed" in r.stderr


def test_explain_batch_exit_codes(tmp_path):
    ok = "coding-agent POST https://api.anthropic.com/v1/messages\n# nothing else\n"
    r = _cli("explain", "--policies", "policies", "--batch", "-", stdin=ok)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) == 1
    r = _cli("explain", "--policies", "policies", "--batch", "-",
             stdin=ok + "coding-agent GET https://example.com/\n")
    assert r.returncode == 1
    r = _cli("explain", "--policies", "policies", "--batch", "-", stdin="a GET\n")
    assert r.returncode == 1 and "-:1: malformed" in r.stderr
    r = _cli("explain", "--policies", "policies", "--batch", "-", "--identity", "x", stdin=ok)
    assert r.returncode == 2
    r = _cli("explain", "--policies", "policies")
    assert r.returncode == 2 and "--identity" in r.stderr


CALLS = ROOT / "tests" / "integration" / "policies_differential_calls"


def _batch(lines: list[str], tmp_path: Path, sandbox: str | None = None
           ) -> tuple[int, list[dict], str]:
    import io

    from sandgate.cli.traffic import explain_batch

    out, err = io.StringIO(), io.StringIO()
    rc = explain_batch(load_policy_dir(CALLS), iter(lines), {}, out, err, "b.jsonl", sandbox,
                       base=tmp_path)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue()


def _tool(name: str, args: dict, id: int = 1) -> dict:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": args}}


def test_explain_batch_json_lines_carry_what_the_proxy_judges(tmp_path):
    """issue 38: a batch line could not carry a sandbox, a call, a body, a batch, a resource
    URI, MCP headers or a DNS name (tests/integration/test_differential_calls.py runs these
    against a proxy)."""
    mcp = "https://mcp.dc.test/mcp"
    (tmp_path / "call.json").write_text(json.dumps(_tool("delete_repo", {"repo": "acme/x"})))
    lines = [json.dumps(d) + "\n" for d in [
        {"identity": "agent", "method": "POST", "url": mcp,
         "body": _tool("get_issue", {"repo": "acme/x"})},
        {"identity": "agent", "method": "POST", "url": mcp, "mcp_tool": "get_issue",
         "mcp_args": {"repo": "other/x"}},
        {"identity": "agent", "method": "POST", "url": mcp, "body_file": "call.json"},
        {"identity": "agent", "method": "POST", "url": mcp, "mcp_resource": "file:///etc/x"},
        {"identity": "agent", "method": "POST", "url": mcp,
         "body": [_tool("get_issue", {"repo": "acme/x"}), _tool("get_me", {"repo": "a"}, 2)]},
        {"identity": "agent", "method": "POST", "url": mcp, "body": "not json"},
        {"identity": "agent", "method": "POST", "url": mcp, "body": _tool("get_me", {}),
         "headers": {"Mcp-Method": "ping"}},
        {"identity": "agent", "method": "POST", "url": "https://rpc.dc.test/rpc",
         "rpc_method": "eth_blockNumber"},
        {"identity": "agent", "sandbox": "sb-1", "method": "POST",
         "url": "https://rpc.dc.test/rpc", "rpc_method": "eth_blockNumber"},
        {"identity": "agent", "dns": "txt.dc.test", "type": "TXT"},
        {"identity": "tool", "dns": "txt.dc.test", "type": "TXT"},
    ]] + ["agent POST https://api.dc.test/x\n"]  # the positional form still works
    rc, docs, err = _batch(lines, tmp_path)
    assert rc == 1 and not err, err
    got = [(d["decision"], d["code"]) for d in docs]
    assert got == [
        ("allow", None), ("deny", "no_rule"), ("deny", "denied_by_rule"), ("deny", "no_rule"),
        ("deny", "no_rule"), ("deny", "bad_request"), ("deny", "header_mismatch"),
        ("deny", "sandbox_required"), ("allow", None), ("resolve", None), ("refuse", "no_rule"),
        ("allow", None)]
    assert docs[0]["call"] == "tool get_issue" and docs[2]["call"] == "tool delete_repo"
    assert docs[4]["call"].startswith("batch") and docs[9]["type"] == "TXT"


@pytest.mark.parametrize(("line", "error"), [
    ('{"identity": "agent", "method": "POST", "url": "https://a.test/", "bodyy": "x"}',
     "unknown field(s) bodyy"),
    ('{"method": "GET", "url": "https://a.test/"}', '"identity" is required'),
    ('{"identity": "agent", "url": "https://a.test/"}', '"method" and "url" are required'),
    ('{"identity": "agent", "identity": "tool", "method": "GET", "url": "https://a.test/"}',
     "repeats the key"),
    ('{"identity": "agent", "method": "POST", "url": "https://a.test/", "body": "x", '
     '"mcp_tool": "t"}', "not both"),
    ('{"identity": "agent", "method": "POST", "url": "https://a.test/", "body": "x", '
     '"body_file": "f"}', "not both"),
    ('{"identity": "agent", "method": "POST", "url": "https://a.test/", "body_file": "nope"}',
     "body_file nope"),
    ('{"identity": "agent", "dns": "a.test", "method": "GET"}', "a name query"),
    ('{"identity": "agent", "method": "GET", "url": "https://a.test/", "type": "A"}',
     "goes with"),
    ('{"identity": "agent", "dns": "a.test", "type": "BOGUS"}', ""),
    ('{"identity": "agent", "method": "GET", "url": "https://a.test/", "sandbox": 1}',
     '"sandbox" must be'),
    ('{"identity": "agent", "method": "GET", "url": "https://a.test/", "headers": {"a": 1}}',
     "header 'a'"),
    ("[1, 2]", "malformed"),
    ('{"identity": "agent"', "not valid JSON"),
])
def test_explain_batch_json_line_errors_say_what_is_wrong(tmp_path, line, error):
    rc, docs, err = _batch([line + "\n"], tmp_path)
    assert rc == 1 and "b.jsonl:1: malformed" in err and error in err, err
    assert docs[0]["input"] == line


def test_explain_batch_sandbox_default_and_override(tmp_path):
    rpc = {"identity": "agent", "method": "POST", "url": "https://rpc.dc.test/rpc",
           "rpc_method": "eth_blockNumber"}
    lines = [json.dumps(rpc), json.dumps({**rpc, "sandbox": None}), "agent POST "
             "https://rpc.dc.test/rpc"]
    _, docs, _ = _batch(lines, tmp_path, sandbox="sb-1")
    assert [(d["sandbox"], d["decision"]) for d in docs] == [
        ("sb-1", "allow"), (None, "deny"), ("sb-1", "allow")]


def test_one_explain_takes_the_body_and_the_resource(tmp_path, capsys):
    """The single explain reads the same inputs as a batch line: --body-file (the body as
    sent), --mcp-resource, and -H MCP headers checked against the call however it is given."""
    from sandgate.cli import main

    mcp = "https://mcp.dc.test/mcp"
    base = ["explain", "--policies", str(CALLS), "--identity", "agent"]
    body = tmp_path / "b.json"
    body.write_text(json.dumps([_tool("get_issue", {"repo": "acme/x"}),
                                _tool("delete_repo", {"repo": "acme/x"}, 2)]))
    assert main([*base, "--body-file", str(body), "POST", mcp]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["code"] == "denied_by_rule" and doc["call"].startswith("batch")
    assert main([*base, "--mcp-resource", "file:///projects/a", "POST", mcp]) == 0
    assert json.loads(capsys.readouterr().out)["call"] == "resource file:///projects/a"
    assert main([*base, "--mcp-tool", "get_issue", "--mcp-args", '{"repo": "acme/x"}',
                 "-H", "Mcp-Name: get_me", "POST", mcp]) == 1
    assert json.loads(capsys.readouterr().out)["code"] == "header_mismatch"
    assert main([*base, "--body-file", str(body), "--rpc-method", "ping", "POST", mcp]) == 2
    assert "not both" in capsys.readouterr().err


def test_diff_replays_a_websocket_as_one(tmp_path):
    """A recorded upgrade (`websocket: true`) is judged as an upgrade: an `llm:` rule that
    loses `websocket: true` refuses it (upgrade_refused), as the proxy would."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    rule = ("version: v1\nidentities:\n  a:\n    rules:\n"
            "      - {{name: ws, hosts: [api.openai.com], methods: [GET], "
            "paths: [/v1/responses], {ws}llm: {{api: openai}}}}\n")
    (old / "p.yaml").write_text(rule.format(ws="websocket: true, "))
    (new / "p.yaml").write_text(rule.format(ws=""))
    r = Recorder()
    r.request("a", "GET", "https://api.openai.com/v1/responses", rule="ws", websocket=True)
    r.request("a", "GET", "https://api.openai.com/v1/responses", rule="ws")
    traffic = read_audit(r.text().splitlines())
    assert [rec.websocket for rec in traffic.recorded] == [True, False]
    res = diff(load_policy_dir(old), load_policy_dir(new), traffic)
    assert [(c.request, c.kinds) for c in res.changes] == [
        ("GET https://api.openai.com:443/v1/responses (WebSocket)", ("allow->deny",))]
    (change,) = res.changes
    assert change.new.code == "upgrade_refused"
