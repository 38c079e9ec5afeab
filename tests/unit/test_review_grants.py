"""Reach is every grant (issue 38): `sandgate diff` shows a change of the approval gate, of a
credential's scope, of a tool set or of the DNS types as a change of reach, in words a reviewer
reads, and exits 1 when it widens; `narrower_than` fails when the narrow identity's request
waits for fewer people or carries a wider credential than the other's.

The pull requests below are the kinds a fleet's policy repository sees; each was answered
"no change of reach" (or shown misleadingly) before reach covered every grant."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandgate.cli import main as cli_main
from sandgate.decision import decide_request
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import AskPolicy, GitHubScope
from sandgate.request import RequestInfo, parse_query
from sandgate.review.proofs import prove
from sandgate.review.reach_diff import identity_changes
from tests.unit.fuzz import examples
from tests.unit.test_review_proofs import GRID_HOSTS, GRID_PATHS, SECRETS, gate_ok, policies

pytestmark = pytest.mark.unit

FLEET = """version: v1
secrets:
  gh: {vault: secret/data/github/app, github_app: {app_id: 123456, installation_id: 7890123}}
  gh-pat-read: {vault: secret/data/github/pat-read, field: token}
  gh-pat-admin: {vault: secret/data/github/pat-admin, field: token}
  crm:
    vault: secret/data/oauth/crm
    oauth2: {token_url: "https://auth.crm.example/oauth/token", grant: client_credentials, scope: "contacts.read"}
  aws-s3: {vault: secret/data/aws/s3, aws: {region: eu-west-1, service: s3}}
  mcp-gh: {vault: secret/data/mcp/github, field: token}
identities:
  coding-agent:
    rules:
      - {name: gh-mint, hosts: [api.github.com], methods: [POST], paths: ["/app/installations/*/access_tokens"]}
      - name: gh-api
        hosts: [api.github.com]
        methods: [GET, POST]
        paths: ["/repos/acme/**"]
        inject: {headers: {authorization: "token {{ secrets.gh }}"}}
        github_app: {repositories: [acme/api, acme/web], permissions: {contents: read, pull_requests: write}}
      - name: gh-delete
        action: ask
        hosts: [api.github.com]
        methods: [DELETE]
        paths: ["/repos/acme/**"]
        require_approvers: 2
        inject: {headers: {authorization: "token {{ secrets.gh-pat-read }}"}}
      - {name: crm, hosts: [auth.crm.example, api.crm.example], methods: [GET, POST], inject: {headers: {authorization: "Bearer {{ secrets.crm }}"}}}
      - {name: s3-artifacts, hosts: [s3.eu-west-1.amazonaws.com], methods: [GET, PUT], paths: ["/acme-artifacts/**"], inject: {sign: aws-s3}}
      - name: gh-mcp
        hosts: [mcp.example.com]
        methods: [GET, POST, DELETE]
        paths: [/mcp]
        mcp: {tools: [list_issues, get_issue, create_issue], deny_tools: [delete_repo]}
        inject: {headers: {authorization: "Bearer {{ secrets.mcp-gh }}"}}
      - {name: wiki-mcp, hosts: [wiki-mcp.example.com], methods: [POST], paths: [/mcp], mcp: {tools: ["*"], deny_tools: [delete_page]}}
      - {name: pypi, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, HEAD]}
      - {name: mail, hosts: [mail.example.com], methods: [GET], dns: {types: [MX]}}
      - {name: orders-db, hosts: [dynamodb.eu-west-1.amazonaws.com], methods: [POST], paths: [/], operations: ["DynamoDB_20120810.GetItem"], inject: {sign: {secret: aws-s3, service: dynamodb}}}
      - {name: chain, hosts: [rpc.example.com], methods: [POST], jsonrpc: {methods: ["eth_get*", eth_call], deny_methods: [eth_sendRawTransaction]}}
  bash-tool:
    narrower_than: coding-agent
    rules:
      - {name: gh-mint, hosts: [api.github.com], methods: [POST], paths: ["/app/installations/*/access_tokens"]}
      - name: gh-read
        hosts: [api.github.com]
        methods: [GET]
        paths: ["/repos/acme/api/**"]
        inject: {headers: {authorization: "token {{ secrets.gh }}"}}
        github_app: {repositories: [acme/api], permissions: {contents: read}}
      - {name: pypi, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, HEAD]}
tests:
  - {identity: coding-agent, request: POST https://mcp.example.com/mcp, mcp: {tool: create_issue}, expect: allow}
  - {identity: coding-agent, request: POST https://mcp.example.com/mcp, mcp: {tool: delete_repo}, expect: deny, code: denied_by_rule}
  - {identity: coding-agent, request: POST https://mcp.example.com/mcp, mcp: {tool: create_pr}, expect: deny, code: no_rule}
"""  # noqa: E501 (a policy file as written, one rule a line)


def _write(d: Path, text: str, name: str = "p.yaml") -> Path:
    d.mkdir(parents=True)
    (d / name).write_text(text)
    return d


def _edit(edits: list[tuple[str, str]], text: str = FLEET) -> str:
    for a, b in edits:
        assert text.count(a) == 1, a
        text = text.replace(a, b)
    return text


def _diff(tmp_path: Path, new: str, old: str = FLEET, *flags: str) -> tuple[int, str]:
    o, n = _write(tmp_path / "old", old), _write(tmp_path / "new", new)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["diff", *flags, str(o), str(n)])
    return rc, buf.getvalue()


ASK = ("        action: ask\n", "")
APPROVERS = ("        require_approvers: 2\n", "")

# (id, edits of FLEET, identity, what the change's line must say)
WIDENINGS = [
    ("github-app-restriction-removed",
     [("        github_app: {repositories: [acme/api, acme/web], permissions: {contents: read, "
       "pull_requests: write}}\n", "")], "coding-agent",
     "credential gh: repositories [api, web] -> all the installation's; credential gh: "
     "permissions [contents=read, pull_requests=write] -> all the installation's"),
    ("ask-to-allow", [ASK, APPROVERS], "coding-agent",
     "approval: ask -> allow (was held for 2 approvers, mode hold)"),
    ("bash-tool-token-to-write",
     [("permissions: {contents: read}}", "permissions: {contents: write}}")], "bash-tool",
     "credential gh: contents read -> write"),
    ("github-app-repository-added",
     [("repositories: [acme/api], permissions", "repositories: [acme/api, acme/infra], "
       "permissions")], "bash-tool", "credential gh: repositories [api] -> [api, infra]"),
    ("tool-glob-widened",
     [("tools: [list_issues, get_issue, create_issue]",
       'tools: [list_issues, get_issue, "create_*"]')], "coding-agent",
     "tools [list_issues, get_issue, create_issue] -> [list_issues, get_issue, create_*] "
     "(a tool glob widened by its new members: create_pr, and "
     "any other name it matches)"),
    ("deny-tools-entry-removed", [(", deny_tools: [delete_page]", "")], "coding-agent",
     "deny_tools -delete_page; calls: now forwards tool delete_page"),
    ("jsonrpc-methods-widened",
     [('jsonrpc: {methods: ["eth_get*", eth_call], deny_methods: [eth_sendRawTransaction]}',
       'jsonrpc: {methods: ["eth_get*", eth_call, "eth_send*"]}')], "coding-agent",
     'methods [eth_get*, eth_call] -> [eth_get*, eth_call, eth_send*]; deny_methods '
     '-eth_sendRawTransaction; calls: now forwards method eth_send'),
    ("dns-types-added", [("dns: {types: [MX]}", "dns: {types: [MX, TXT]}")], "coding-agent",
     "DNS lookups of mail.example.com (e.g. TXT mail.example.com): DNS types +TXT (rule 'mail'"),
    ("approver-count-lowered", [("require_approvers: 2", "require_approvers: 1")],
     "coding-agent", "approval: approvers needed 2 -> 1"),
    ("approval-mode-async",
     [("require_approvers: 2\n", "require_approvers: 2\n        approval: {mode: async}\n")],
     "coding-agent", "approval: mode hold -> async"),
    ("approval-remembered-per-identity",
     [("require_approvers: 2\n", "require_approvers: 2\n        approval: {remember: "
       "[request, identity]}\n")], "coding-agent",
     "approval: remember [request] -> [identity, request]"),
    ("sigv4-resource-widened", [('paths: ["/acme-artifacts/**"]', 'paths: ["/acme-*/**"]')],
     "coding-agent", "GET, PUT https://s3.eu-west-1.amazonaws.com:443 becomes reachable (e.g. "
     "GET https://s3.eu-west-1.amazonaws.com:443/acme-) by rule 's3-artifacts' "
     "({new}:29), paths /acme-*/**, injects aws-s3 aws(service=s3, region=eu-west-1)"),
    ("sigv4-region-changed",
     [("inject: {sign: aws-s3}}", "inject: {sign: {secret: aws-s3, region: us-east-1}}}")],
     "coding-agent", "credential aws-s3: aws(service=s3, region=eu-west-1) -> "
     "aws(service=s3, region=us-east-1)"),
    ("sigv4-operation-added",
     [('operations: ["DynamoDB_20120810.GetItem"]',
       'operations: ["DynamoDB_20120810.GetItem", "DynamoDB_20120810.PutItem"]')],
     "coding-agent", "operations DynamoDB_20120810.GetItem -> DynamoDB_20120810.GetItem, "
     "DynamoDB_20120810.PutItem"),
    ("oauth-scope-widened",
     [('scope: "contacts.read"', 'scope: "contacts.read contacts.write"')], "coding-agent",
     "credential crm: OAuth scopes [contacts.read] -> [contacts.read, contacts.write]"),
    ("secret-swapped-for-a-wider-one", [("secrets.gh-pat-read", "secrets.gh-pat-admin")],
     "coding-agent", "secrets gh-pat-read -> gh-pat-admin (gh-pat-admin read from "
     "secret/github/pat-admin#token)"),
    ("secret-read-from-elsewhere",
     [("secret/data/github/pat-read", "secret/data/github/pat-admin")], "coding-agent",
     "credential gh-pat-read: read from secret/github/pat-read#token -> read from "
     "secret/github/pat-admin#token"),
]


@pytest.mark.parametrize(("edits", "ident", "words"), [c[1:] for c in WIDENINGS],
                         ids=[c[0] for c in WIDENINGS])
def test_each_widening_pull_request_is_a_change_of_reach(tmp_path, edits, ident, words):
    rc, out = _diff(tmp_path, _edit(edits))
    assert rc == 1, out
    assert "no change of reach" not in out
    words = words.replace("{new}", str(tmp_path / "new" / "p.yaml"))
    lines = out.splitlines()
    at = lines.index(f"identity {ident}:")
    assert any(line.startswith("  + ") and words in line for line in lines[at:]), out
    assert "0 narrowing or neutral" in lines[-1] or "widening" in lines[-1]


NARROWINGS = [
    ("allow-to-ask", [("      - name: gh-api\n", "      - name: gh-api\n        action: ask\n")],
     "coding-agent", "approval: allow -> ask (held for 1 approver, mode hold)"),
    ("approver-count-raised", [("require_approvers: 2", "require_approvers: 3")],
     "coding-agent", "approval: approvers needed 2 -> 3"),
    ("github-app-repository-removed",
     [("repositories: [acme/api, acme/web], permissions", "repositories: [acme/api], "
       "permissions")], "coding-agent", "credential gh: repositories [api, web] -> [api]"),
    ("github-app-permission-lowered", [("pull_requests: write}", "pull_requests: read}")],
     "coding-agent", "credential gh: pull_requests write -> read"),
    ("oauth-scope-narrowed", [('scope: "contacts.read"', 'scope: "contacts.read.basic"')],
     "coding-agent", None),  # another scope: its width is not known, so it counts as wider
    ("dns-type-removed", [(", dns: {types: [MX]}", "")], "coding-agent", "DNS types -MX"),
]


@pytest.mark.parametrize(("edits", "ident", "words"), [c[1:] for c in NARROWINGS],
                         ids=[c[0] for c in NARROWINGS])
def test_a_narrowing_is_shown_and_exits_0(tmp_path, edits, ident, words):
    rc, out = _diff(tmp_path, _edit(edits))
    if words is None:
        assert rc == 1 and "OAuth scopes [contacts.read] -> [contacts.read.basic]" in out
        return
    assert rc == 0, out
    assert "  - " in out and words in out, out
    assert "0 widening" in out.splitlines()[-1]
    rc, _ = _diff(tmp_path / "strict", _edit(edits), FLEET, "--fail-on-narrowing")
    assert rc == 1


def test_the_fleet_is_unchanged_by_itself_and_by_a_reorder(tmp_path):
    assert _diff(tmp_path, FLEET)[0] == 0
    # the secrets in another order, a rule's keys in another order: no change of reach
    moved = _edit([("  mcp-gh: {vault: secret/data/mcp/github, field: token}\n", ""),
                   ("secrets:\n",
                    "secrets:\n  mcp-gh: {field: token, vault: secret/data/mcp/github}\n")])
    rc, out = _diff(tmp_path / "moved", moved)
    assert (rc, out.strip().endswith("no change of reach")) == (0, True), out


def test_json_and_markdown_carry_each_grant(tmp_path):
    new = _edit([ASK, APPROVERS])
    rc, out = _diff(tmp_path, new, FLEET, "--format", "json")
    doc = json.loads(out)
    assert rc == 1 and doc["widened"] is True
    [ch] = doc["changes"]
    assert ch["kind"] == "changed" and ch["grants"] == [
        {"dimension": "approval", "change": "ask -> allow (was held for 2 approvers, mode hold)",
         "widened": True}]
    rc, md = _diff(tmp_path / "md", new, FLEET, "--format", "markdown")
    assert rc == 1 and "approval: ask -&gt; allow" in md and "| grants |" in md


def test_a_new_ask_rule_is_shown_with_its_gate_and_credential(tmp_path):
    new = _edit([("deny_methods: [eth_sendRawTransaction]}}\n  bash-tool:",
                  "deny_methods: [eth_sendRawTransaction]}}\n"
                  "      - {name: gh-merge, action: ask, hosts: "
                  "[api.github.com], methods: [PUT], paths: ['/repos/acme/*/pulls/*/merge'], "
                  "inject: {headers: "
                  "{authorization: 'token {{ secrets.gh }}'}}, github_app: {repositories: "
                  "[acme/api], permissions: {contents: write}}, approval: {require_approvers: 2,"
                  " approvers: [alice, bob]}}\n  bash-tool:")])
    rc, out = _diff(tmp_path, new)
    assert rc == 1
    assert ("by rule 'gh-merge'" in out and "injects gh gh-app(repo=api, contents=write), "
            "held for 2 approvers of alice, bob, mode hold" in out), out


def test_an_ask_rule_after_an_allow_rule_decides_as_the_proxy_does(tmp_path):
    """deny > ask > allow: an ask rule below an allow rule that matches the same requests
    holds them (decide()); the diff and the proof judge them so too."""
    old = _edit([("deny_methods: [eth_sendRawTransaction]}}\n  bash-tool:",
                  "deny_methods: [eth_sendRawTransaction]}}\n"
                  "      - {name: uploads, action: ask, hosts: [pypi.org], "
                  "methods: [GET]}\n  bash-tool:")])
    pol = load_policy_dir(_write(tmp_path / "o", old))
    d = decide_request(pol, "coding-agent", RequestInfo("https", "pypi.org", 443, "GET", "/"))
    assert d.ask and d.rule is not None and d.rule.name == "uploads"
    # the bash tool's GET on pypi.org is not held, the agent's is: not narrower
    [res] = prove(pol)
    assert not res.ok and "approval: ask -> allow" in str(res), str(res)
    assert res.counterexample == "GET https://pypi.org:443/"
    # removing the ask rule is a widening (the first allow rule now decides, unheld)
    rc, out = _diff(tmp_path, FLEET, old)
    assert rc == 1 and "approval: ask -> allow" in out, out


# --- narrower_than covers approval gates and credential scope -------------------------------

BASH_CLEANUP = ("      - {name: pypi, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, "
                "HEAD]}\ntests:", "      - {name: pypi, hosts: [pypi.org, files.pythonhosted.org]"
                ", methods: [GET, HEAD]}\n      - {name: gh-cleanup, hosts: [api.github.com], "
                "methods: [DELETE], paths: ['/repos/acme/api/**'], inject: {headers: "
                "{authorization: 'token {{ secrets.gh-pat-read }}'}}%s}\ntests:")


@pytest.mark.parametrize(("edits", "counterexample", "words"), [
    ([("permissions: {contents: read}}", "permissions: {contents: write}}")],
     "GET https://api.github.com:443/repos/acme/api",
     "coding-agent allows it by rule 'gh-api' ({src}:15), but rule 'gh-read' of bash-tool "
     "grants more on it (coding-agent -> bash-tool): credential gh: contents read -> write"),
    ([("repositories: [acme/api], permissions", "repositories: [acme/api, acme/infra], "
       "permissions")], "GET https://api.github.com:443/repos/acme/api",
     "credential gh: repositories [api, web] -> [api, infra]"),
    ([("        github_app: {repositories: [acme/api], permissions: {contents: read}}\n", "")],
     "GET https://api.github.com:443/repos/acme/api",
     "credential gh: repositories [api, web] -> all the installation's; credential gh: "
     "permissions [contents=read, pull_requests=write] -> all the installation's"),
    ([(BASH_CLEANUP[0], BASH_CLEANUP[1] % "")],
     "DELETE https://api.github.com:443/repos/acme/api",
     "coding-agent holds it for approval by rule 'gh-delete' ({src}:21), but rule "
     "'gh-cleanup' of bash-tool grants more on it (coding-agent -> bash-tool): approval: ask "
     "-> allow (was held for 2 approvers, mode hold)"),
    ([(BASH_CLEANUP[0], BASH_CLEANUP[1] % ", action: ask")],
     "DELETE https://api.github.com:443/repos/acme/api", "approval: approvers needed 2 -> 1"),
    ([(BASH_CLEANUP[0], BASH_CLEANUP[1] % ", action: ask, approval: {require_approvers: 2, "
       "mode: async}")], "DELETE https://api.github.com:443/repos/acme/api",
     "approval: mode hold -> async"),
], ids=["token-write", "more-repositories", "app-restriction-removed", "no-approval",
        "fewer-approvers", "async"])
def test_narrower_than_covers_approval_and_credential_scope(tmp_path, edits, counterexample,
                                                            words):
    d = _write(tmp_path / "p", _edit(edits))
    [res] = prove(load_policy_dir(d))
    assert not res.ok, str(res)
    assert res.counterexample == counterexample
    assert words.format(src=d / "p.yaml") in str(res), str(res)
    # only the two rules involved are named in why
    assert "gh-mcp" not in str(res) and "crm" not in str(res)


def test_narrower_than_covers_dns_types(tmp_path):
    bash_pypi = ("      - {name: pypi, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, "
                 "HEAD]}\ntests:")
    d = _write(tmp_path / "p", _edit([(bash_pypi, bash_pypi.replace(
        "[GET, HEAD]}", "[GET, HEAD], dns: {types: [TXT]}}"))]))
    [res] = prove(load_policy_dir(d))
    assert not res.ok and res.counterexample == "DNS TXT files.pythonhosted.org", str(res)
    assert "coding-agent: TXT files.pythonhosted.org is refused" in str(res)


def test_narrower_than_still_proves_the_fleet_and_an_equal_gate(tmp_path):
    [res] = prove(load_policy_dir(_write(tmp_path / "a", FLEET)))
    assert res.ok, str(res)
    same = _edit([(BASH_CLEANUP[0], BASH_CLEANUP[1] % ", action: ask, approval: "
                   "{require_approvers: 3}")])
    [res] = prove(load_policy_dir(_write(tmp_path / "b", same)))
    assert res.ok, str(res)


# --- properties: the comparison against references written apart from it -------------------

LEVEL = {None: 0, "read": 1, "write": 2, "admin": 3}
repos_st = st.none() | st.lists(st.sampled_from(["api", "web", "infra"]), unique=True,
                                min_size=1).map(lambda r: tuple(sorted(r)))
perms_st = st.none() | st.dictionaries(
    st.sampled_from(["contents", "issues", "pull_requests"]),
    st.sampled_from(["read", "write", "admin"]), min_size=1).map(
    lambda d: tuple(sorted(d.items())))
scopes = st.none() | st.builds(GitHubScope, repos_st, perms_st)
gates = st.none() | st.builds(
    AskPolicy, timeout=st.sampled_from([60, 120]), require_approvers=st.integers(1, 3),
    approvers=st.none() | st.lists(st.sampled_from(["alice", "bob", "carol"]), unique=True,
                                   min_size=1).map(tuple),
    mode=st.sampled_from(["hold", "async"]),
    remember=st.lists(st.sampled_from(["request", "sandbox", "identity"]), unique=True,
                      min_size=1).map(tuple),
    max_remember_ttl=st.sampled_from([3600, 86400]))


def scope_covers(inner: GitHubScope | None, outer: GitHubScope | None) -> bool:
    """Is every token `inner` mints within what `outer` mints? (None: the installation's.)"""
    ri, ro = (inner.repositories if inner else None), (outer.repositories if outer else None)
    pi = dict(inner.permissions) if inner and inner.permissions is not None else None
    po = dict(outer.permissions) if outer and outer.permissions is not None else None
    return ((ro is None or (ri is not None and set(ri) <= set(ro)))
            and (po is None or (pi is not None and all(LEVEL[v] <= LEVEL[po.get(k)]
                                                       for k, v in pi.items()))))


@pytest.fixture(scope="module")
def gh_rule(tmp_path_factory):
    pol = load_policy_dir(_write(tmp_path_factory.mktemp("gh") / "p", FLEET))
    return pol, next(r for r in pol.identities["bash-tool"].rules if r.name == "gh-read")


@settings(max_examples=examples(200), deadline=None)
@given(scopes, scopes, gates, gates)
def test_grant_widening_agrees_with_references(gh_rule, old_scope, new_scope, old_gate,
                                               new_gate):
    from sandgate.review.grants import grant_deltas  # new in issue 38: main fails here

    pol, rule = gh_rule
    old = dataclasses.replace(rule, github_scope=old_scope, ask=old_gate)
    new = dataclasses.replace(rule, github_scope=new_scope, ask=new_gate)
    deltas = grant_deltas(pol.secrets, old, pol.secrets, new, "api.github.com")
    cred = [d for d in deltas if d.dimension == "credential gh"]
    gate = [d for d in deltas if d.dimension == "approval"]
    assert any(d.widened for d in cred) == (not scope_covers(new_scope, old_scope))
    assert any(d.widened for d in gate) == (not gate_ok(new_gate, old_gate))
    # every difference is shown (a ttl only where a decision may be remembered beyond the
    # request)
    assert bool(cred) == (_repos_perms(old_scope) != _repos_perms(new_scope))
    assert bool(gate) == (_shown_gate(old_gate) != _shown_gate(new_gate))
    assert grant_deltas(pol.secrets, old, pol.secrets, old, "api.github.com") == []


def _repos_perms(s: GitHubScope | None) -> tuple[object, object]:
    return (s.repositories, s.permissions) if s is not None else (None, None)


def _shown_gate(g: AskPolicy | None) -> object:
    if g is None or g.remember != ("request",):
        return g
    return dataclasses.replace(g, max_remember_ttl=0)


# --- property: the diff sees every change of the approval gate decide() makes ---------------

GRID_METHODS = ("GET", "POST", "HEAD")


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_every_change_of_the_gate_is_a_change_of_reach(pol):
    old, new = pol.identities["n"], pol.identities["o"]
    changes = identity_changes(old, new, SECRETS, SECRETS)
    assert identity_changes(old, old, SECRETS, SECRETS) == []
    gates = [c for c in changes if c.kind == "changed"
             and any(d.dimension == "approval" for d in c.deltas)]
    for host in GRID_HOSTS:
        for method in GRID_METHODS:
            for path in GRID_PATHS:
                req = RequestInfo("https", host, 443, method, path, parse_query(""))
                a, b = decide_request(pol, "n", req), decide_request(pol, "o", req)
                if not (a.allowed and b.allowed) or a.tunnel or b.tunnel:
                    continue
                assert a.rule is not None and b.rule is not None
                if a.rule.ask == b.rule.ask:
                    continue
                widened = not gate_ok(b.rule.ask, a.rule.ask)
                assert any(c.old_rule == a.rule and c.new_rule == b.rule
                           and c.widened >= widened for c in gates), (
                    req, a.rule.name, b.rule.name, [c.summary() for c in changes])


# --- the documented example is real output ----------------------------------------------------

DOC = Path(__file__).parents[2] / "docs" / "policy-review.md"


def _fences(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block of a page."""
    out, lang, body = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                out.append((lang, "".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def _patch(text: str, udiff: str) -> str:
    """Apply a unified diff (one file) to text."""
    old = text.splitlines(keepends=True)
    out: list[str] = []
    at = 0
    for line in udiff.splitlines(keepends=True):
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            start = int(line.split()[1].split(",")[0].lstrip("-")) - 1
            out += old[at:start]
            at = start
        elif line.startswith(" ") or line.startswith("-"):
            assert old[at] == line[1:], (old[at], line)
            at += 1
            if line.startswith(" "):
                out.append(line[1:])
        elif line.startswith("+"):
            out.append(line[1:])
    return "".join(out + old[at:])


def test_the_documented_diff_is_what_sandgate_prints(tmp_path, monkeypatch):
    blocks = _fences(DOC.read_text())
    at = next(i for i, (lang, body) in enumerate(blocks)
              if lang == "yaml" and body.startswith("# fleet.yaml (the base branch)"))
    (_, base), (dlang, udiff), (_, shown), (_, narrow_shown) = blocks[at:at + 4]
    assert dlang == "diff"
    base = base.split("\n", 1)[1]
    _write(tmp_path / "base" / "policies", base, "fleet.yaml")
    _write(tmp_path / "policies", _patch(base, udiff), "fleet.yaml")
    monkeypatch.chdir(tmp_path)

    def run() -> tuple[int, str]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main(["diff", "base/policies", "policies"])
        return rc, "$ sandgate diff base/policies policies\n" + buf.getvalue()

    assert run() == (1, shown)
    (tmp_path / "policies" / "fleet.yaml").write_text(_edit(
        [("      - name: gh-api\n", "      - name: gh-api\n        action: ask\n"),
         (", dns: {types: [MX]}", "")], base))
    assert run() == (0, narrow_shown)


def test_the_documented_refutations_are_what_check_prints(tmp_path, monkeypatch):
    blocks = _fences((DOC.parent / "proofs.md").read_text())
    at = next(i for i, (lang, body) in enumerate(blocks)
              if lang == "yaml" and body.startswith("# github.yaml\n"))
    (_, base), (_, write_shown), (_, rule), (_, ask_shown) = blocks[at:at + 4]
    base = base.split("\n", 1)[1]
    monkeypatch.chdir(tmp_path)
    read = "repositories: [acme/api], permissions: {contents: read}}\n"

    (tmp_path / "policies").mkdir()

    def check(text: str) -> tuple[int, str]:
        (tmp_path / "policies" / "github.yaml").write_text(text)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli_main(["check", "policies"])
        return rc, "$ sandgate check policies\n" + buf.getvalue()

    assert check(base)[0] == 0
    assert check(_edit([(read, read.replace("read}", "write}"))], base)) == (1, write_shown)
    cleanup = "".join(f"      {line}\n" for line in rule.splitlines())
    assert check(_edit([(read, read + cleanup)], base)) == (1, ask_shown)


def test_the_report_shows_the_gate_the_dns_types_and_the_oauth_scope(tmp_path):
    o = _write(tmp_path / "p", FLEET)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["report", str(o)]) == 0
    md = buf.getvalue()
    row = next(line for line in md.splitlines() if line.startswith("| ask | gh-delete |"))
    assert "held for 2 approvers, mode hold" in row
    row = next(line for line in md.splitlines() if line.startswith("| allow | mail |"))
    assert "policy DNS also answers MX for its hosts" in row
    assert "from https://auth.crm.example/oauth/token, scopes contacts.read, client record" in md
