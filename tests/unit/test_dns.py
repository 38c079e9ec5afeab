"""The policy DNS: decide_name (the name-level decision), its policy schema and fixtures, and
the server's one answer path with a scripted upstream (sandgate.dns)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import tempfile
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.decision import decide_name, decide_request
from sandgate.dns.bounds import DnsLimits, SourceRates
from sandgate.dns.cache import ANSWERED, AddressCache
from sandgate.dns.resolver import Upstream
from sandgate.dns.server import PolicyDns, formerr
from sandgate.errors import Code
from sandgate.identity.base import Caller
from sandgate.netguard import resolve
from sandgate.policy.fixtures import run_policy_tests
from sandgate.policy.loader import PolicyError, load_policy_files
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo
from tests.unit.fuzz import examples
from tests.unit.test_fuzz_decide import load, policies, requests

pytestmark = pytest.mark.unit


def _policy(doc: dict[str, Any]) -> Policy:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.yaml"
        path.write_text(json.dumps({"version": "v1", **doc}), encoding="utf-8")
        return load_policy_files([path])


def _problems(doc: dict[str, Any]) -> str:
    with pytest.raises(PolicyError) as e:
        _policy(doc)
    return str(e.value)


RULES: list[dict[str, Any]] = [
    {"name": "api", "hosts": ["api.example.com"]},
    {"name": "cdn", "hosts": ["*.cdn.example.com"]},
    {"name": "no-bad", "action": "deny", "hosts": ["bad.cdn.example.com"]},
    {"name": "no-admin", "action": "deny", "hosts": ["api.example.com"], "paths": ["/admin/**"]},
    {"name": "tunnel", "hosts": ["db.example.com"], "passthrough": True},
    {"name": "tunnel-inspected", "hosts": ["git.example.com"], "passthrough": True},
    {"name": "no-push", "action": "deny", "hosts": ["git.example.com"], "methods": ["POST"]},
    {"name": "plain-only", "hosts": ["plain.example.com"], "schemes": ["http"]},
    {"name": "no-plain-https", "action": "deny", "hosts": ["plain.example.com"]},
    {"name": "txt", "hosts": ["txt.example.com"], "dns": {"types": ["txt", "MX"]}},
]
POLICY = _policy({"identities": {"agent": {"rules": RULES}, "other": {}}})


@pytest.mark.parametrize("name,qtype,allowed,code,rule", [
    ("api.example.com", "A", True, None, "api"),
    ("API.Example.COM.", "AAAA", True, None, "api"),  # spelled as resolvers send it
    ("a.b.cdn.example.com", "A", True, None, "cdn"),
    ("cdn.example.com", "A", False, Code.NO_RULE, None),  # a wildcard is not its apex
    ("bad.cdn.example.com", "A", False, Code.DENIED_BY_RULE, "no-bad"),
    ("db.example.com", "A", True, None, "tunnel"),
    # a passthrough rule a deny rule must inspect is refused at CONNECT: nothing reaches it
    ("git.example.com", "A", False, Code.DENIED_BY_RULE, "no-push"),
    # a deny rule on https does not refuse the rule's http
    ("plain.example.com", "A", True, None, "plain-only"),
    ("api.example.com", "TXT", False, Code.NO_RULE, None),
    ("api.example.com", "ANY", False, Code.NO_RULE, None),
    ("txt.example.com", "TXT", True, None, "txt"),
    ("txt.example.com", "MX", True, None, "txt"),
    ("txt.example.com", "NULL", False, Code.NO_RULE, None),
    ("data.attacker.example", "A", False, Code.NO_RULE, None),
    ("1.2.3.4", "A", False, Code.BAD_REQUEST, None),
    ("bad name.example", "A", False, Code.BAD_REQUEST, None),
])
def test_decide_name(name: str, qtype: str, allowed: bool, code: Code | None,
                     rule: str | None) -> None:
    d = decide_name(POLICY, "agent", name, qtype)
    assert (d.allowed, d.code, d.rule_name) == (allowed, code, rule), d.reason
    assert d.reason


def test_decide_name_identity_and_hints() -> None:
    d = decide_name(POLICY, "other", "api.example.com")
    assert d.code == Code.NO_RULE and "identities.other.rules" in (d.hint or "")
    assert decide_name(POLICY, "ghost", "api.example.com").code == Code.UNKNOWN_IDENTITY
    d = decide_name(POLICY, "agent", "api.example.com", "TXT")
    assert "dns: {types: [TXT]}" in (d.hint or "")


def test_public_rule_resolves_any_name() -> None:
    p = _policy({"identities": {"agent": {"rules": [{"name": "web", "public": True}]}}})
    assert decide_name(p, "agent", "anything.example").allowed
    assert not decide_name(p, "agent", "anything.example", "TXT").allowed


@settings(max_examples=examples(80), deadline=None)
@given(policies, st.lists(requests(), min_size=1, max_size=8))
def test_every_host_the_proxy_lets_through_resolves(rules: list[dict[str, Any]],
                                                    reqs: list[tuple[RequestInfo, str]]) -> None:
    """Soundness for the sandboxes: whatever request the proxy forwards (allowed or tunnelled),
    its host's name resolves; a name that does not resolve is one no request reaches."""
    try:
        p = load(rules, True)
    except PolicyError:
        return
    for req, host in reqs:
        if decide_request(p, "agent", req).allowed and not host[-1].isdigit() \
                and ":" not in host:
            assert decide_name(p, "agent", host).allowed, (req, rules)


@pytest.mark.parametrize("rule,needle", [
    ({"name": "d", "action": "deny", "hosts": ["a.example"], "dns": {"types": ["TXT"]}},
     "a deny rule cannot have `dns:`"),
    ({"name": "p", "public": True, "dns": {"types": ["TXT"]}}, "`public: true` rule cannot"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": ["ANY"]}}, "never answered"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": ["AXFR"]}}, "never answered"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": ["A"]}}, "always answered"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": ["NOPE"]}}, "not a DNS query type"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": ["TXT", "txt"]}}, "listed twice"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"types": []}}, "types"),
    ({"name": "t", "hosts": ["a.example"], "dns": {"typo": ["TXT"]}}, "typo"),
])
def test_rule_dns_schema_is_strict(rule: dict[str, Any], needle: str) -> None:
    assert needle in _problems({"identities": {"agent": {"rules": [rule]}}})


def test_dns_fixtures_run_and_their_errors_are_clear() -> None:
    tests = [
        {"identity": "agent", "dns": "api.example.com", "expect": "resolve", "rule": "api"},
        {"identity": "agent", "dns": "txt.example.com", "type": "txt", "expect": "resolve"},
        {"identity": "agent", "dns": "evil.example", "expect": "refuse"},
        {"identity": "agent", "dns": "evil.example", "expect": "resolve"},  # fails
    ]
    p = _policy({"identities": {"agent": {"rules": RULES}}, "tests": tests})
    results = run_policy_tests(p)
    assert [r.passed for r in results] == [True, True, True, False]
    assert "expected resolve, got refuse" in results[3].message
    base = {"identities": {"agent": {"rules": RULES}}}
    for bad, needle in [
        ({"identity": "agent", "dns": "a.example", "request": "GET https://a.example/",
          "expect": "resolve"}, "either `request` or `dns`"),
        ({"identity": "agent", "dns": "a.example", "expect": "allow"}, "resolve or refuse"),
        ({"identity": "agent", "request": "GET https://a.example/", "expect": "resolve"},
         "are for `dns` fixtures"),
        ({"identity": "agent", "expect": "deny"}, "needs `request` (or `dns`)"),
        ({"identity": "agent", "dns": "a.example", "type": "BOGUS", "expect": "refuse"},
         "not a DNS query type"),
        ({"identity": "agent", "dns": "a.example", "expect": "refuse", "code": "no_rule"},
         "`code` is for request fixtures"),
    ]:
        assert needle in _problems({**base, "tests": [bad]}), bad


# --- the server's answer path, with a scripted upstream ----------------------------------------


class ScriptedUpstream(Upstream):
    """The real resolver logic (chains, cache) over answers scripted per question."""

    def __init__(self, zone: dict[tuple[str, str], list[str]]) -> None:
        super().__init__([("192.0.2.53", 53)], answered=AddressCache())
        self.zone = zone
        self.asked: list[tuple[str, str]] = []

    async def _ask(self, name: dns.name.Name, rdtype: dns.rdatatype.RdataType
                   ) -> dns.message.Message:
        n = name.to_text(omit_final_dot=True)
        t = dns.rdatatype.to_text(rdtype)
        self.asked.append((n, t))
        q = dns.message.make_query(name, rdtype)
        resp = dns.message.make_response(q)
        lines = self.zone.get((n, t)) or self.zone.get((n, "*"))
        if lines is None:
            resp.set_rcode(dns.rcode.NXDOMAIN)
            return resp
        for line in lines:  # "owner TTL TYPE rdata"
            owner, ttl, typ, data = line.split(" ", 3)
            data += "." if typ == "CNAME" else ""
            rr = dns.rrset.from_text(owner + ".", int(ttl), "IN", typ, data)
            resp.find_rrset(resp.answer, rr.name, rr.rdclass, rr.rdtype, create=True).update(rr)
        return dns.message.from_wire(resp.to_wire())  # as it comes off the wire


ZONE = {
    ("api.example.com", "A"): ["api.example.com 300 A 5.6.7.8",
                               "api.example.com 300 A 5.6.7.9"],
    ("api.example.com", "AAAA"): ["api.example.com 30 AAAA 2606:4700::1",
                                  "api.example.com 30 AAAA ::ffff:10.0.0.1"],
    ("x.cdn.example.com", "A"): ["x.cdn.example.com 100 CNAME edge.other.net",
                                 "edge.other.net 20 A 5.6.7.10", "edge.other.net 20 A 10.0.0.1"],
    ("y.cdn.example.com", "A"): ["y.cdn.example.com 100 CNAME y.cdn.example.com"],
    ("z.cdn.example.com", "A"): [f"z{i}.cdn.example.com 100 CNAME z{i + 1}.cdn.example.com"
                                 .replace("z0.", "z.") for i in range(12)],
    ("w.cdn.example.com", "*"): ["w.cdn.example.com 100 CNAME far.other.net"],
    ("far.other.net", "A"): ["far.other.net 40 A 5.6.7.11"],
    ("txt.example.com", "TXT"): ['txt.example.com 300 TXT "v=spf1 -all"'],
}
AGENT = Caller("agent", "sbx-1", "cidr")


def _server(**limits: Any) -> tuple[PolicyDns, ScriptedUpstream, list[tuple[str, dict]],
                                     list[str]]:
    up = ScriptedUpstream(ZONE)
    events: list[tuple[str, dict]] = []
    counts: list[str] = []
    srv = PolicyDns(lambda: POLICY, lambda ip: AGENT if ip == "10.0.0.5" else None, up,
                    DnsLimits(**limits), lambda ev, **f: events.append((ev, f)),
                    counts.append)
    return srv, up, events, counts


def _ask(srv: PolicyDns, name: str, rdtype: str = "A", source: str = "10.0.0.5",
         tcp: bool = False) -> dns.message.Message:
    wire = dns.message.make_query(name, rdtype).to_wire()
    out = asyncio.run(srv.answer(wire, source, udp=not tcp))
    assert out is not None
    return dns.message.from_wire(out)


def test_allowed_answer_is_bounded_and_dialable() -> None:
    srv, _up, events, counts = _server(max_ttl=60, max_answers=1)
    r = _ask(srv, "api.example.com")
    assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.RA
    [rrset] = r.answer
    assert rrset.ttl == 60 and len(rrset) == 1  # of the two the upstream gave
    assert {x.to_text() for x in rrset} <= {"5.6.7.8", "5.6.7.9"}
    r = _ask(srv, "API.example.com", "AAAA")  # a private address behind ::ffff: is dropped
    assert [x.to_text() for x in r.answer[0]] == ["2606:4700::1"] and r.answer[0].ttl == 30
    assert r.answer[0].name.to_text() == "API.example.com."  # under the asked spelling
    assert events[0][0] == "dns" and events[0][1]["decision"] == "allow"
    assert events[0][1]["answers"] == 1 and counts == ["answer", "answer"]


def test_cname_chains_are_answered_under_the_asked_name() -> None:
    srv, up, _, _ = _server()
    r = _ask(srv, "x.cdn.example.com")
    assert [(rr.name.to_text(), dns.rdatatype.to_text(rr.rdtype), rr.ttl,
             [x.to_text() for x in rr]) for rr in r.answer] == \
        [("x.cdn.example.com.", "A", 20, ["5.6.7.10"])]
    r = _ask(srv, "w.cdn.example.com")  # the chain's end asked for separately
    assert [x.to_text() for x in r.answer[0]] == ["5.6.7.11"]
    assert ("far.other.net", "A") in up.asked
    assert _ask(srv, "y.cdn.example.com").rcode() == dns.rcode.SERVFAIL  # a loop
    assert _ask(srv, "z.cdn.example.com").rcode() == dns.rcode.SERVFAIL  # too long a chain


def test_refusals_never_reach_the_upstream() -> None:
    srv, up, events, counts = _server()
    assert _ask(srv, "data.attacker.example").rcode() == dns.rcode.NXDOMAIN
    assert _ask(srv, "api.example.com", "TXT").rcode() == dns.rcode.REFUSED
    assert _ask(srv, "api.example.com", "ANY").rcode() == dns.rcode.REFUSED
    assert _ask(srv, "api.example.com", source="10.9.9.9").rcode() == dns.rcode.REFUSED
    assert up.asked == []
    assert [e[1]["decision"] for e in events] == ["deny"] * 4
    assert events[0][1]["identity"] == "agent" and events[0][1]["host"] == \
        "data.attacker.example"
    assert events[3][1]["code"] == "auth_invalid"
    assert counts == ["nxdomain", "refused", "refused", "unknown_source"]
    srv2, _up2, _, _ = _server(refuse="refused")
    assert _ask(srv2, "data.attacker.example").rcode() == dns.rcode.REFUSED
    r = _ask(srv, "txt.example.com", "TXT")
    assert [x.to_text() for x in r.answer[0]] == ['"v=spf1 -all"']


def test_rate_limit_per_source_is_counted() -> None:
    srv, _up, _, counts = _server(rps=1, burst=3)
    codes = [_ask(srv, "api.example.com").rcode() for _ in range(6)]
    assert codes[:3] == [dns.rcode.NOERROR] * 3
    assert dns.rcode.REFUSED in codes[3:] and "rate_limited" in counts
    rates = SourceRates(1, 1, max_sources=2)
    assert rates.admit("a") and not rates.admit("a") and rates.admit("b") and rates.admit("c")
    assert rates.admit("a")  # evicted (bounded table): starts afresh


def test_query_shape_is_bounded() -> None:
    srv, up, _, counts = _server()
    q = dns.message.make_query("api.example.com", "A")
    q.question.append(q.question[0])
    out = asyncio.run(srv.answer(q.to_wire(), "10.0.0.5"))
    assert out is not None and dns.message.from_wire(out).rcode() == dns.rcode.FORMERR
    r = dns.message.make_response(dns.message.make_query("api.example.com", "A"))
    assert asyncio.run(srv.answer(r.to_wire(), "10.0.0.5")) is None  # never answer answers
    big = dns.message.make_query("api.example.com", "A").to_wire() + b"\0" * 600
    out = asyncio.run(srv.answer(big, "10.0.0.5"))
    assert out is not None and out[3] & 0x0F == dns.rcode.FORMERR
    assert up.asked == [] and counts.count("formerr") == 2


@settings(max_examples=examples(300), deadline=None)
@given(st.one_of(
    st.binary(max_size=600),
    st.builds(lambda q, i, b: q[:i] + b + q[i + len(b):],
              st.just(dns.message.make_query("data.attacker.example", "TXT").to_wire()),
              st.integers(0, 40), st.binary(min_size=1, max_size=8))))
def test_arbitrary_bytes_never_crash_and_get_formerr_or_a_judged_answer(data: bytes) -> None:
    srv, up, _, _ = _server()
    out = asyncio.run(srv.answer(data, "10.0.0.5"))
    if out is None:
        return
    assert out[:2] == data[:2] and out[2] & 0x80  # a response to this query's id
    try:
        dns.message.from_wire(data)
    except Exception:
        assert out[3] & 0x0F == dns.rcode.FORMERR
        return
    assert dns.message.from_wire(out).rcode() in (
        dns.rcode.FORMERR, dns.rcode.NOTIMP, dns.rcode.REFUSED, dns.rcode.NXDOMAIN,
        dns.rcode.NOERROR, dns.rcode.SERVFAIL)
    assert all(n != "data.attacker.example" for n, _ in up.asked)


def test_formerr_of_a_header() -> None:
    assert formerr(b"\x01\x02\x01\x00" + bytes(8)) == b"\x01\x02\x80\x01" + bytes(8)
    assert formerr(b"\x01\x02\x81\x00" + bytes(8)) is None  # a response
    assert formerr(b"\x01") is None


def test_the_dialer_pins_what_the_dns_answered() -> None:
    srv, _up, _, _ = _server()
    srv.upstream.answered = ANSWERED
    try:
        _ask(srv, "api.example.com")
        got = asyncio.run(resolve("api.example.com", 443, {}))
        assert sorted(got) == [ipaddress.ip_address("5.6.7.8"), ipaddress.ip_address("5.6.7.9")]
    finally:
        ANSWERED.clear()
    cache = AddressCache(max_names=1)
    cache.put("a", "A", (ipaddress.ip_address("5.6.7.8"),), 60)
    cache.put("b", "A", (ipaddress.ip_address("5.6.7.9"),), 60)
    assert cache.addresses("a") is None and cache.addresses("b") is not None
    cache.put("c", "A", (ipaddress.ip_address("5.6.7.9"),), 0)
    assert cache.addresses("c") is None  # expired at once


# --- deployment: the compose file and the Kubernetes example point sandboxes at it -------------

REPO = Path(__file__).resolve().parents[2]


def test_kubernetes_example_points_pods_at_the_policy_dns() -> None:
    import yaml

    from sandgate.cli import build_parser

    docs = [d for d in yaml.safe_load_all(
        (REPO / "deploy/kubernetes/examples/policy-dns.yaml").read_text()) if d]
    svc = next(d for d in docs if d["kind"] == "Service")
    pod = next(d for d in docs if d["kind"] == "Pod")
    assert pod["spec"]["dnsPolicy"] == "None"
    assert pod["spec"]["dnsConfig"]["nameservers"] == [svc["spec"]["clusterIP"]]
    assert {(p["port"], p["targetPort"], p["protocol"]) for p in svc["spec"]["ports"]} == \
        {(53, 5353, "UDP"), (53, 5353, "TCP")}
    args = build_parser().parse_args(["run", "--policies", "p", "--dns=0.0.0.0:5353",
                                      "--identity-cidr=10.244.64.0/20=bash-tool"])
    assert args.dns == ("0.0.0.0", 5353)


def test_compose_sandboxes_use_the_policy_dns() -> None:
    import yaml

    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    sandgate = doc["services"]["sandgate"]
    addr = sandgate["networks"]["sandboxes"]["ipv4_address"]
    assert f"--dns={addr}:53" in sandgate["command"]
    for name in ("agent", "bash-tool"):
        assert doc["services"][name]["dns"] == [addr]


def test_sandbox_spec_dns_must_be_an_address() -> None:
    from sandgate.sandbox.engine import SandboxError
    from sandgate.sandbox.launcher import SandboxSpec

    ca = "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"
    SandboxSpec(identity="a", proxy_url="http://172.30.99.1:8080", ca_pem=ca,
                dns="172.30.99.1").validate()
    with pytest.raises(SandboxError, match="policy DNS's IP address"):
        SandboxSpec(identity="a", proxy_url="http://172.30.99.1:8080", ca_pem=ca,
                    dns="sandgate:53").validate()


def test_report_mode_answers_and_audits_as_report() -> None:
    from sandgate.explain.answer import explain_name

    p = _policy({"identities": {"agent": {"mode": "report", "rules": RULES[:1]}}})
    out, resolves = explain_name(p, "agent", "unlisted.example")
    assert resolves and out["decision"] == "report" and out["code"] == "no_rule"
    up = ScriptedUpstream({("unlisted.example", "A"): ["unlisted.example 60 A 5.6.7.20"]})
    events: list[tuple[str, dict]] = []
    srv = PolicyDns(lambda: p, lambda ip: AGENT, up, DnsLimits(),
                    lambda ev, **f: events.append((ev, f)))
    r = _ask(srv, "unlisted.example")
    assert [x.to_text() for x in r.answer[0]] == ["5.6.7.20"]
    assert events[0][1]["decision"] == "report" and events[0][1]["code"] == "no_rule"
    out, resolves = explain_name(POLICY, "agent", "unlisted.example")
    assert not resolves and out["decision"] == "refuse"


def test_answers_are_counted_by_outcome_on_metrics() -> None:
    from prometheus_client import generate_latest

    from sandgate.metrics import Metrics

    m = Metrics(lambda: POLICY)
    srv, _up, _, _ = _server()
    srv.count = lambda outcome: m.dns_answers.labels(outcome).inc()  # as runner.serve wires it
    _ask(srv, "api.example.com")
    _ask(srv, "data.attacker.example")
    text = generate_latest(m.registry).decode()
    assert 'sandgate_dns_answers_total{outcome="answer"} 1.0' in text
    assert 'sandgate_dns_answers_total{outcome="nxdomain"} 1.0' in text
