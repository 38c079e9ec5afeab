"""The whole story on the real Docker sandbox network: transparent capture AND the policy DNS,
no proxy variable, and the sandbox's only resolver is Sandgate's DNS (the capture table lets
DNS through to it alone; nothing opened with allow_host_services).

One sandbox resolves an allowed name through Sandgate (getent), then reaches it over HTTPS with
curl and the key injected (real OpenBao), Sandgate dialling the very address its DNS answered
(the name resolves nowhere else: the dialer reads the DNS answer table); a denied name does not
resolve and the recording upstream resolver never sees it; DNS to any other resolver gets
nothing and is counted, in the table and in /metrics (sandgate_capture_packets_total).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandgate.capture import nftables as capture
from sandgate.sandbox import Sandbox, SandboxSpec
from tests.integration.conftest import ANTHROPIC_KEY, HERE, Proxy, free_port
from tests.integration.docker.conftest import SESSION, TEST_LABEL
from tests.support.dnsrecorder import RecordingResolver
from tests.support.pki import make_pki
from tests.support.transparent_docker import (
    curl_gets_the_key,
    transparent_sandgate,
    upstream_on_lo,
)
from tests.support.upstream import UpstreamServer

UPSTREAM, ELSEWHERE = "198.51.100.66", "198.51.100.67"  # on the host's lo for this module
API, DENIED = "api.transparent.test", "denied.transparent.test"  # policies_transparent
RECORDER = "127.0.69.53"  # the upstream resolver Sandgate asks (and only Sandgate)
ADMIN = "127.0.69.2"  # /metrics
ZONE = {API: {"A": [UPSTREAM]}, DENIED: {"A": [ELSEWHERE]}}


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingResolver]:
    with RecordingResolver(RECORDER, 53, ZONE) as r:
        yield r


@pytest.fixture(scope="module")
def world(tmp_path_factory, docker_client, sandbox_network, vault,
          recorder) -> Iterator[tuple[Proxy, UpstreamServer, str]]:
    tmp = tmp_path_factory.mktemp("capdns")
    pki = make_pki(tmp / "pki", [API, DENIED])
    dns_port, admin = free_port(), f"{ADMIN}:{free_port()}"
    # no --resolve for API: only the policy DNS's answer tells Sandgate where it is
    with upstream_on_lo(UPSTREAM, pki) as up, \
            transparent_sandgate(tmp, HERE / "policies_transparent", vault, pki, docker_client,
                                 sandbox_network, "--dns", f"{sandbox_network.gateway}:{dns_port}",
                                 "--dns-upstream", f"{RECORDER}:53", "--admin", admin,
                                 "--admin-open", "/metrics", dns_port=dns_port) as p:
        yield p, up, f"http://{admin}/metrics"


@pytest.fixture(scope="module")
def sbx(world, docker_client, sandbox_network) -> Iterator[Sandbox]:
    p, _, _ = world
    spec = SandboxSpec(identity="coding-agent", image="sandgate-bash-tool:dev",
                       proxy_url=p.url, ca_pem=p.ca.read_text(), transparent=True,
                       dns=sandbox_network.gateway, labels={TEST_LABEL: SESSION})
    s = Sandbox.create(docker_client, spec)
    yield s
    s.close()


def dropped_dns(metrics_url: str, bridge: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sandgate_capture_packets_total" and s.labels == {
                    "network": capture.table_name(bridge)[len("sandgate_capture_"):],
                    "counter": "dropped_dns"}:
                return int(s.value)
    raise AssertionError(f"no dropped_dns counter for {bridge} in /metrics")


def test_resolve_through_sandgate_then_reach_the_answered_address(world, sbx, recorder):
    p, up, _ = world
    env = sbx.exec("env")
    assert "proxy" not in env.stdout.lower(), env.stdout
    got = sbx.exec(["getent", "hosts", API], timeout=30)
    assert got.exit_code == 0 and got.stdout.split()[0] == UPSTREAM, got.stdout + got.stderr
    assert (API, "A") in recorder.seen
    curl_gets_the_key(sbx, up, f"https://{API}/v1/messages", ANTHROPIC_KEY)
    ev = p.wait_audit(lambda e: e.get("event") == "request" and e.get("host") == API)
    assert ev["identity"] == "coding-agent" and ev["identity_source"] == "docker"
    assert ev["dialed"] == f"{UPSTREAM}:443"  # the address the policy DNS answered


def test_denied_name_does_not_resolve_and_never_leaves(world, sbx, recorder):
    p, _, _ = world
    no = sbx.exec(["getent", "hosts", DENIED], timeout=30)
    assert no.exit_code == 2 and no.stdout == "", (no.stdout, no.stderr)
    ev = p.wait_audit(lambda e: e.get("event") == "dns" and e.get("host") == DENIED)
    assert ev["identity"] == "coding-agent" and ev["decision"] == "deny"
    assert ev["sandbox"] == sbx.id
    assert DENIED not in recorder.names()


def test_other_resolvers_get_nothing_and_are_counted(world, sbx, sandbox_network, recorder):
    _, _, metrics_url = world
    before = capture.counters(sandbox_network.bridge)
    assert before is not None
    scraped = dropped_dns(metrics_url, sandbox_network.bridge)
    # two public resolvers, and Sandgate's own address on another port than its DNS
    r = sbx.exec(["sh", "-c", "; ".join(
        f"dig +tries=1 +time=1 -p {port} @{server} {API}" for server, port in
        (("8.8.8.8", 53), ("1.1.1.1", 53), (sandbox_network.gateway, 5353)))], timeout=30)
    assert "ANSWER SECTION" not in r.stdout, r.stdout
    after = capture.counters(sandbox_network.bridge)
    assert after is not None
    assert after["dropped_dns"]["packets"] >= before["dropped_dns"]["packets"] + 2
    assert after["dropped_udp"]["packets"] > before["dropped_udp"]["packets"]  # port 5353
    assert dropped_dns(metrics_url, sandbox_network.bridge) >= scraped + 2
