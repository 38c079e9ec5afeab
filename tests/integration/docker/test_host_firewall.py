"""The host firewall of a sandbox network: by default a sandbox reaches the host ONLY at the
proxy port of the gateway address (IPv4 and IPv6); `--unsafe-allow-host-services` /
`allow_host_services=True` is the explicit opt-out.

Each test uses its own internal network (not the shared `sandgate-sandboxes`) and real host
listeners bound to every address (0.0.0.0 / ::), i.e. "a service on the host" as a sandbox sees
it. Probes run in plain containers (cap_drop ALL) on that network.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import docker
import pytest
from docker.types import IPAMConfig, IPAMPool

from sandgate.sandbox import Sandbox, SandboxSpec, ensure_network
from sandgate.sandbox.network import NETWORK_LABEL, ensure_network_info, remove_network
from tests.integration.docker.conftest import REPO, SESSION, TEST_LABEL

Spec = Callable[..., SandboxSpec]
IMAGE = "sandgate-bash-tool:dev"
SUBNET = "172.30.97.0/24"
GATEWAY = "172.30.97.1"
SUBNET6 = "fd5a:9e7e:97::/64"
GATEWAY6 = "fd5a:9e7e:97::1"
_IP_FREEBIND = 15  # linux/in.h; also applies to IPv6 sockets
PROXY_PORT = 8080  # the default proxy port: a stand-in "proxy" listens there on the gateway


class Listener:
    """A TCP server on (host, port); answers `hello` and records the peers."""

    def __init__(self, host: str, port: int = 0, family: int = socket.AF_INET) -> None:
        self.sock = socket.socket(family)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack
        # The bridge's addresses may still be tentative (IPv6 DAD) right after creation.
        self.sock.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.peers: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer[0])
            try:
                conn.sendall(b"hello\n")
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept(): the port is free again
        except OSError:
            pass
        self.sock.close()


PROBE = r"""
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor

def attempt(target):
    host, port = target
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            s.settimeout(3)
            return "ok:" + s.recv(100).decode().strip()
    except OSError as e:
        return "fail:" + type(e).__name__

targets = [tuple(t) for t in json.loads(sys.argv[1])]
with ThreadPoolExecutor(len(targets)) as pool:
    out = list(pool.map(attempt, targets))
print(json.dumps({f"{h}:{p}": o for (h, p), o in zip(targets, out)}))
"""


def probe_from(client: docker.DockerClient, network: str,
               targets: list[tuple[str, int]]) -> dict[str, str]:
    """Connect to each target from a fresh container on `network`; 'ok:..' or 'fail:..'."""
    out = client.containers.run(
        IMAGE, ["python3", "-c", PROBE, json.dumps(targets)], network=network, remove=True,
        cap_drop=["ALL"], security_opt=["no-new-privileges:true"], labels={TEST_LABEL: SESSION},
    )
    return dict(json.loads(out))


def _ipt(exe: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "-w", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def fw_network(docker_client: docker.DockerClient) -> Iterator[str]:
    """A fresh name for a test network; the network (and its chains) are removed afterwards."""
    name = f"sandgate-test-fw-{SESSION}"
    yield name
    for c in docker_client.containers.list(all=True, filters={"network": name}):
        c.remove(force=True)
    remove_network(docker_client, name)


@pytest.fixture
def host_service() -> Iterator[Listener]:
    """A service on the host that sandboxes must NOT reach: every IPv4 and IPv6 address."""
    lst = Listener("::", family=socket.AF_INET6)
    yield lst
    lst.close()


def _proxy_standin(host: str, family: int = socket.AF_INET) -> Listener:
    return Listener(host, PROXY_PORT, family)


def test_api_default_allows_only_the_proxy_port(
    docker_client: docker.DockerClient, fw_network: str, host_service: Listener
) -> None:
    gateway = ensure_network(docker_client, name=fw_network, subnet=SUBNET)  # the defaults
    assert gateway == GATEWAY
    proxy = _proxy_standin(GATEWAY)
    try:
        res = probe_from(docker_client, fw_network,
                         [(GATEWAY, PROXY_PORT), (GATEWAY, host_service.port)])
    finally:
        proxy.close()
    assert res[f"{GATEWAY}:{PROXY_PORT}"] == "ok:hello", "control: the proxy port is reachable"
    assert res[f"{GATEWAY}:{host_service.port}"].startswith("fail:"), (
        f"a host service answered a sandbox by default: {res}")
    assert host_service.peers == []


def test_cli_default_and_the_unsafe_opt_out(
    docker_client: docker.DockerClient, fw_network: str, host_service: Listener
) -> None:
    def cli(*extra: str) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "sandgate.cli", "sandbox", "network", "--network", fw_network,
             "--subnet", SUBNET, *extra], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert res.returncode == 0, res.stderr
        assert "warning" not in res.stderr, res.stderr
        return res.stdout.strip()

    targets = [(GATEWAY, PROXY_PORT), (GATEWAY, host_service.port)]
    assert cli() == GATEWAY
    proxy = _proxy_standin(GATEWAY)
    try:
        default = probe_from(docker_client, fw_network, targets)
        assert cli("--unsafe-allow-host-services") == GATEWAY
        opened = probe_from(docker_client, fw_network, targets)
        assert cli() == GATEWAY  # and back: the chain is rebuilt, not appended to
        again = probe_from(docker_client, fw_network, targets)
    finally:
        proxy.close()
    assert default[f"{GATEWAY}:{PROXY_PORT}"] == "ok:hello"
    assert default[f"{GATEWAY}:{host_service.port}"].startswith("fail:"), default
    assert opened == {f"{GATEWAY}:{PROXY_PORT}": "ok:hello",
                      f"{GATEWAY}:{host_service.port}": "ok:hello"}, opened
    assert again == default


def test_launcher_locks_the_network_to_its_proxy(
    docker_client: docker.DockerClient, fw_network: str, host_service: Listener,
    make_spec: Spec,
) -> None:
    # A network somebody opened up (or an old Sandgate made): the launcher closes it again.
    ensure_network(docker_client, name=fw_network, subnet=SUBNET, allow_host_services=True)
    proxy = Listener(GATEWAY, 0)  # the proxy on a non-default port: the spec's port is used
    try:
        spec = make_spec(network=fw_network, proxy_url=f"http://{GATEWAY}:{proxy.port}")
        with Sandbox.create(docker_client, spec) as sbx:
            assert sbx.host_firewall
            res = sbx.exec(["python3", "-c", PROBE, json.dumps(
                [(GATEWAY, proxy.port), (GATEWAY, host_service.port)])], timeout=60)
    finally:
        proxy.close()
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out[f"{GATEWAY}:{proxy.port}"] == "ok:hello", out
    assert out[f"{GATEWAY}:{host_service.port}"].startswith("fail:"), out


def test_ipv6_network_reaches_the_host_only_at_the_proxy_port(
    docker_client: docker.DockerClient, fw_network: str, host_service: Listener
) -> None:
    docker_client.networks.create(
        fw_network, driver="bridge", internal=True, enable_ipv6=True,
        options={"com.docker.network.bridge.enable_icc": "false"},
        labels={NETWORK_LABEL: "sandboxes", TEST_LABEL: SESSION},
        ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=SUBNET, gateway=GATEWAY),
                                      IPAMPool(subnet=SUBNET6, gateway=GATEWAY6)]),
    )
    info = ensure_network_info(docker_client, name=fw_network, subnet=SUBNET)
    assert info.host_firewall
    proxy6 = _proxy_standin(GATEWAY6, socket.AF_INET6)
    try:
        res = probe_from(docker_client, fw_network,
                         [(GATEWAY6, PROXY_PORT), (GATEWAY6, host_service.port),
                          (GATEWAY, host_service.port)])
    finally:
        proxy6.close()
    assert res[f"{GATEWAY6}:{PROXY_PORT}"] == "ok:hello", f"control: proxy over IPv6: {res}"
    assert res[f"{GATEWAY6}:{host_service.port}"].startswith("fail:"), (
        f"a host service answered a sandbox over IPv6: {res}")
    assert res[f"{GATEWAY}:{host_service.port}"].startswith("fail:"), res
    assert host_service.peers == []


def test_network_without_ipv6_has_no_ipv6_path_to_the_host(
    docker_client: docker.DockerClient, fw_network: str, host_service: Listener
) -> None:
    info = ensure_network_info(docker_client, name=fw_network, subnet=SUBNET)
    assert info.host_firewall
    attrs = docker_client.api.inspect_network(fw_network)
    assert not attrs.get("EnableIPv6")
    # The sandbox has IPv6 switched off: no address, no route, nothing to send with.
    bridge_ll = _link_local(info.bridge)
    out = docker_client.containers.run(
        IMAGE, ["sh", "-c", "cat /proc/sys/net/ipv6/conf/all/disable_ipv6; ip -6 addr; "
                f"python3 -c \"{_V6_CONNECT}\" '{bridge_ll}%eth0' {host_service.port}"],
        network=fw_network, remove=True, cap_drop=["ALL"], labels={TEST_LABEL: SESSION},
    ).decode()
    lines = out.strip().splitlines()
    assert lines[0] == "1", out
    assert lines[-1].startswith("fail:"), out
    assert not any("inet6" in ln for ln in lines), out
    # And the host drops IPv6 from the bridge anyway (should a container turn IPv6 on).
    ip6tables = "ip6tables"
    rules = _ipt(ip6tables, "-S", "INPUT").stdout
    assert f"-A INPUT -i {info.bridge} -j " in rules, rules
    chain = next(ln for ln in rules.splitlines() if f"-i {info.bridge} -j " in ln).split()[-1]
    chain_rules = _ipt(ip6tables, "-S", chain).stdout.splitlines()
    assert chain_rules[-1].endswith("-j DROP"), chain_rules
    assert not any("ACCEPT" in ln and "icmp" not in ln for ln in chain_rules), chain_rules
    assert host_service.peers == []


_V6_CONNECT = (
    "import socket,sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), 3); print('ok')\n"
    "except OSError as e:\n"
    "    print('fail:' + type(e).__name__)"
)


def _link_local(dev: str) -> str:
    out = subprocess.run(["ip", "-6", "-o", "addr", "show", "dev", dev, "scope", "link"],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        return parts[parts.index("inet6") + 1].split("/")[0]
    return "fe80::1"


def test_firewall_is_idempotent(docker_client: docker.DockerClient, fw_network: str) -> None:
    info = ensure_network_info(docker_client, name=fw_network, subnet=SUBNET)
    for exe in ("iptables", "ip6tables"):
        first = _ipt(exe, "-S").stdout
        ensure_network_info(docker_client, name=fw_network, subnet=SUBNET)
        ensure_network_info(docker_client, name=fw_network, subnet=SUBNET)
        assert _ipt(exe, "-S").stdout == first, exe
        jumps = [ln for ln in first.splitlines() if ln.startswith(f"-A INPUT -i {info.bridge} ")]
        assert len(jumps) == 1, (exe, jumps)
    remove_network(docker_client, fw_network)
    for exe in ("iptables", "ip6tables"):
        assert info.bridge not in _ipt(exe, "-S").stdout, exe

