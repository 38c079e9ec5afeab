"""Brokered credentials whose token endpoint the identity cannot reach (issue 38): `check`
reports the rule, the secret and the endpoint with the rule to add, and `explain` says it. The
run-time side (503 secret_unavailable for such a rule) is tests/integration/
test_creds_oauth2.py, which also runs `check` on the policy it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandgate.cli import main
from sandgate.explain.answer import explain
from sandgate.policy.loader import load_policy_dir
from sandgate.review.prerequisites import token_endpoint, unreachable

pytestmark = pytest.mark.unit

POLICY = """\
version: v1
secrets:
  gh:
    vault: secret/data/github/app
    github_app: {app_id: 1, installation_id: 77}
  crm:
    vault: secret/data/oauth/crm
    oauth2: {token_url: "https://auth.crm.example:8443/oauth/token", grant: client_credentials}
identities:
  agent:
    rules:
      - name: gh-mint
        hosts: [api.github.com]
        methods: [POST]
        paths: ["/app/installations/*/access_tokens"]
      - name: gh-api
        hosts: [api.github.com]
        inject: {headers: {authorization: "token {{ secrets.gh }}"}}
  bash-tool:
    rules:
      - name: no-apps
        action: deny
        hosts: [api.github.com]
        paths: ["/app/**"]
      - name: gh-mint
        hosts: [api.github.com]
        methods: [POST]
      - name: gh-read
        hosts: [api.github.com]
        methods: [GET]
        inject: {headers: {authorization: "token {{ secrets.gh }}"}}
      - name: crm
        hosts: [api.crm.example]
        inject: {headers: {authorization: "Bearer {{ secrets.crm }}"}}
"""


@pytest.fixture
def pdir(tmp_path: Path) -> Path:
    (tmp_path / "p.yaml").write_text(POLICY)
    return tmp_path


def test_the_token_endpoints_are_the_ones_the_broker_posts_to(pdir):
    p = load_policy_dir(pdir)
    assert token_endpoint(p.secrets["gh"]) == \
        "https://api.github.com/app/installations/77/access_tokens"
    assert token_endpoint(p.secrets["crm"]) == "https://auth.crm.example:8443/oauth/token"


def test_unreachable_token_endpoints_name_rule_secret_and_fix(pdir):
    got = unreachable(load_policy_dir(pdir))
    assert [(u.identity, u.rule.name, u.secret) for u in got] == [
        ("bash-tool", "gh-read", "gh"), ("bash-tool", "crm", "crm")]
    gh, crm = got
    assert "rule 'no-apps' denies it (denied_by_rule)" in gh.message
    assert "POST https://api.github.com/app/installations/77/access_tokens" in gh.message
    assert "narrow deny rule 'no-apps'" in gh.fix
    assert "no rule allows it (no_rule)" in crm.message
    assert ('{name: crm-token, hosts: [auth.crm.example], ports: [8443], methods: [POST], '
            'paths: ["/oauth/token"]}') in crm.fix
    assert str(crm).startswith(f"{pdir / 'p.yaml'}:")


def test_check_fails_on_them(pdir, capsys):
    assert main(["check", str(pdir)]) == 1
    out = capsys.readouterr().out
    assert out.count("unreachable token endpoint: ") == 2
    assert main(["check", "--format", "json", str(pdir)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(u["rule"], u["secret"]) for u in doc["prerequisites"]] == [
        ("gh-read", "gh"), ("crm", "crm")]
    assert main(["check", "--format", "github", str(pdir)]) == 1
    assert capsys.readouterr().out.count("::error file=") == 2
    # the fix, applied, passes
    (pdir / "p.yaml").write_text(POLICY.replace('        paths: ["/app/**"]\n',
                                                '        paths: ["/app/hooks/**"]\n')
                                 .replace("      - name: crm\n", "      - name: crm-token\n"
                                          "        hosts: [auth.crm.example]\n"
                                          "        ports: [8443]\n"
                                          "        methods: [POST]\n"
                                          "      - name: crm\n"))
    assert main(["check", str(pdir)]) == 0, capsys.readouterr().out


def test_explain_says_it_for_the_rule_it_explains(pdir):
    p = load_policy_dir(pdir)
    doc, allowed = explain(p, "bash-tool", "GET", "https://api.github.com/repos/a/b")
    assert allowed and doc["rule"] == "gh-read"
    (msg,) = doc["credentials_unavailable"]
    assert "503 secret_unavailable" in msg and "Fix:" in msg
    doc, _ = explain(p, "agent", "GET", "https://api.github.com/repos/a/b")
    assert doc["rule"] == "gh-api" and "credentials_unavailable" not in doc
