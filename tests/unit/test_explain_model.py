"""One model of what the proxy does, passthrough and sandbox included: `explain`, fixtures,
proofs and `diff` see a tunnelled request as tunnelled (never as a deny), a per-sandbox rule
as sandbox_required without a sandbox id, and gateway paths as the gateway listener does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandgate.cli import main
from sandgate.decision import decide_connect, decide_request, judge
from sandgate.policy.fixtures import run_policy_tests
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.request import parse_url
from sandgate.review.proofs import prove_narrower

POLICY = """\
version: v1
secrets:
  gh: {vault: "secret/data/sandboxes/{{ sandbox }}/github", field: token}
  llm: {vault: secret/data/llm/anthropic, field: api_key}
identities:
  agent:
    rules:
      - {name: db, hosts: [db.example.com], ports: [5432], passthrough: true}
      - {name: pt, hosts: [tunnel.example.com], passthrough: true}
      - {name: ptw, hosts: ['*.tunnels.example.org'], passthrough: true}
      - {name: plain-pt-host, schemes: [http], hosts: [tunnel.example.com], methods: [GET]}
      - name: github
        hosts: [api.github.com]
        methods: [GET]
        inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}
      - name: anthropic
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {headers: {x-api-key: "{{ secrets.llm }}"}}
gateways:
  - {prefix: /anthropic, upstream: https://api.anthropic.com, token_header: x-api-key}
  - {prefix: /tun, upstream: https://tunnel.example.com, token_header: x-api-key}
"""

TUNNELLED = [("GET", "https://tunnel.example.com/"), ("POST", "https://tunnel.example.com/x"),
             ("DELETE", "https://tunnel.example.com/any/path?q=1"),
             ("GET", "https://db.example.com:5432/"),
             ("PATCH", "https://a.tunnels.example.org/admin"),
             ("GET", "https://a.b.tunnels.example.org/")]


@pytest.fixture
def pdir(tmp_path: Path) -> Path:
    (tmp_path / "p.yaml").write_text(POLICY)
    return tmp_path


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["explain", *args])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("method", "url"), TUNNELLED)
def test_a_tunnelled_request_is_explained_as_tunnel(pdir, capsys, method, url):
    rc, doc = _explain(capsys, "--policies", str(pdir), "--identity", "agent", method, url)
    assert doc["decision"] == "tunnel", doc
    assert doc["rule"] in ("pt", "ptw", "db") and doc["code"] is None
    assert doc["passthrough"] is True and "inject" not in doc
    assert "tunnelled uninspected" in doc["reason"]
    assert rc == 0  # forwarded


def test_tunnel_is_the_decision_the_proxy_takes_at_connect(pdir):
    """The proxy's Tunnel.passthrough is decide_connect(...).tunnel: the same function."""
    policy = load_policy_dir(pdir)
    for method, url in TUNNELLED:
        req = parse_url(method, url)
        c = decide_connect(policy, "agent", req.host, req.port)
        d = decide_request(policy, "agent", req)
        assert c.tunnel and d.tunnel and d.rule == c.rule
    # plain http to the same host is not tunnelled: the proxy judges it (no CONNECT)
    d = decide_request(policy, "agent", parse_url("GET", "http://tunnel.example.com/"))
    assert d.allowed and not d.tunnel and d.rule is not None and d.rule.name == "plain-pt-host"
    # a gateway request to the same upstream has no CONNECT either: passthrough never applies
    v = judge(policy, "agent", "GET", "https://tunnel.example.com/", {}, gateway=True)
    assert v.decision.outcome == "deny" and str(v.decision.code) == "no_rule"


def _fixtures(pdir: Path, tests: str) -> list:
    (pdir / "t.yaml").write_text("version: v1\ntests:\n" + tests)
    return run_policy_tests(load_policy_dir(pdir))


def test_a_deny_fixture_of_a_tunnelled_request_fails(pdir):
    (r,) = _fixtures(pdir, "  - {identity: agent, request: DELETE https://tunnel.example.com/x,"
                     " expect: deny}\n")
    assert not r.passed and "got tunnel" in r.message
    (r,) = _fixtures(pdir, "  - {identity: agent, request: DELETE https://tunnel.example.com/x,"
                     " expect: allow}\n")
    assert not r.passed  # forwarded, but nothing judged it: not an allow either
    (r,) = _fixtures(pdir, "  - {identity: agent, request: DELETE https://x.tunnels.example.org/"
                     "x, expect: tunnel, rule: ptw}\n")
    assert r.passed, r.message
    # a CONNECT fixture keeps its meaning: allowed, passed through
    (r,) = _fixtures(pdir, "  - {identity: agent, request: CONNECT db.example.com:5432, "
                     "expect: allow, passthrough: true}\n")
    assert r.passed, r.message


def test_explain_without_a_sandbox_says_sandbox_required(pdir, capsys):
    rc, doc = _explain(capsys, "--policies", str(pdir), "--identity", "agent", "GET",
                       "https://api.github.com/user")
    assert rc == 1 and doc["decision"] == "deny" and doc["code"] == "sandbox_required"
    assert doc["rule"] == "github" and doc["sandbox"] is None
    rc, doc = _explain(capsys, "--policies", str(pdir), "--identity", "agent", "--sandbox",
                       "sb-1", "GET", "https://api.github.com/user")
    assert rc == 0 and doc["decision"] == "allow" and doc["sandbox"] == "sb-1"
    # an id that cannot go into a secret path is refused, as by the proxy
    rc, doc = _explain(capsys, "--policies", str(pdir), "--identity", "agent", "--sandbox",
                       "../x", "GET", "https://api.github.com/user")
    assert rc == 1 and doc["code"] == "sandbox_required"


def test_fixtures_express_the_sandbox(pdir):
    results = _fixtures(pdir, (
        "  - {identity: agent, request: GET https://api.github.com/u, expect: deny, "
        "code: sandbox_required}\n"
        "  - {identity: agent, request: GET https://api.github.com/u, sandbox: sb-1, "
        "expect: allow, inject: [gh]}\n"
        "  - {identity: agent, request: GET https://api.github.com/u, expect: allow}\n"))
    assert [r.passed for r in results] == [True, True, False]
    assert "sandbox_required" in results[2].message


def test_batch_honours_gateway_and_sandbox(pdir, capsys, tmp_path):
    batch = tmp_path / "b.txt"
    batch.write_text("agent POST /anthropic/v1/messages\nagent GET /tun/x\n")
    rc = main(["explain", "--policies", str(pdir), "--gateway", "--batch", str(batch)])
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["decision"] for d in docs] == ["allow", "deny"]
    assert docs[0]["gateway"] == "/anthropic" and docs[0]["rule"] == "anthropic"
    assert docs[1]["code"] == "no_rule"  # no CONNECT, so the passthrough rule does not apply
    assert rc == 1
    batch.write_text("agent GET https://api.github.com/u\n")
    assert main(["explain", "--policies", str(pdir), "--sandbox", "sb-2", "--batch",
                 str(batch)]) == 0
    assert json.loads(capsys.readouterr().out)["decision"] == "allow"


def test_fixtures_target_gateway_paths(pdir):
    results = _fixtures(pdir, (
        "  - {identity: agent, request: POST /anthropic/v1/messages, gateway: true, "
        "expect: allow, rule: anthropic}\n"
        "  - {identity: agent, request: GET /tun/x, gateway: true, expect: deny, "
        "code: no_rule}\n"))
    assert [r.passed for r in results] == [True, True], [r.message for r in results]
    with pytest.raises(PolicyError) as ei:  # a path no gateway serves: located at load
        _fixtures(pdir, "  - {identity: agent, request: GET /nothing/x, gateway: true, "
                  "expect: deny}\n")
    (p,) = ei.value.problems
    assert (p.line, p.field) == (3, "tests[0].request") and "no gateway serves" in p.message
    assert "/anthropic, /tun" in p.fix


def test_a_tunnel_is_reach_in_proofs(tmp_path):
    (tmp_path / "p.yaml").write_text("""\
version: v1
identities:
  wide:
    rules:
      - {name: pt, hosts: [h.example.com], passthrough: true}
  narrow:
    narrower_than: wide
    rules:
      - {name: get, hosts: [h.example.com], methods: [GET], paths: [/a/**]}
""")
    policy = load_policy_dir(tmp_path)
    assert prove_narrower(policy, "narrow", "wide").ok
    res = prove_narrower(policy, "wide", "narrow")
    assert not res.ok and res.counterexample == "CONNECT h.example.com:443"


def test_diff_traffic_sees_tunnels_sandbox_and_gateway(pdir, tmp_path):
    """Replayed traffic is judged as it came: with its sandbox id and its way in."""
    from sandgate.review.traffic import diff, outcome, read_audit

    def ev(method: str, host: str, path: str, **extra: str) -> str:
        return json.dumps({"event": "request", "identity": "agent", "method": method,
                           "scheme": "https", "host": host, "port": 443, "path": path,
                           "decision": "allow", "secrets": [], **extra})

    audit = [ev("GET", "tunnel.example.com", "/x"),  # inspected once; tunnelled in the new one
             ev("GET", "api.github.com", "/u", sandbox="sb-1"),
             ev("GET", "tunnel.example.com", "/y", gateway="/tun")]
    old = tmp_path / "old"
    old.mkdir()
    (old / "p.yaml").write_text(POLICY.replace("passthrough: true}", "}").replace(
        "{name: plain-pt-host, schemes: [http], ", "{name: plain-pt-host, schemes: [https], "))
    res = diff(load_policy_dir(old), load_policy_dir(pdir), read_audit(audit), {})
    changes = {c.request: (c.old.decision, c.new.decision) for c in res.changes}
    assert changes == {"GET https://tunnel.example.com:443/x": ("allow", "tunnel"),
                       "GET https://tunnel.example.com:443/y": ("allow", "deny")}, changes
    github = read_audit(audit).recorded[1]
    assert outcome(load_policy_dir(pdir), github, {}).decision == "allow"  # with its sandbox
