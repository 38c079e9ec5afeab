"""A Docker sandbox whose only resolver is the policy DNS (SandboxSpec.dns): an allowed name
resolves through Sandgate, a denied one does not, and the recording upstream resolver never
sees the denied name. Identity from the container's Docker labels (its source address)."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest

from sandgate.sandbox import Sandbox, SandboxSpec
from sandgate.sandbox.network import SandboxNetwork, ensure_network_info
from tests.integration.conftest import HERE, Proxy, start_proxy, stop_proxy
from tests.integration.docker.conftest import SESSION, TEST_LABEL
from tests.support.dnsrecorder import RecordingResolver

UPSTREAM = "127.0.65.53"
SUBNET = "172.30.165.0/24"
ZONE = {
    "api.allowed.test": {"A": ["5.6.7.8"]},
    "pypi.allowed.test": {"A": ["5.6.7.13"]},
    "secret-data.attacker.test": {"A": ["6.6.6.6"]},
}


@pytest.fixture(scope="module")
def dns_network(docker_client: docker.DockerClient) -> Iterator[SandboxNetwork]:
    name = f"sandgate-dns-{SESSION}"
    # Not this test's subject: the host firewall that lets the sandboxes reach Sandgate's DNS
    # port at the gateway (and nothing else) is the sandbox network's; here the launcher is
    # told to leave the gateway open (allow_host_services) on this test-only network.
    info = ensure_network_info(docker_client, name, SUBNET, host_firewall=False)
    yield info
    docker_client.networks.get(name).remove()


@pytest.fixture(scope="module")
def recorder() -> Iterator[RecordingResolver]:
    with RecordingResolver(UPSTREAM, 53, ZONE) as r:
        yield r


@pytest.fixture(scope="module")
def dns_sandgate(tmp_path_factory, vault, pki, recorder, dns_network) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("dnsdocker"), HERE / "policies_dns",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--dns", f"{dns_network.gateway}:53", "--dns-upstream", f"{UPSTREAM}:53",
                    "--docker-network", dns_network.name)
    yield p
    stop_proxy(p)


def test_sandbox_resolves_only_what_its_identity_may_reach(
        docker_client: docker.DockerClient, dns_network: SandboxNetwork, dns_sandgate: Proxy,
        recorder: RecordingResolver, ca_pem: str) -> None:
    spec = SandboxSpec(identity="agent", proxy_url=f"http://{dns_network.gateway}:8080",
                       ca_pem=ca_pem, network=dns_network.name, dns=dns_network.gateway,
                       labels={TEST_LABEL: SESSION}, allow_host_services=True)
    with Sandbox.create(docker_client, spec) as sbx:
        ok = sbx.exec(["getent", "hosts", "api.allowed.test"], timeout=30)
        assert ok.exit_code == 0 and ok.stdout.split()[0] == "5.6.7.8", ok.stderr
        for name in ("secret-data.attacker.test", "pypi.allowed.test"):  # bash-tool's, not agent's
            no = sbx.exec(["getent", "hosts", name], timeout=30)
            assert no.exit_code == 2 and no.stdout == "", (name, no.stdout, no.stderr)
    names = recorder.names()
    assert "api.allowed.test" in names
    assert "secret-data.attacker.test" not in names and "pypi.allowed.test" not in names
    ev = dns_sandgate.wait_audit(lambda e: e.get("event") == "dns"
                                 and e.get("host") == "secret-data.attacker.test")
    assert ev["identity"] == "agent" and ev["identity_source"] == "docker"
    assert ev["sandbox"] == sbx.id and ev["decision"] == "deny"
