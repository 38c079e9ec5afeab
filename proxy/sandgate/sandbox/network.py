"""The internal Docker network sandboxes live on: no route anywhere but the host (the proxy).

Docker's `internal` bridge has no NAT: the host does not forward its traffic anywhere. But the
host itself still accepts it on EVERY host address (eth0's, docker0's, ...: Linux's weak host
model, and Docker only filters FORWARD). So unless told otherwise this module also installs a
host firewall chain (iptables, needs root and a local engine): packets coming in from the
network's bridge are accepted only to the gateway address (optionally only to given TCP ports,
e.g. the proxy's) and dropped otherwise. The gateway is where Sandgate listens for sandboxes.
Inter-container traffic is disabled too (`enable_icc=false`): one sandbox cannot reach another.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

import docker
import requests
from docker.errors import APIError, NotFound
from docker.types import IPAMConfig, IPAMPool

from sandgate.sandbox.errors import SandboxError, docker_endpoint, unavailable

log = logging.getLogger(__name__)

NETWORK_NAME = "sandgate-sandboxes"
DEFAULT_SUBNET = "172.30.99.0/24"
NETWORK_LABEL = "sandgate.network"


@dataclass(frozen=True, slots=True)
class SandboxNetwork:
    name: str
    id: str
    subnet: str
    gateway: str  # where sandboxes reach the proxy
    bridge: str  # the host-side interface
    host_firewall: bool = False  # the host accepts this network's packets only at the gateway


def ensure_network(
    client: docker.DockerClient,
    name: str = NETWORK_NAME,
    subnet: str = DEFAULT_SUBNET,
    *,
    isolate: bool = True,
    host_firewall: bool = True,
    allowed_ports: Sequence[int] | None = None,
) -> str:
    """Create the internal sandbox network if missing; return its gateway IP (the proxy's address).

    An existing network of that name is used only if it is internal; otherwise SandboxError.
    With host_firewall, the host accepts the network's packets only at the gateway (and only on
    allowed_ports, TCP, if given); when that cannot be installed (not root, no iptables, remote
    engine) a warning is logged: see ensure_network_info(...).host_firewall.
    """
    return ensure_network_info(
        client, name, subnet, isolate=isolate, host_firewall=host_firewall,
        allowed_ports=allowed_ports,
    ).gateway


def ensure_network_info(
    client: docker.DockerClient,
    name: str = NETWORK_NAME,
    subnet: str = DEFAULT_SUBNET,
    *,
    isolate: bool = True,
    host_firewall: bool = True,
    allowed_ports: Sequence[int] | None = None,
) -> SandboxNetwork:
    info = _ensure(client, name, subnet, isolate)
    if host_firewall:
        applied = restrict_host_access(client, info, allowed_ports)
        info = SandboxNetwork(info.name, info.id, info.subnet, info.gateway, info.bridge, applied)
    return info


def _ensure(client: docker.DockerClient, name: str, subnet: str, isolate: bool) -> SandboxNetwork:
    net = ipaddress.ip_network(subnet)  # ValueError on a bad subnet
    gateway = str(next(net.hosts()))
    try:
        try:
            return inspect_network(client, name)
        except NotFound:
            pass
        options = {"com.docker.network.bridge.enable_icc": "false"} if isolate else {}
        try:
            client.networks.create(
                name,
                driver="bridge",
                internal=True,
                check_duplicate=True,
                ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=str(net), gateway=gateway)]),
                labels={NETWORK_LABEL: "sandboxes"},
                options=options,
            )
            log.info("created internal network %s (%s, gateway %s)", name, net, gateway)
        except APIError as exc:
            if exc.status_code != 409:  # 409: created concurrently; use it
                raise SandboxError(f"cannot create network '{name}' ({net}): {exc}") from exc
        return inspect_network(client, name)
    except requests.ConnectionError as exc:
        raise unavailable(exc, client) from exc


def inspect_network(client: docker.DockerClient, name: str = NETWORK_NAME) -> SandboxNetwork:
    """The sandbox network as it is. Raises NotFound, or SandboxError if it is not internal."""
    attrs = client.api.inspect_network(name)
    if not attrs.get("Internal"):
        raise SandboxError(
            f"network '{name}' exists but is not internal (it would give sandboxes a route out); "
            f"remove it (docker network rm {name}) and let Sandgate create it"
        )
    configs = (attrs.get("IPAM") or {}).get("Config") or []
    for cfg in configs:
        sub = cfg.get("Subnet")
        if not sub or ipaddress.ip_network(sub).version != 4:
            continue
        gw = cfg.get("Gateway") or str(next(ipaddress.ip_network(sub).hosts()))
        bridge = (attrs.get("Options") or {}).get("com.docker.network.bridge.name") or (
            "br-" + attrs["Id"][:12]
        )
        return SandboxNetwork(name=name, id=attrs["Id"], subnet=sub, gateway=gw, bridge=bridge)
    raise SandboxError(f"network '{name}' has no IPv4 subnet")


def remove_network(client: docker.DockerClient, name: str = NETWORK_NAME) -> None:
    """Remove the sandbox network (and its host firewall chain) if it exists.

    Fails (docker APIError) while containers are attached.
    """
    try:
        info = inspect_network(client, name)
    except NotFound:
        return
    client.api.remove_network(name)
    if _iptables() is not None:
        _drop_chain(info.bridge)


# --- host firewall ------------------------------------------------------------------------------


def _iptables() -> str | None:
    if os.geteuid() != 0:
        return None
    return shutil.which("iptables")


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = _iptables()
    if exe is None:
        raise SandboxError("iptables is not available (needs root)")
    res = subprocess.run([exe, "-w", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise SandboxError(f"iptables {' '.join(args)}: {res.stderr.strip()}")
    return res


def _chain(bridge: str) -> str:
    return f"SG-{bridge}"[:28]


def _drop_chain(bridge: str) -> None:
    chain = _chain(bridge)
    while _ipt("-D", "INPUT", "-i", bridge, "-j", chain, check=False).returncode == 0:
        pass
    _ipt("-F", chain, check=False)
    _ipt("-X", chain, check=False)


def restrict_host_access(
    client: docker.DockerClient, info: SandboxNetwork, allowed_ports: Sequence[int] | None = None
) -> bool:
    """Let the host accept the network's packets only at its gateway (optionally only on these
    TCP ports). Idempotent: the chain SG-<bridge> is rebuilt each call. Returns whether it is
    in place; logs a warning when it cannot be (not root, no iptables, remote Docker engine).
    """
    endpoint = docker_endpoint(getattr(client.api, "base_url", None))
    if not endpoint.startswith(("unix:", "http+docker://localhost", "http+unix:")):
        log.warning("Docker engine at %s is not local: cannot firewall the host side of %s",
                    endpoint, info.name)
        return False
    if _iptables() is None:
        log.warning("not root or no iptables: sandboxes on %s can reach every address of this "
                    "host (not only the gateway %s)", info.name, info.gateway)
        return False
    chain = _chain(info.bridge)
    if _ipt("-n", "-L", chain, check=False).returncode != 0:
        _ipt("-N", chain)
    _ipt("-F", chain)
    if allowed_ports:
        for port in sorted(set(allowed_ports)):
            _ipt("-A", chain, "-d", info.gateway, "-p", "tcp", "--dport", str(int(port)),
                 "-j", "ACCEPT")
    else:
        _ipt("-A", chain, "-d", info.gateway, "-j", "ACCEPT")
    _ipt("-A", chain, "-j", "DROP")
    if _ipt("-C", "INPUT", "-i", info.bridge, "-j", chain, check=False).returncode != 0:
        _ipt("-I", "INPUT", "1", "-i", info.bridge, "-j", chain)
    log.info("host firewall: %s (%s) may reach this host only at %s%s", info.name, info.bridge,
             info.gateway, f" tcp/{sorted(set(allowed_ports))}" if allowed_ports else "")
    return True
