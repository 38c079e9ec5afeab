"""A fleet that is not Docker: sandboxes in real network namespaces, identified by CIDR."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.conftest import HERE, Proxy, start_proxy, stop_proxy

pytestmark = pytest.mark.integration

HOST_IP, NS_IP = "10.231.7.1", "10.231.7.2"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    name = f"sgtest-{uuid.uuid4().hex[:6]}"
    veth = f"v{name[-6:]}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        sh("ip", "link", "set", f"{veth}p", "netns", name)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", name, "addr", "add", f"{NS_IP}/30", "dev", f"{veth}p")
        sh("ip", "-n", name, "link", "set", f"{veth}p", "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        sh("ip", "link", "del", veth, check=False)
        sh("ip", "netns", "del", name, check=False)


@pytest.fixture(scope="module")
def ns_proxy(tmp_path_factory, netns, vault, upstream, pki) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("ns"), HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--identity-cidr", f"{NS_IP}/32=bash-tool/ns-sandbox-1",
                    listen_host=HOST_IP)
    yield p
    stop_proxy(p)


def ns_curl(netns: str, proxy: Proxy, url: str, *extra: str) -> tuple[str, int]:
    r = sh("ip", "netns", "exec", netns, "curl", "-sS", "--max-time", "10", "--proxy",
           proxy.url, "--cacert", str(proxy.ca), "-w", "\n%{http_code}", *extra, url,
           check=False)
    body, _, code = r.stdout.rpartition("\n")
    return body + r.stderr, int(code or 0)


def test_cidr_identity_without_token(netns, ns_proxy, upstream):
    _, status = ns_curl(netns, ns_proxy, "https://upstream.test/docs/a")
    assert status == 200
    ev = ns_proxy.wait_audit(lambda e: e.get("sandbox") == "ns-sandbox-1")
    assert ev["identity"] == "bash-tool" and ev["identity_source"] == "cidr"
    before = len(upstream.seen)
    body, status = ns_curl(netns, ns_proxy, "https://upstream.test/page")
    assert status == 403 and "bash-tool" in body
    assert len(upstream.seen) == before


def test_namespace_has_no_way_out_but_the_proxy(netns, ns_proxy):
    r = sh("ip", "netns", "exec", netns, "curl", "-sS", "--max-time", "3", "--noproxy", "*",
           "https://127.0.0.2/", check=False)
    assert r.returncode != 0


def test_address_outside_every_range_refused(ns_proxy, upstream):
    # From the host side (not in any configured range) with no token: refused, not forwarded.
    r = sh("curl", "-sS", "--max-time", "10", "--proxy", ns_proxy.url, "--cacert",
           str(ns_proxy.ca), "-w", "\n%{http_code}", "http://plain.test/x", check=False)
    assert r.stdout.strip().endswith("407")


def _host_curl(proxy: Proxy, url: str, user: str) -> tuple[str, int]:
    r = sh("curl", "-sS", "--max-time", "10", "--proxy", proxy.url, "--cacert", str(proxy.ca),
           "--proxy-user", user, "-w", "\n%{http_code}", url, check=False)
    body, _, code = r.stdout.rpartition("\n")
    return body + r.stderr, int(code or 0)


def test_a_token_client_outside_every_range_is_its_token(ns_proxy, upstream):
    # issue 38: with --identity-cidr (needed for policy DNS) token clients elsewhere got 407
    token = ns_proxy.token("coding-agent", sandbox="host-tool-1")
    before = len(upstream.seen)
    _, status = _host_curl(ns_proxy, "https://upstream.test/docs/a", f"coding-agent:{token}")
    assert status == 200
    ev = ns_proxy.wait_audit(lambda e: e.get("sandbox") == "host-tool-1")
    assert ev["identity"] == "coding-agent" and ev["identity_source"] == "token"
    assert len(upstream.seen) == before + 1
    # a bad token there is still refused
    body, status = _host_curl(ns_proxy, "http://plain.test/x", "coding-agent:sg1.x.y")
    assert status == 407, body


def test_a_token_inside_a_range_must_agree_with_it(netns, ns_proxy, upstream):
    # the range's guarantee is kept: its address is bash-tool, whatever token it shows
    token = ns_proxy.token("coding-agent")
    before = len(upstream.seen)
    body, status = ns_curl(netns, ns_proxy, "http://plain.test/x", "--proxy-user",
                           f"coding-agent:{token}")
    assert status == 407 and "disagrees" in body, body
    assert len(upstream.seen) == before


@pytest.fixture(scope="module")
def only_proxy(tmp_path_factory, netns, vault, upstream, pki) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("ns-only"), HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--identity-cidr", f"{NS_IP}/32=bash-tool/ns-sandbox-1",
                    "--address-identity-only", listen_host=HOST_IP)
    yield p
    stop_proxy(p)


def test_address_identity_only_refuses_token_clients_elsewhere(netns, only_proxy, upstream):
    token = only_proxy.token("coding-agent")
    before = len(upstream.seen)
    body, status = _host_curl(only_proxy, "http://plain.test/x", f"coding-agent:{token}")
    assert status == 407 and "no sandbox is known" in body, body
    assert len(upstream.seen) == before
    _, status = ns_curl(netns, only_proxy, "https://upstream.test/docs/a")
    assert status == 200
