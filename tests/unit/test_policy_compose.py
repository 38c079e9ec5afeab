"""Policies as code: an identity spread over files, templates (`use:`), and what lint says."""

from __future__ import annotations

from pathlib import Path

from sandgate.cli import main as cli_main
from sandgate.decision import decide
from sandgate.policy.loader import load_policy_dir
from sandgate.request import parse_url
from sandgate.review.lint import lint_dir

SECRETS = """version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
templates:
  git-read:
    - name: git-refs
      hosts: [github.com]
      methods: [GET]
      paths: ["/*/*/info/refs"]
      query: {service: [git-upload-pack]}
      inject: {basic: {username: x-access-token, password: "{{ secrets.gh }}"}}
    - name: git-fetch
      hosts: [github.com]
      methods: [POST]
      paths: ["/*/*/git-upload-pack"]
      max_request_bytes: 1m
      inject: {basic: {username: x-access-token, password: "{{ secrets.gh }}"}}
  pypi:
    - {name: pypi, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, HEAD]}
"""


def write(d: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_identity_spans_files_in_name_order(tmp_path):
    write(tmp_path, {
        "20-b.yaml": "version: v1\nidentities:\n  x:\n    mode: report\n    rules:\n"
                     "      - {name: b1, hosts: [b.example.com]}\n"
                     "      - {name: b2, hosts: [c.example.com]}\n",
        "10-a.yaml": "version: v1\nidentities:\n  x:\n    description: first\n    rules:\n"
                     "      - {name: a1, hosts: [a.example.com]}\n",
    })
    pol = load_policy_dir(tmp_path)
    ident = pol.identities["x"]
    assert [r.name for r in ident.rules] == ["a1", "b1", "b2"]
    assert [str(r.source) for r in ident.rules] == [
        f"{tmp_path / '10-a.yaml'}:6", f"{tmp_path / '20-b.yaml'}:6", f"{tmp_path / '20-b.yaml'}:7"]
    assert ident.mode == "report"  # set in the second file only
    assert ident.source.file == str(tmp_path / "10-a.yaml")
    d = decide(pol, "x", parse_url("GET", "https://c.example.com/"))
    assert d.allowed and d.rule is not None and str(d.rule.source).endswith("20-b.yaml:7")
    assert f"({tmp_path / '20-b.yaml'}:7)" in d.reason  # the audit names the file:line


def test_templates_come_first_in_use_order_and_keep_their_source(tmp_path):
    write(tmp_path, {
        "10-templates.yaml": SECRETS,
        "20-agent.yaml": "version: v1\nidentities:\n  agent:\n    use: [pypi, git-read]\n"
                         "    rules:\n      - {name: docs, hosts: [docs.python.org]}\n",
        "30-more.yaml": "version: v1\nidentities:\n  agent:\n    rules:\n"
                        "      - {name: late, hosts: [late.example.com]}\n"
                        "  tool:\n    use: [git-read]\n",
    })
    pol = load_policy_dir(tmp_path)
    rules = pol.identities["agent"].rules
    assert [r.name for r in rules] == ["pypi", "git-refs", "git-fetch", "docs", "late"]
    assert all(r.identity == "agent" for r in rules)
    assert str(rules[1].source) == f"{tmp_path / '10-templates.yaml'}:6"
    assert rules[1].where == ("templates", "git-read", 0)
    tool = pol.identities["tool"].rules
    assert [r.identity for r in tool] == ["tool", "tool"]
    assert tool[0].source == rules[1].source
    assert pol.templates.keys() == {"git-read", "pypi"}
    d = decide(pol, "tool", parse_url(
        "GET", "https://github.com/o/r.git/info/refs?service=git-upload-pack"))
    assert d.allowed and d.rule is not None and d.rule.secrets == {"gh"}
    assert d.rule.identity == "tool" and "10-templates.yaml:6" in d.reason
    assert not decide(pol, "tool", parse_url(
        "GET", "https://github.com/o/r.git/info/refs?service=git-receive-pack")).allowed


def test_template_secret_declared_in_another_file(tmp_path):
    head, _, rest = SECRETS.partition("templates:\n")
    write(tmp_path, {"a.yaml": head, "b.yaml": "version: v1\ntemplates:\n" + rest
                     + "identities:\n  x: {use: [git-read]}\n"})
    assert load_policy_dir(tmp_path).identities["x"].rules[0].secrets == {"gh"}


def test_fixtures_and_check_across_files(tmp_path, capsys):
    write(tmp_path, {
        "10-templates.yaml": SECRETS,
        "20-agent.yaml": "version: v1\nidentities:\n  agent:\n    use: [git-read]\n"
        "tests:\n"
        "  - {identity: agent, request: 'GET https://github.com/o/r.git/info/refs?service="
        "git-upload-pack', expect: allow, rule: git-refs, inject: [gh]}\n"
        "  - {identity: agent, request: 'GET https://github.com/o/r.git/info/refs?service="
        "git-receive-pack', expect: deny, code: no_rule}\n",
    })
    assert cli_main(["check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 passed, 0 failed" in out
    assert "?service=git-receive-pack -> deny (no_rule)" in out


def test_lint_unused_template_and_template_findings_once(tmp_path):
    write(tmp_path, {
        "p.yaml": "version: v1\nsecrets:\n  s: {vault: secret/data/s, field: k}\n"
        "templates:\n"
        "  unused: [{name: u, hosts: [u.example.com]}]\n"
        "  tok:\n"
        "    - {name: t, hosts: [api.example.com], substitute: [s]}\n"
        "identities:\n  a: {use: [tok]}\n  b: {use: [tok]}\n"
        "tests:\n  - {identity: a, request: GET https://api.example.com/, expect: allow}\n"
        "  - {identity: b, request: GET https://api.example.com/, expect: allow}\n",
    })
    found = lint_dir(tmp_path)
    texts = [(f.line, f.field, f.message) for f in found]
    assert (5, "templates.unused", "template 'unused' is never used: no identity names it in "
            "`use:`") in texts
    any_method = [t for t in texts if "for any method" in t[2]]
    assert any_method == [(7, "templates.tok[0]", any_method[0][2])]  # once, at the template


def test_public_rule_lints_clean(tmp_path):
    write(tmp_path, {"p.yaml": "version: v1\nidentities:\n  a:\n    rules:\n"
                     "      - {name: web, public: true, methods: [GET]}\n"
                     "tests:\n  - {identity: a, request: GET https://example.org/, "
                     "expect: allow}\n"})
    assert lint_dir(tmp_path) == []


def test_lint_warns_about_rules_after_a_public_rule(tmp_path):
    write(tmp_path, {"p.yaml": "version: v1\nidentities:\n  a:\n    rules:\n"
                     "      - {name: web, public: true, methods: [GET]}\n"
                     "      - {name: wiki, hosts: [wiki.corp.test], private_cidrs: [10.0.0.0/8]}\n"
                     "      - {name: up, hosts: [up.example.com], methods: [POST]}\n"
                     "tests:\n  - {identity: a, request: GET https://example.org/, "
                     "expect: allow}\n"})
    (f,) = lint_dir(tmp_path)
    assert (f.line, f.field) == (6, "identities.a.rules[1]")
    assert "comes after `public: true` rule 'web' (line 5)" in f.message
    assert "last" in f.fix


def test_shipped_policies_still_check_and_lint_strict(capsys):
    root = Path(__file__).parents[2] / "policies"
    assert cli_main(["check", str(root)]) == 0
    assert cli_main(["lint", "--strict", str(root)]) == 0
