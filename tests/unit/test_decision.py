"""decide() and decide_connect(): pure judgements over a compiled policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.decision import decide, decide_connect
from sandgate.errors import Code
from sandgate.policy.loader import load_policy_dir
from sandgate.request import RequestInfo

POLICY = """
version: v1
secrets:
  anthropic: {vault: secret/data/llm/anthropic, field: api_key}
identities:
  coding-agent:
    rules:
      - name: llm
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages, /v1/messages/*]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
      - name: docs
        hosts: [docs.example.com, "*.docs.example.com"]
        methods: [GET, HEAD]
      - name: docs-broad
        hosts: [docs.example.com]
      - name: no-admin
        action: deny
        hosts: [docs.example.com]
        paths: [/admin/**]
      - name: plain
        schemes: [http]
        hosts: [plain.example.com]
      - name: alt-port
        hosts: [alt.example.com]
        ports: [8443]
      - name: tunnel
        hosts: [db.example.com]
        passthrough: true
      - name: tunnel-shadowed
        hosts: [shadow.example.com]
        passthrough: true
      - name: shadow-deny
        action: deny
        hosts: [shadow.example.com]
        paths: [/secret/**]
      - name: block-evil
        action: deny
        hosts: ["*.evil.example"]
      - name: evil-allowed
        hosts: [x.evil.example]
  bash-tool:
    rules:
      - {name: packages, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, HEAD]}
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d: Path = tmp_path_factory.mktemp("pol")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


def req(method: str, host: str, path: str = "/", scheme: str = "https",
        port: int | None = None) -> RequestInfo:
    return RequestInfo(scheme, host, port or (443 if scheme == "https" else 80), method, path)


@pytest.mark.parametrize(
    ("identity", "r", "allowed", "rule", "code"),
    [
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages"), True, "llm", None),
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages/batches"), True, "llm",
         None),
        ("coding-agent", req("post", "api.anthropic.com", "/v1//messages"), True, "llm", None),
        # judged resolved, a dot segment would go on unresolved: refused (issue 34)
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/x/../messages"), False, None,
         Code.BAD_REQUEST),
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages/a/b"), False, None,
         Code.NO_RULE),
        ("coding-agent", req("GET", "api.anthropic.com", "/v1/messages"), False, None,
         Code.NO_RULE),
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages%2F..%2F..%2Fadmin"),
         False, None, Code.BAD_REQUEST),
        # default ports and schemes
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages", port=8443), False,
         None, Code.NO_RULE),
        ("coding-agent", req("POST", "api.anthropic.com", "/v1/messages", scheme="http"), False,
         None, Code.NO_RULE),
        ("coding-agent", req("GET", "plain.example.com", scheme="http"), True, "plain", None),
        ("coding-agent", req("GET", "plain.example.com"), False, None, Code.NO_RULE),
        ("coding-agent", req("GET", "plain.example.com", scheme="http", port=443), False, None,
         Code.NO_RULE),
        ("coding-agent", req("GET", "alt.example.com", port=8443), True, "alt-port", None),
        ("coding-agent", req("GET", "alt.example.com"), False, None, Code.NO_RULE),
        # first matching allow in file order; wildcard does not cover the apex
        ("coding-agent", req("GET", "docs.example.com", "/x"), True, "docs", None),
        ("coding-agent", req("DELETE", "docs.example.com", "/x"), True, "docs-broad", None),
        ("coding-agent", req("GET", "a.b.docs.example.com"), True, "docs", None),
        ("coding-agent", req("DELETE", "a.docs.example.com"), False, None, Code.NO_RULE),
        # deny wins, whatever the order and however the path is spelled
        ("coding-agent", req("GET", "docs.example.com", "/admin/users"), False, "no-admin",
         Code.DENIED_BY_RULE),
        ("coding-agent", req("GET", "docs.example.com", "/admin"), False, "no-admin",
         Code.DENIED_BY_RULE),
        ("coding-agent", req("GET", "docs.example.com", "/x/%2e%2e/admin/"), False, None,
         Code.BAD_REQUEST),
        ("coding-agent", req("GET", "docs.example.com", "/Admin"), True, "docs", None),
        ("coding-agent", req("GET", "x.evil.example"), False, "block-evil",
         Code.DENIED_BY_RULE),
        # passthrough rules never match an L7 request
        ("coding-agent", req("GET", "db.example.com"), False, None, Code.NO_RULE),
        # host given in a non-canonical spelling is judged canonically
        ("coding-agent", req("GET", "DOCS.example.com."), True, "docs", None),
        # identities are separate
        ("bash-tool", req("POST", "api.anthropic.com", "/v1/messages"), False, None,
         Code.NO_RULE),
        ("bash-tool", req("GET", "pypi.org", "/simple/"), True, "packages", None),
        ("bash-tool", req("POST", "pypi.org", "/simple/"), False, None, Code.NO_RULE),
        ("nobody", req("GET", "pypi.org"), False, None, Code.UNKNOWN_IDENTITY),
        # unjudgeable requests
        ("coding-agent", req("GET", "docs.example.com", "/a%00"), False, None,
         Code.BAD_REQUEST),
        ("coding-agent", req("GET", "docs.example.com", "noslash"), False, None,
         Code.BAD_REQUEST),
        ("coding-agent", req("GET", "user@docs.example.com"), False, None, Code.BAD_REQUEST),
    ],
)
def test_decide(policy, identity, r, allowed, rule, code):
    d = decide(policy, identity, r)
    assert (d.allowed, d.rule_name, d.code) == (allowed, rule, code), d
    assert d.reason


def test_no_rule_reason_and_hint(policy):
    d = decide(policy, "bash-tool", req("POST", "api.anthropic.com", "/v1/messages"))
    assert d.reason == ("identity 'bash-tool' has no rule allowing "
                        "POST https://api.anthropic.com:443/v1/messages")
    assert d.hint is not None
    assert "identities.bash-tool.rules" in d.hint
    assert "hosts: [api.anthropic.com]" in d.hint
    assert "methods: [POST]" in d.hint
    assert "paths: [/v1/messages]" in d.hint


def test_no_rule_hint_says_what_host_rules_allow(policy):
    d = decide(policy, "bash-tool", req("POST", "pypi.org", "/legacy/"))
    assert d.hint is not None
    assert "rule 'packages' allows this host for methods GET, HEAD" in d.hint
    d = decide(policy, "coding-agent", req("GET", "api.anthropic.com", "/v1/models"))
    assert d.hint is not None
    assert "methods POST" in d.hint and "paths /v1/messages, /v1/messages/*" in d.hint
    d = decide(policy, "coding-agent", req("GET", "alt.example.com"))
    assert d.hint is not None and "ports 8443" in d.hint
    d = decide(policy, "coding-agent", req("GET", "db.example.com"))
    assert d.hint is not None and "passthrough" in d.hint


def test_hint_suggests_scheme_and_port_when_not_default(policy):
    d = decide(policy, "bash-tool", req("GET", "example.org", "/a", scheme="http", port=8080))
    assert d.hint is not None
    assert "schemes: [http]" in d.hint and "ports: [8080]" in d.hint
    assert "no rule of this identity names this host" in d.hint


def test_unknown_identity_lists_known_only_to_operators(policy):
    d = decide(policy, "nobody", req("GET", "pypi.org"))
    assert d.code is Code.UNKNOWN_IDENTITY
    assert d.detail is not None and "bash-tool, coding-agent" in d.detail
    # what a sandbox is shown names no other identity
    refused = d.refused()
    assert "bash-tool" not in refused.reason and "bash-tool" not in (refused.hint or "")


def test_refusals_do_not_show_the_policy_layout(policy):
    d = decide(policy, "coding-agent", req("GET", "docs.example.com", "/admin/x"))
    assert d.code is Code.DENIED_BY_RULE and d.detail is not None and ".yaml:" in d.detail
    refused = d.refused()
    assert ".yaml" not in refused.reason and ".yaml" not in (refused.hint or "")


def test_deny_reason_names_rule(policy):
    d = decide(policy, "coding-agent", req("GET", "docs.example.com", "/admin/x"))
    assert "no-admin" in d.reason and d.rule is not None and d.rule.action == "deny"


@pytest.mark.parametrize(
    ("identity", "host", "port", "allowed", "rule", "code"),
    [
        ("coding-agent", "api.anthropic.com", 443, True, "llm", None),
        ("coding-agent", "API.Anthropic.com.", 443, True, "llm", None),
        ("coding-agent", "api.anthropic.com", 8443, False, None, Code.NO_RULE),
        ("coding-agent", "alt.example.com", 8443, True, "alt-port", None),
        ("coding-agent", "db.example.com", 443, True, "tunnel", None),
        # a deny with an L7 restriction must be able to see requests: tunnel without passthrough
        ("coding-agent", "docs.example.com", 443, True, "docs", None),
        ("coding-agent", "shadow.example.com", 443, False, "shadow-deny", Code.DENIED_BY_RULE),
        # a deny without methods/paths refuses the tunnel itself
        ("coding-agent", "x.evil.example", 443, False, "block-evil", Code.DENIED_BY_RULE),
        # http-only rules do not allow CONNECT
        ("coding-agent", "plain.example.com", 443, False, None, Code.NO_RULE),
        ("coding-agent", "plain.example.com", 80, False, None, Code.NO_RULE),
        ("bash-tool", "api.anthropic.com", 443, False, None, Code.NO_RULE),
        ("bash-tool", "pypi.org", 443, True, "packages", None),
        ("nobody", "pypi.org", 443, False, None, Code.UNKNOWN_IDENTITY),
        ("bash-tool", "pypi.org:443", 443, False, None, Code.BAD_REQUEST),
    ],
)
def test_decide_connect(policy, identity, host, port, allowed, rule, code):
    d = decide_connect(policy, identity, host, port)
    assert (d.allowed, d.rule_name, d.code) == (allowed, rule, code), d
    assert d.reason


def test_passthrough_next_to_intercepted_allow_is_refused_at_load(tmp_path):
    """Found: decide_connect prefers passthrough, so the running proxy tunnelled what `check`
    and `explain` (judging L7 requests) said was limited to GET. The loader refuses it now."""
    from sandgate.policy.loader import PolicyError

    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: inspect, hosts: [x.example.com], methods: [GET]}\n"
        "      - {name: tunnel, hosts: [x.example.com], passthrough: true}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    (p,) = ei.value.problems
    assert p.line == 6 and p.field == "identities.a.rules[1].passthrough"
    assert "'inspect'" in p.message


def test_connect_no_rule_hint(policy):
    d = decide_connect(policy, "coding-agent", "alt.example.com", 443)
    assert d.code is Code.NO_RULE
    assert d.reason == "identity 'coding-agent' has no rule allowing CONNECT alt.example.com:443"
    assert d.hint is not None and "ports 8443" in d.hint
    assert "identities.coding-agent.rules" in d.hint


def test_address_step_is_the_proxys():
    """decide + judge_address: the verdict the gate reaches for a known address."""
    import tempfile

    from sandgate.decision import ADDRESS_UNCHECKED, judge_address
    from sandgate.errors import Code as C
    from sandgate.policy.loader import load_policy_files
    from sandgate.request import parse_url

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "p.yaml"
        p.write_text("version: v1\nidentities:\n  a:\n    rules:\n"
                     "      - {name: r, hosts: [10.0.0.5, x.example]}\n")
        pol = load_policy_files([p])
    req = parse_url("GET", "https://10.0.0.5/")
    d0 = decide(pol, "a", req)
    assert d0.allowed
    d1, note = judge_address(d0, req.host, req.port, {})
    assert not d1.allowed and d1.code == C.INTERNAL_ADDRESS and "10.0.0.5" in note
    req = parse_url("GET", "https://x.example/")
    d2, note = judge_address(decide(pol, "a", req), req.host, req.port, {})
    assert d2.allowed and note == ADDRESS_UNCHECKED
    d3, note = judge_address(decide(pol, "a", req), req.host, req.port,
                             {"x.example": "93.184.216.34"})
    assert d3.allowed and "93.184.216.34" in note
