"""Transparent capture on the real Docker sandbox network, shared by the Docker tests
(tests/integration/docker/test_transparent_docker.py, test_capture_dns_docker.py): a TLS
upstream on an address of this host's lo, and Sandgate with `--transparent` at the network's
gateway plus the capture table `sandgate sandbox network --transparent PORT [--dns ADDRESS]`
installs on its bridge (the host firewall then keeps the listener's and the DNS's ports open)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import docker

from sandgate.capture import nftables as capture
from sandgate.capture.nftables import Capture
from sandgate.sandbox.network import SandboxNetwork, ensure_network_info
from tests.integration.conftest import SECRET_VALUES, Proxy, free_port, start_proxy, stop_proxy
from tests.support.secrets import assert_no_secret
from tests.support.upstream import UpstreamServer


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


@contextmanager
def upstream_on_lo(address: str, pki: Any) -> Iterator[UpstreamServer]:
    """A TLS upstream at ADDRESS:443, the address added to this host's lo meanwhile."""
    sh("ip", "addr", "add", f"{address}/32", "dev", "lo")
    try:
        up = UpstreamServer(address, 443, str(pki.cert), str(pki.key)).start()
        try:
            yield up
        finally:
            up.stop()
    finally:
        sh("ip", "addr", "del", f"{address}/32", "dev", "lo", check=False)


@contextmanager
def transparent_sandgate(tmp: Path, policies: Path, vault: Any, pki: Any,
                         client: docker.DockerClient, network: SandboxNetwork, *extra: str,
                         dns_port: int | None = None) -> Iterator[Proxy]:
    """Sandgate on the gateway (proxy and transparent listeners; `extra`: more `run`
    options, e.g. --dns) and the network's capture table. dns_port: Sandgate's DNS listens at
    the gateway on this port and is the only resolver the table lets through (port 53 there
    is redirected to it)."""
    tport = free_port()
    p = None
    try:
        # the admin token only matters when `extra` asks for --admin
        p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr,
                                        "VAULT_TOKEN": vault.root_token,
                                        "SANDGATE_ADMIN_TOKEN": "test-admin-token"}, pki,
                        "--docker-network", network.name,
                        "--transparent", f"{network.gateway}:{tport}", *extra,
                        listen_host=network.gateway)
        dns = (network.gateway, dns_port) if dns_port is not None else None
        ensure_network_info(client, network.name, proxy_port=p.port,
                            transparent=Capture(listener=(None, tport), interface="-", dns=dns))
        yield p
    finally:
        capture.remove(network.bridge)
        if p is not None:
            stop_proxy(p)
            assert_no_secret([p.logs()], SECRET_VALUES, "the proxy logs")


def curl_gets_the_key(sbx: Any, up: UpstreamServer, url: str, key: str) -> None:
    """curl (no proxy setting) POSTs to an allowed URL from the sandbox: 200, and the upstream
    saw exactly one request, carrying the injected key (which the sandbox never saw)."""
    before = len(up.seen)
    r = sbx.exec(["curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "-X", "POST",
                  "-d", "{}", url])
    assert r.stdout.endswith("\n200"), r.stdout + r.stderr
    assert key not in r.stdout
    assert [s.headers.get("x-api-key") for s in up.seen[before:]] == [key]
