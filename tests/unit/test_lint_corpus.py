"""A corpus of planted mistakes (issue 38): each case under tests/unit/lint_corpus is a policy
directory `bad/` with one mistake, marked on its line by `# planted: CODE` (a lint code, or
`load-error` for what `check` refuses), and `fixed/`, the corrected policy. Each mistake must be
caught on its planted line with its code; each corrected policy must load, pass its fixtures
and lint clean under `--strict`. A case's `tools.json` is a recorded tools/list of
mcp.example.com, passed as --mcp-tools."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.review.lint import lint_dir
from tests.support.cli import run_cli

CORPUS = Path(__file__).parent / "lint_corpus"
CASES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
MARK = re.compile(r"#\s*planted:\s*([a-z-]+)")


def listing(case: str) -> list[str]:
    tools = CORPUS / case / "tools.json"
    return [f"mcp.example.com={tools}"] if tools.exists() else []


def planted(case: str) -> tuple[str, int, str]:
    """(file, line, code) of the case's one planted mistake."""
    marks = [(str(f), n, m.group(1))
             for f in sorted((CORPUS / case / "bad").glob("*.yaml"))
             for n, text in enumerate(f.read_text().splitlines(), 1)
             if (m := MARK.search(text))]
    assert len(marks) == 1, (case, marks)
    return marks[0]


def test_the_corpus_covers_every_construct() -> None:
    codes = {planted(c)[2] for c in CASES}
    assert codes >= {"mcp-tool-glob", "mcp-tools-any", "mcp-bypass", "mcp-deny-unmatched",
                     "mcp-argument-glob", "dns-type-widening", "dns-public", "owns-template",
                     "grant-no-expiry", "grant-no-owner", "deny-under-public",
                     "java-path-params", "deny-star-segment", "lint-ignore-unused",
                     "load-error"}


@pytest.mark.parametrize("case", CASES)
def test_the_planted_mistake_is_caught_on_its_line(case: str) -> None:
    file, line, code = planted(case)
    bad = CORPUS / case / "bad"
    if code == "load-error":
        with pytest.raises(PolicyError) as e:
            load_policy_dir(bad)
        assert [(p.file, p.line) for p in e.value.problems] == [(file, line)], str(e.value)
        return
    found = lint_dir(bad, listing(case))
    assert [(f.file, f.line, f.code) for f in found] == [(file, line, code)], \
        "\n".join(map(str, found))
    f = found[0]
    assert "rule '" in f.message and f.fix, f  # names the rule, says what to do


@pytest.mark.parametrize("case", CASES)
def test_the_corrected_policy_is_clean(case: str) -> None:
    fixed = CORPUS / case / "fixed"
    assert [str(f) for f in lint_dir(fixed, listing(case))] == []
    r = run_cli("check", str(fixed))
    assert r.returncode == 0 and " 0 failed" in r.stdout, r.stdout + r.stderr


def test_lint_strict_gates_on_the_planted_mistake_and_honours_the_suppression() -> None:
    case = CORPUS / "14-java-suppressed"
    r = run_cli("lint", "--strict", str(case / "bad"))
    assert r.returncode == 1 and "[java-path-params]" in r.stdout, r.stdout + r.stderr
    r = run_cli("lint", "--strict", str(case / "fixed"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli("lint", "--strict", "--mcp-tools", *listing("01-create-glob"),
                str(CORPUS / "01-create-glob" / "bad"))
    assert r.returncode == 1 and "[mcp-tool-glob]" in r.stdout, r.stdout + r.stderr


def test_report_lists_the_suppression() -> None:
    r = run_cli("report", "--format", "json", str(CORPUS / "14-java-suppressed" / "fixed"))
    assert r.returncode == 0, r.stderr
    assert ("lint warnings java-path-params suppressed: api.example.com is a Go server: it "
            "does not strip ;-parameters") in r.stdout


def test_every_code_is_documented_and_every_code_is_raised_somewhere() -> None:
    from sandgate.policy.lint_codes import CODES

    doc = (Path(__file__).parents[2] / "docs" / "policy-review.md").read_text()
    assert [c for c in CODES if f"| `{c}` |" not in doc] == []
    src = "".join(p.read_text() for p in (Path(__file__).parents[2] / "proxy" / "sandgate"
                                          / "review").glob("lint*.py")
                  if p.name != "lint_codes.py")
    assert [c for c in CODES if f'"{c}"' not in src] == []


MCP_RULE = ("      - {name: gh-mcp, hosts: [mcp.example.com], methods: [GET, POST, DELETE], "
            "paths: [/mcp], mcp: {tools: [list_issues, 'get_*'], deny_tools: [delete_repo]}}\n")
NEAR_MISSES = {
    # every tool allowed, the writes held for approval: ask wins over allow
    "ask-carve-out": "      - {name: gh-all, hosts: [mcp.example.com], paths: [/mcp], "
                     "mcp: {tools: ['*']}}\n"
                     "      - {name: gh-write, action: ask, hosts: [mcp.example.com], "
                     "paths: [/mcp], mcp: {tools: [create_issue]}}\n",
    # a web reader (GET only) beside the tool rule: it takes no call
    "web-reader": MCP_RULE + "      - {name: web, public: true, methods: [GET]}\n",
    # deny_tools far from every allowed tool: belt and braces; anchored argument globs
    "belt-and-braces": MCP_RULE.replace("deny_tools: [delete_repo]",
                                        "deny_tools: [delete_repo], arguments: "
                                        "{repo: 'acme/*', owner: acme}"),
    # more types for an exact host, in a policy without public: true
    "dns-exact": "      - {name: mail, hosts: [mail.example.com], methods: [GET], "
                 "dns: {types: [MX, TXT]}}\n",
    # an expiring grant with its owner; a rule whose name merely contains "temp"
    "owned-grant": "      - {name: export, hosts: [s.example.com], methods: [GET], "
                   "owner: team-data, expires: '2099-01-01'}\n"
                   "      - {name: attempts-api, hosts: [t.example.com], methods: [GET]}\n",
}


@pytest.mark.parametrize("rules", NEAR_MISSES.values(), ids=list(NEAR_MISSES))
def test_near_misses_lint_clean(tmp_path: Path, rules: str) -> None:
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  agent:\n    rules:\n" + rules
        + "tests:\n  - {identity: agent, request: GET https://nothing.invalid/, expect: deny}\n")
    assert [str(f) for f in lint_dir(tmp_path)] == []
