"""Policy hygiene: per-sandbox secret paths lint clean, deny rules over pseudo-TLDs, query
`optional`/`absent`, rule metadata with `expires`, and `owns:` on an identity."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.cli import main
from sandgate.decision import decide
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import query_matches
from sandgate.request import parse_url
from sandgate.review.hygiene import expiries, today_utc
from sandgate.review.lint import lint_dir
from sandgate.review.proofs import prove_narrower
from tests.unit.fuzz import examples


def _dir(tmp_path: Path, **files: str) -> Path:
    for name, text in files.items():
        (tmp_path / name.replace("_", "-").replace("-yaml", ".yaml")).write_text(text)
    return tmp_path


PER_SANDBOX = """\
version: v1
secrets:
  gh:
    vault: "secret/data/sandboxes/{{ sandbox }}/github"
    field: token
    hosts: [api.github.com]
  db:
    dynamic: {path: "database/creds/{{ identity }}"}
    hosts: [db.example.com]
identities:
  agent:
    rules:
      - name: github
        hosts: [api.github.com]
        methods: [GET]
        paths: [/user]
        inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}
      - name: db
        hosts: [db.example.com]
        methods: [POST]
        paths: [/query]
        inject: {headers: {x-db-password: "{{ secrets.db }}"}}
tests:
  - {identity: agent, request: GET https://api.github.com/user, sandbox: sb-1, expect: allow,
     inject: [gh]}
  - {identity: agent, request: GET https://api.github.com/user, expect: deny,
     code: sandbox_required}
  - {identity: agent, request: GET https://api.github.com/other, sandbox: sb-1, expect: deny,
     code: no_rule}
"""


def test_per_sandbox_secret_paths_lint_clean(tmp_path):
    """The documented `{{ sandbox }}` path is no template-looking text: --strict can pass."""
    d = _dir(tmp_path, p_yaml=PER_SANDBOX)
    assert lint_dir(d) == []
    assert main(["lint", "--strict", str(d)]) == 0
    assert main(["check", str(d)]) == 0


def test_template_looking_text_elsewhere_still_warns(tmp_path):
    d = _dir(tmp_path, p_yaml=PER_SANDBOX.replace("description", "x").replace(
        "      - name: db\n", "      - name: db\n        description: \"{{ secrets.gh }}\"\n"))
    assert [f.field for f in lint_dir(d)] == ["identities.agent.rules[1].description"]


def test_a_deny_rule_may_name_pseudo_tlds(tmp_path):
    d = _dir(tmp_path, p_yaml="""\
version: v1
identities:
  a:
    rules:
      - {name: no-internal, action: deny, hosts: ['*.internal', '*.local', '*.home.arpa']}
      - {name: web, public: true, methods: [GET]}
tests:
  - {identity: a, request: GET https://wiki.corp.internal/, expect: deny, rule: no-internal}
  - {identity: a, request: GET https://printer.local/, expect: deny, code: denied_by_rule}
  - {identity: a, request: GET https://example.org/, expect: allow, rule: web}
""")
    assert main(["check", str(d)]) == 0
    assert lint_dir(d) == []  # the public-suffix advice is for what a rule grants


# --- query: optional and absent -------------------------------------------------------------

QUERY = """\
version: v1
identities:
  a:
    rules:
      - name: list
        hosts: [api.example.com]
        query:
          page: {values: ['1', '2'], optional: true}
          debug: absent
          service: [git-upload-pack]
      - name: aws
        hosts: [ec2.example.com]
        query:
          Action: {values: [DescribeInstances], exact: true}
"""


@pytest.mark.parametrize(("qs", "ok"), [
    ("service=git-upload-pack", True),
    ("service=git-upload-pack&page=1", True),
    ("service=git-upload-pack&page=3", False),
    ("service=git-upload-pack&page=1&page=2", False),
    ("service=git-upload-pack&Page=1", False),  # another spelling some servers read as page
    ("service=git-upload-pack&debug=1", False),
    ("service=git-upload-pack&DEBUG", False),
    ("service=git-upload-pack&debug", False),
    ("page=1", False),
    ("service=git-upload-pack&x=a+b", False),  # unreadable: no query rule matches it
])
def test_optional_and_absent(tmp_path, qs, ok):
    pol = load_policy_dir(_dir(tmp_path, p_yaml=QUERY))
    d = decide(pol, "a", parse_url("GET", f"https://api.example.com/x?{qs}"))
    assert d.allowed == ok, d.reason
    if not ok:
        assert "rule 'list' allows this host for query" in (d.hint or "")


def test_exact_allows_a_capitalised_name(tmp_path):
    pol = load_policy_dir(_dir(tmp_path, p_yaml=QUERY))
    assert decide(pol, "a", parse_url(
        "GET", "https://ec2.example.com/?Action=DescribeInstances")).allowed


NAMES = st.sampled_from(["page", "Page", "debug", "x"])
VALUES = st.sampled_from(["1", "2", "3", ""])


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(NAMES, VALUES), max_size=4), st.booleans())
def test_query_matches_by_brute_force(query, unreadable):
    q = None if unreadable else tuple(query)
    got = query_matches((), q, (("page", frozenset({"1", "2"})),), frozenset({"debug"}))
    if q is None:
        want = False
    else:
        folded = [(n.casefold(), v) for n, v in q]
        page_vals = {v for n, v in q if n == "page"}
        page_ok = (not any(n == "page" for n, _ in folded)) or (
            all(n == "page" for n, _ in q if n.casefold() == "page")
            and len(page_vals) == 1 and page_vals <= {"1", "2"})
        want = page_ok and not any(n == "debug" for n, _ in folded)
    assert got == want, (q, got)


def _narrower(tmp_path: Path, narrow: str, other: str) -> object:
    d = tmp_path / f"n{abs(hash((narrow, other)))}"
    d.mkdir()
    (d / "p.yaml").write_text(f"""\
version: v1
identities:
  n:
    narrower_than: o
    rules:
      - {{name: r, hosts: [h.example.com], query: {narrow}}}
  o:
    rules:
      - {{name: r, hosts: [h.example.com], query: {other}}}
""")
    return prove_narrower(load_policy_dir(d), "n", "o")


def test_proofs_see_optional_and_absent(tmp_path):
    req = "{s: [a]}"
    opt = "{s: {values: [a], optional: true}}"
    assert _narrower(tmp_path, req, opt).ok  # required a: a subset of optional a
    res = _narrower(tmp_path, opt, req)
    assert not res.ok and "?" not in (res.counterexample or "?")  # s left out
    assert _narrower(tmp_path, "{s: [a], d: absent}", "{s: [a]}").ok
    res = _narrower(tmp_path, "{s: [a]}", "{s: [a], d: absent}")
    assert not res.ok and "d=other" in (res.counterexample or "")
    res = _narrower(tmp_path, "{s: {values: [a], optional: true}}", "{s: [a], d: absent}")
    assert not res.ok


# --- rule metadata and expiry ---------------------------------------------------------------


def _meta_policy(expires: str) -> str:
    return f"""\
version: v1
identities:
  a:
    rules:
      - name: temp
        hosts: [api.example.com]
        methods: [GET]
        description: debugging the export job
        owner: team-data
        ticket: SEC-1234
        expires: {expires}
tests:
  - {{identity: a, request: GET https://api.example.com/, expect: allow}}
"""


def test_check_fails_on_an_expired_rule(tmp_path, capsys):
    yesterday = (today_utc() - timedelta(days=1)).isoformat()
    d = _dir(tmp_path, p_yaml=_meta_policy(yesterday))
    assert main(["check", str(d)]) == 1
    out = capsys.readouterr().out
    assert f"rule 'temp' of identity 'a' (owner team-data) expired on {yesterday}" in out
    assert "p.yaml:5" in out
    pol = load_policy_dir(d)
    rule = pol.identities["a"].rules[0]
    assert rule.meta is not None and rule.meta.ticket == "SEC-1234"


def test_lint_warns_the_week_before(tmp_path):
    soon = (today_utc() + timedelta(days=3)).isoformat()
    d = _dir(tmp_path, p_yaml=_meta_policy(soon))
    assert main(["check", str(d)]) == 0
    (f,) = lint_dir(d)
    assert f.field == "identities.a.rules[0].expires" and f.line == 11
    assert f"expires on {soon}" in f.message
    later = (today_utc() + timedelta(days=30)).isoformat()
    d2 = tmp_path / "later"
    d2.mkdir()
    (d2 / "p.yaml").write_text(_meta_policy(f'"{later}"'))  # a quoted date reads the same
    assert lint_dir(d2) == []
    (e,) = expiries(load_policy_dir(d2), today_utc() + timedelta(days=30))
    assert e.expired


# --- owns: ----------------------------------------------------------------------------------

OWNER = """\
version: v1
templates:
  wide: [{name: anything, public: true}]
identities:
  agent:
    owns: [20-agent-llm.yaml]
    rules:
      - {name: pypi, hosts: [pypi.org], methods: [GET]}
"""


def test_owns_lets_named_files_add_rules(tmp_path):
    d = _dir(tmp_path, **{"10-agent.yaml": OWNER, "20-agent-llm.yaml": (
        "version: v1\nidentities:\n  agent:\n    rules:\n"
        "      - {name: llm, hosts: [api.anthropic.com], methods: [POST]}\n")})
    pol = load_policy_dir(d)
    assert [r.name for r in pol.identities["agent"].rules] == ["pypi", "llm"]
    assert pol.identities["agent"].owns == ("20-agent-llm.yaml",)


def test_owns_refuses_a_template_used_from_another_file(tmp_path):
    d = _dir(tmp_path, **{"10-agent.yaml": OWNER, "99-debug.yaml": (
        "version: v1\nidentities:\n  agent:\n    use: [wide]\n")})
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(d)
    (p,) = ei.value.problems
    assert (p.file, p.line, p.field) == (str(d / "99-debug.yaml"), 4, "identities.agent.use[0]")
    assert "`use: wide` adds template rules to identity 'agent'" in p.message
    assert "add 99-debug.yaml to identities.agent.owns" in p.fix
