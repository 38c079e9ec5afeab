"""`query:`, `public: true` and `max_request_bytes`: one meaning in the parser, decide(), the
address step (judge), and the proxy's hooks."""

from __future__ import annotations

import base64
import ipaddress
import json
from pathlib import Path

import pytest
from mitmproxy.test import taddons, tflow

from sandgate.addons.gate import Gate, GateConfig
from sandgate.audit import events as audit
from sandgate.decision import decide, decide_connect, judge
from sandgate.errors import AddressRefused, Code
from sandgate.explain.answer import explain
from sandgate.identity.resolve import Identifier
from sandgate.netguard import choose_address
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import Policy
from sandgate.request import parse_proxied, parse_query, parse_url
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.tokens import issue_token

# An AS112 address: classifies as public; nothing is ever sent to it here (unit tests).
PUBLIC_IP = "192.175.48.42"

POLICY = """version: v1
identities:
  git:
    rules:
      - name: refs
        hosts: [git.example.com]
        methods: [GET]
        paths: ["/*/info/refs"]
        query: {service: [git-upload-pack]}
      - name: upload
        hosts: [git.example.com]
        methods: [POST]
        paths: ["/*/git-upload-pack"]
        max_request_bytes: 1k
  web:
    rules:
      - {name: intranet, hosts: [wiki.corp.test], private_cidrs: [10.0.0.0/8], schemes: [http]}
      - {name: web, public: true, methods: [GET], schemes: [http, https]}
"""


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    (tmp_path / "p.yaml").write_text(POLICY)
    return load_policy_dir(tmp_path)


# --- the one query parser ---------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "want"), [
    ("", ()),
    ("service=git-upload-pack", (("service", "git-upload-pack"),)),
    ("a&b=&c=1", (("a", ""), ("b", ""), ("c", "1"))),
    ("a=1&&b=2&", (("a", "1"), ("b", "2"))),
    ("servic%65=git%2Dupload-pack", (("service", "git-upload-pack"),)),  # decoded once
    ("q=%2541", (("q", "%41"),)),  # ...and only once
    ("q=%C3%A9", (("q", "é"),)),
    ("q=a=b", (("q", "a=b"),)),
    ("q=a+b", None),  # '+': space or plus? servers differ
    ("q=%2", None), ("q=%zz", None), ("q=%FF", None),  # malformed escape, not UTF-8
    ("a=1;service=x", None), ("a=1#b", None),  # ';' and '#': other parsers split there
])
def test_parse_query(raw, want):
    assert parse_query(raw) == want


def test_parse_url_and_parse_proxied_read_the_query_alike():
    for qs in ("service=git-upload-pack", "a=1&a=2", "q=a+b", "x=%zz", ""):
        u = parse_url("GET", f"https://git.example.com/r/info/refs?{qs}")
        p = parse_proxied("https", "git.example.com", 443, "GET", f"/r/info/refs?{qs}",
                          "git.example.com")
        assert u == p and u.query == parse_query(qs)


# --- query: in decide() -----------------------------------------------------------------------


@pytest.mark.parametrize(("qs", "allowed"), [
    ("service=git-upload-pack", True),
    ("service=git-upload-pack&x=1", True),  # other parameters are not constrained
    ("service=git-upload-pack&service=git-upload-pack", True),  # repeated, same value
    ("service=git%2Dupload%2Dpack", True),  # the decoded value is compared
    ("service=git-receive-pack", False),  # the canonical case: push refused
    ("", False),  # missing
    ("service=", False),
    ("service=git-upload-pack&service=git-receive-pack", False),  # ambiguous
    ("service=git-receive-pack&service=git-upload-pack", False),
    ("service=git-upload-pack&Service=git-receive-pack", False),  # case variant
    ("Service=git-upload-pack", False),  # names are exact
    ("service=git+upload-pack", False),
    ("service=git-upload-pack;service=git-receive-pack", False),
    ("service=git-upload-pack&x=%zz", False),  # unreadable query: no constraint matches
    ("service=GIT-UPLOAD-PACK", False),  # values are exact
])
def test_query_constraint(policy, qs, allowed):
    url = "https://git.example.com/repo.git/info/refs" + (f"?{qs}" if qs else "")
    d = decide(policy, "git", parse_url("GET", url))
    assert d.allowed is allowed, d.reason
    if not allowed:
        assert d.code is Code.NO_RULE
        assert "rule 'refs' allows this host for query service=git-upload-pack" in (d.hint or "")
    v = judge(policy, "git", "GET", url, {})  # check and explain: the same
    assert v.decision.allowed is allowed
    assert v.request.endswith(f"?{qs}" if qs else "/info/refs")


def test_query_hint_says_why(policy):
    def hint(qs: str) -> str:
        d = decide(policy, "git", parse_url("GET", f"https://git.example.com/r/info/refs?{qs}"))
        return d.hint or ""

    assert "more than once" in hint("service=git-upload-pack&service=x")
    assert "has no service" in hint("x=1")
    assert "cannot be read unambiguously" in hint("service=a+b")
    assert "other letter case" in hint("service=git-upload-pack&SERVICE=x")


def test_query_rule_does_not_decide_a_connect(policy):
    d = decide_connect(policy, "git", "git.example.com", 443)
    assert d.allowed and d.rule is not None and not d.rule.passthrough  # judged per request


# --- public: true -----------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["example.org", "a.b.c.example", "xn--bcher-kva.example",
                                  "x", PUBLIC_IP, "10.1.2.3", "127.0.0.1"])
def test_public_matches_any_host_in_decide(policy, host):
    d = decide(policy, "web", parse_url("GET", f"https://{host}/any/path?x=1"))
    assert d.allowed and d.rule is not None and d.rule.name == "web"
    assert not decide(policy, "web", parse_url("POST", f"https://{host}/")).allowed


@pytest.mark.parametrize(("host", "resolve", "code"), [
    ("127.0.0.1", {}, Code.INTERNAL_ADDRESS),  # IP literal: the address step knows it
    ("10.9.9.9", {}, Code.INTERNAL_ADDRESS),
    ("inside.test", {"inside.test": "127.0.0.2"}, Code.INTERNAL_ADDRESS),  # --resolve
    ("meta.test", {"meta.test": "169.254.169.254"}, Code.INTERNAL_ADDRESS),
    ("ok.test", {"ok.test": PUBLIC_IP}, None),
    (PUBLIC_IP, {}, None),
])
def test_public_address_step(policy, host, resolve, code):
    v = judge(policy, "web", "GET", f"https://{host}/", resolve)
    assert v.decision.allowed is (code is None), v.decision.reason
    assert v.decision.code is code
    if code is not None:
        assert "public: true" in v.decision.reason and v.decision.rule_name == "web"


def test_public_rule_refuses_a_name_with_any_private_address():
    ips = [ipaddress.ip_address(PUBLIC_IP), ipaddress.ip_address("10.0.0.1")]
    assert str(choose_address("h", 443, ips, ()).ip) == PUBLIC_IP  # a named host: the public one
    with pytest.raises(AddressRefused) as e:
        choose_address("h", 443, ips, (), only_public=True)
    assert e.value.code is Code.INTERNAL_ADDRESS and "10.0.0.1 is" in e.value.reason


def test_public_explain_and_a_named_private_host_still_works(policy):
    out, ok = explain(policy, "web", "GET", "https://example.org/")
    assert ok and "public" in out
    v = judge(policy, "web", "GET", "http://wiki.corp.test/", {"wiki.corp.test": "10.1.2.3"})
    assert v.decision.allowed and v.decision.rule_name == "intranet"


def test_public_connect_is_intercepted(policy):
    d = decide_connect(policy, "web", "anything.example", 443)
    assert d.allowed and d.rule is not None and d.rule.public and not d.rule.passthrough


# --- the proxy's hooks ------------------------------------------------------------------------

KEY = b"k" * 32


def make_gate(tmp_path: Path, policy: Policy, resolve: dict[str, str],
              max_body: int = 32 * 1024 * 1024) -> Gate:
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    g = Gate(GateConfig(policy=policy, broker=broker, identifier=Identifier(KEY),
                        audit=audit.AuditLog(tmp_path / "audit.jsonl"),
                        resolve_overrides=resolve, max_request_body=max_body))
    return g


def flow(identity: str, method: str, host: str, path: str, body: bytes = b"",
         scheme: str = "http"):
    f = tflow.tflow()
    f.request.scheme = scheme
    f.request.method = method
    f.request.host = host
    f.request.port = 80
    f.request.path = path
    f.request.headers["host"] = host
    f.request.content = body
    tok = issue_token(KEY, identity, ttl_seconds=60)
    f.request.headers["proxy-authorization"] = "Basic " + base64.b64encode(
        f"{identity}:{tok}".encode()).decode()
    return f


PLAIN = POLICY.replace("methods: [GET]\n        paths", "schemes: [http]\n        methods: [GET]"
                       "\n        paths").replace("methods: [POST]", "schemes: [http]\n"
                                                   "        methods: [POST]")


@pytest.fixture
def plain_policy(tmp_path: Path) -> Policy:
    d = tmp_path / "pol"
    d.mkdir()
    (d / "p.yaml").write_text(PLAIN.replace("hosts: [git.example.com]",
                                            "hosts: [git.example.com]\n        private_cidrs: "
                                            "[127.0.0.0/8]"))
    return load_policy_dir(d)


async def test_gate_query(tmp_path, plain_policy):
    g = make_gate(tmp_path, plain_policy, {"git.example.com": "127.0.0.1"})
    with taddons.context(g):
        ok = flow("git", "GET", "git.example.com", "/r/info/refs?service=git-upload-pack")
        await g.requestheaders(ok)
        await g.request(ok)
        assert ok.response is None and ok.request.host == "127.0.0.1"
        push = flow("git", "GET", "git.example.com", "/r/info/refs?service=git-receive-pack")
        await g.requestheaders(push)
        assert push.response is not None and push.response.status_code == 403
        assert json.loads(push.response.content)["code"] == "no_rule"


@pytest.mark.parametrize(("size", "declared", "global_max", "refused"), [
    (1024, True, 32 * 1024 * 1024, False),
    (1025, True, 32 * 1024 * 1024, True),  # the rule's limit (1k)
    (1025, False, 32 * 1024 * 1024, True),  # as received (no length declared up front)
    (600, True, 512, True),  # the proxy's limit is smaller: it wins
])
async def test_gate_max_request_bytes(tmp_path, plain_policy, size, declared, global_max,
                                      refused):
    g = make_gate(tmp_path, plain_policy, {"git.example.com": "127.0.0.1"}, global_max)
    with taddons.context(g):
        f = flow("git", "POST", "git.example.com", "/r/git-upload-pack", b"x" * size)
        if declared:
            await g.requestheaders(f)
        else:
            del f.request.headers["content-length"]
        await g.request(f)
        if not refused:
            assert f.response is None
            return
        assert f.response is not None and f.response.status_code == 413
        body = json.loads(f.response.content)
        assert body["code"] == "too_large"
        limit = min(1024, global_max)
        assert f"({limit} bytes)" in body["reason"]
        assert ("max_request_bytes" in body["reason"]) is (limit == 1024)


async def test_gate_max_request_bytes_applies_only_to_its_rule(tmp_path, plain_policy):
    g = make_gate(tmp_path, plain_policy, {"ok.test": PUBLIC_IP})
    with taddons.context(g):
        f = flow("web", "GET", "ok.test", "/", b"x" * 4096)
        await g.requestheaders(f)
        await g.request(f)
        assert f.response is None


async def test_gate_public_rule(tmp_path, plain_policy):
    g = make_gate(tmp_path, plain_policy, {"ok.test": PUBLIC_IP, "inside.test": "127.0.0.2",
                                            "wiki.corp.test": "10.1.2.3"})
    with taddons.context(g):
        ok = flow("web", "GET", "ok.test", "/page")
        await g.requestheaders(ok)
        await g.request(ok)
        assert ok.response is None and ok.request.host == PUBLIC_IP  # dials the checked address
        inside = flow("web", "GET", "inside.test", "/")
        await g.requestheaders(inside)
        await g.request(inside)
        assert inside.response is not None and inside.response.status_code == 403
        assert json.loads(inside.response.content)["code"] == "internal_address"
        wiki = flow("web", "GET", "wiki.corp.test", "/")  # a rule naming it, with its range
        await g.requestheaders(wiki)
        await g.request(wiki)
        assert wiki.response is None and wiki.request.host == "10.1.2.3"
