"""`sandgate diff OLD NEW` (the reach diff, no traffic), `sandgate report`, and the audit's kept
query values that `diff --traffic` replays."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from sandgate.audit.events import redact_path
from sandgate.cli import main as cli_main
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.query_audit import query_names
from sandgate.review.reach_diff import reach_diff
from sandgate.review.traffic import diff, read_audit

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]

BASE = """version: v1
secrets:
  git: {vault: secret/data/git, field: token}
  gw: {vault: secret/data/gw, field: token}
identities:
  agent:
    rules:
      - name: git-refs
        hosts: [github.com]
        methods: [GET]
        paths: ["/*/*.git/info/refs"]
        query: {service: [git-upload-pack]}
        inject: {basic: {username: x, password: "{{ secrets.git }}"}}
      - {name: docs, hosts: [docs.python.org], methods: [GET], paths: [/3/**]}
      - {name: api, hosts: [api.example.com], methods: [GET], substitute: [gw]}
"""


def _dirs(tmp_path: Path, old: str, new: str) -> tuple[Path, Path]:
    o, n = tmp_path / "old", tmp_path / "new"
    for d, text in ((o, old), (n, new)):
        d.mkdir()
        (d / "p.yaml").write_text(text)
    return o, n


def _changes(tmp_path: Path, new: str, old: str = BASE):
    o, n = _dirs(tmp_path, old, new)
    return reach_diff(load_policy_dir(o), load_policy_dir(n))


# (id, edit of BASE, expected kind, widened, substring of the change's summary)
CASES = [
    ("query-value", ("[git-upload-pack]", "[git-upload-pack, git-receive-pack]"),
     "reachable", True, "with query service=git-receive-pack"),
    ("method", ("methods: [GET], paths: [/3/**]", "methods: [GET, POST], paths: [/3/**]"),
     "reachable", True, "POST https://docs.python.org:443"),
    ("path-narrowed", ("paths: [/3/**]", "paths: [/3/library/**]"),
     "unreachable", False, "docs.python.org"),
    ("port", ("hosts: [docs.python.org],", "hosts: [docs.python.org], ports: [443, 8443],"),
     "reachable", True, "docs.python.org:8443"),
    ("secret-added", ("substitute: [gw]", "substitute: [gw, git]"),
     "changed", True, "secrets gw -> git, gw"),
    ("host-wildcard", ("hosts: [api.example.com]", "hosts: ['*.example.com']"),
     "reachable", True, "*.example.com"),
    ("passthrough", ("      - {name: api,", "      - {name: db, hosts: [db.example.com], "
                     "ports: [5432], passthrough: true}\n      - {name: api,"),
     "passthrough", True, "tunnelled uninspected"),
    ("mode-report", ("  agent:\n", "  agent:\n    mode: report\n"),
     "mode", True, "mode enforce -> report"),
]


@pytest.mark.parametrize(("edit", "kind", "widened", "text"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_reach_diff_finds_each_change(tmp_path, edit, kind, widened, text):
    assert edit[0] in BASE
    d = _changes(tmp_path, BASE.replace(*edit))
    hits = [c for c in d.changes if c.kind == kind and text in c.summary()]
    assert hits, [c.summary() for c in d.changes]
    assert all(c.widened == widened for c in hits)
    assert d.widened == widened


def test_reach_diff_same_reach_despite_rewrites(tmp_path):
    # renamed rules, reordered hosts, split rules: the same reach is no change
    new = BASE.replace("name: docs", "name: python-docs").replace(
        "      - {name: api, hosts: [api.example.com], methods: [GET], substitute: [gw]}\n",
        "      - {name: api, hosts: [api.example.com], methods: [GET], paths: [/v1/**], "
        "substitute: [gw]}\n      - {name: api2, hosts: [api.example.com], methods: [GET], "
        "substitute: [gw]}\n")
    assert _changes(tmp_path, new).changes == []


def test_reach_diff_cli_formats_and_exit_status(tmp_path):
    o, n = _dirs(tmp_path, BASE, BASE.replace("[git-upload-pack]",
                                              "[git-upload-pack, git-receive-pack]"))

    def run(*argv: str) -> tuple[int, str]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main(list(argv))
        return rc, buf.getvalue()

    rc, text = run("diff", str(o), str(n))
    assert rc == 1 and "service=git-receive-pack" in text and "+ GET https://github.com" in text
    rc, md = run("diff", "--format", "markdown", str(o), str(n))
    assert rc == 1 and md.startswith("## Sandgate reach diff") and "| :heavy_plus_sign: |" in md
    rc, js = run("diff", "--format", "json", str(o), str(n))
    doc = json.loads(js)
    assert doc["widened"] and doc["changes"][0]["query"] == "service=git-receive-pack"
    # narrowing only: 0, unless --fail-on-narrowing
    assert run("diff", str(n), str(o))[0] == 0
    assert run("diff", "--fail-on-narrowing", str(n), str(o))[0] == 1
    rc, text = run("diff", str(o), str(o))
    assert rc == 0 and "no change of reach" in text
    assert run("diff", "--format", "markdown", "--traffic", "-", str(o), str(n))[0] == 2


def test_shipped_policies_have_no_reach_change_against_themselves():
    p = load_policy_dir(ROOT / "policies")
    assert reach_diff(p, p).changes == []


def test_report_markdown_html_json(tmp_path):
    o, _ = _dirs(tmp_path, BASE.replace(
        "      - {name: docs,", "      - {name: no-admin, action: deny, hosts: [docs.python.org],"
        " paths: [/3/admin/**]}\n      - {name: docs,"), BASE)
    out = tmp_path / "r.html"
    assert cli_main(["report", "--format", "html", "--out", str(out), str(o)]) == 0
    page = out.read_text()
    assert "<input id='filter'" in page and "<script>" in page and "<style>" in page
    assert "src=" not in page and "href=\"http" not in page  # self-contained
    assert f'href="{o / "p.yaml"}#L8"' in page  # git-refs, linked to its line
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["report", str(o)]) == 0
    md = buf.getvalue()
    assert "## `agent`" in md and "git (injected; secret/git#token)" in md
    assert "except deny rule 'no-admin'" in md
    assert "| git | secret/git | agent: git-refs (" in md  # who is sent which secret
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["report", "--format", "json", str(o)]) == 0
    rules = json.loads(buf.getvalue())["identities"][0]["rules"]
    assert [r["rule"] for r in rules] == ["git-refs", "no-admin", "docs", "api"]
    assert rules[0]["query"] == "service=git-upload-pack"


# --- diff --traffic and the audit's kept query values --------------------------------------


def test_audit_keeps_only_constrained_query_values(tmp_path):
    (tmp_path / "p.yaml").write_text(BASE.replace("query: {service:", "query: {svc:").replace(
        "substitute: [gw]}", "inject: {query: {service: '{{ secrets.gw }}'}}}"))
    names = query_names(load_policy_dir(tmp_path))
    assert names == frozenset({"svc"})  # service is injected by a rule: never kept
    assert (redact_path("/a?svc=x&service=v&token=t&bare", names)
            == "/a?svc=x&service=REDACTED&token=REDACTED&REDACTED")
    assert redact_path("/a?svc=" + "x" * 300, names) == "/a?svc=REDACTED"


def test_traffic_diff_replays_kept_query_values(tmp_path):
    o, n = _dirs(tmp_path, BASE, BASE.replace("[git-upload-pack]",
                                              "[git-upload-pack, git-receive-pack]"))
    ev = {"event": "request", "identity": "agent", "method": "GET", "scheme": "https",
          "host": "github.com", "port": 443, "decision": "deny", "code": "no_rule",
          "path": redact_path("/o/r.git/info/refs?service=git-receive-pack&x=1",
                              query_names(load_policy_dir(o)))}
    traffic = read_audit([json.dumps(ev)])
    res = diff(load_policy_dir(o), load_policy_dir(n), traffic)
    (ch,) = res.changes
    assert ch.kinds[0] == "deny->allow" and ch.new.rule == "git-refs"
    assert ch.request.endswith("/o/r.git/info/refs?service=git-receive-pack")


def test_a_change_of_tools_is_a_change_of_reach(tmp_path: Path) -> None:
    """An mcp: rule that lets more tools through widens reach, and the diff names them."""
    example = (ROOT / "docs/examples/mcp/mcp.yaml").read_text()
    wider = example.replace('create_issue], deny_tools', 'create_issue, "merge_*"], deny_tools')
    assert wider != example
    o, n = _dirs(tmp_path, example, wider)
    d = reach_diff(load_policy_dir(o), load_policy_dir(n))
    assert [(c.identity, c.kind, c.widened) for c in d.changes] == [
        ("mcp-agent", "changed", True)]
    assert "now forwards tool merge_" in d.changes[0].summary()
    back = reach_diff(load_policy_dir(n), load_policy_dir(o))
    assert [(c.kind, c.widened) for c in back.changes] == [("changed", False)]
    assert "no longer forwards tool merge_" in back.changes[0].summary()


def test_report_reads_mcp_rules_by_their_calls(tmp_path: Path) -> None:
    """A rule after an mcp: rule on the same requests decides the calls the earlier filter
    refuses: it is neither 'never decides' nor losing requests to a rule with no call in
    common; the notes say which calls each rule judges."""
    rules = ("version: v1\nidentities:\n  agent:\n    rules:\n"
             "      - {name: read, hosts: [mcp.example.com], methods: [POST], paths: [/mcp],"
             " mcp: {tools: ['get_*']}}\n"
             "      - {name: write, hosts: [mcp.example.com], methods: [POST], paths: [/mcp],"
             " mcp: {methods: [tools/call], tools: [create_issue],"
             " arguments: {repo: 'acme/*'}}}\n")
    o, _ = _dirs(tmp_path, rules, rules)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["report", "--format", "json", str(o)]) == 0
    notes = {r["rule"]: r["notes"] for r in json.loads(buf.getvalue())["identities"][0]["rules"]}
    assert "never decides" not in notes["write"] and "earlier rule" not in notes["write"]
    assert "mcp: methods tools/call, tools create_issue, argument repo acme/*" in notes["write"]
    assert "tools get_*" in notes["read"]
