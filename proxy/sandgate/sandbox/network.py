"""The internal Docker network sandboxes live on: no route anywhere but the host (the proxy).

Docker's `internal` bridge has no NAT: the host does not forward its traffic anywhere. But the
host itself still accepts it on EVERY host address (eth0's, docker0's, ...: Linux's weak host
model, and Docker only filters FORWARD), on every port. So this module also installs a host
firewall chain (iptables and ip6tables, needs root and a local engine): packets coming in from
the network's bridge are accepted only to the proxy port of the gateway address (IPv4, and IPv6
when the network has it) and dropped otherwise. That is the default everywhere;
`allow_host_services=True` (CLI: `--unsafe-allow-host-services`) opens the whole gateway
address, every port, instead. The gateway is where Sandgate listens for sandboxes.
Inter-container traffic is disabled too (`enable_icc=false`): one sandbox cannot reach another.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import docker
import requests
from docker.errors import APIError, NotFound
from docker.types import IPAMConfig, IPAMPool

from sandgate.capture import nftables as capture
from sandgate.sandbox.engine import SandboxError, docker_endpoint, unavailable

if TYPE_CHECKING:
    from sandgate.capture.nftables import Capture

log = logging.getLogger(__name__)

NETWORK_NAME = "sandgate-sandboxes"
DEFAULT_SUBNET = "172.30.99.0/24"
DEFAULT_PROXY_PORT = 8080
NETWORK_LABEL = "sandgate.network"


@dataclass(frozen=True, slots=True)
class SandboxNetwork:
    name: str
    id: str
    subnet: str
    gateway: str  # where sandboxes reach the proxy
    bridge: str  # the host-side interface
    host_firewall: bool = False  # the host accepts this network's packets only as configured
    subnet6: str | None = None  # the IPv6 subnet, when the network has IPv6
    gateway6: str | None = None


def ensure_network(
    client: docker.DockerClient,
    name: str = NETWORK_NAME,
    subnet: str = DEFAULT_SUBNET,
    *,
    isolate: bool = True,
    host_firewall: bool = True,
    proxy_port: int = DEFAULT_PROXY_PORT,
    allowed_ports: Sequence[int] | None = None,
    allow_host_services: bool = False,
) -> str:
    """Create the internal sandbox network if missing; return its gateway IP (the proxy's address).

    An existing network of that name is used only if it is internal; otherwise SandboxError.
    With host_firewall (the default), the host accepts the network's packets only at the
    gateway's `proxy_port` (TCP; `allowed_ports` names several ports instead), over IPv4 and
    IPv6; allow_host_services=True opens every port of the gateway address instead (unsafe:
    every service listening on the host is then reachable from the sandboxes). When the firewall
    cannot be installed (not root, no iptables, remote engine) a warning is logged: see
    ensure_network_info(...).host_firewall.
    """
    return ensure_network_info(
        client, name, subnet, isolate=isolate, host_firewall=host_firewall,
        proxy_port=proxy_port, allowed_ports=allowed_ports,
        allow_host_services=allow_host_services,
    ).gateway


def ensure_network_info(
    client: docker.DockerClient,
    name: str = NETWORK_NAME,
    subnet: str = DEFAULT_SUBNET,
    *,
    isolate: bool = True,
    host_firewall: bool = True,
    proxy_port: int = DEFAULT_PROXY_PORT,
    allowed_ports: Sequence[int] | None = None,
    allow_host_services: bool = False,
    transparent: Capture | None = None,
) -> SandboxNetwork:
    """`transparent`: also install the capture table on the network's bridge (its interface
    and allowed proxy port filled in here; sandgate.capture.nftables)."""
    info = _ensure(client, name, subnet, isolate)
    if transparent is not None:
        install_capture(info, transparent, allowed_ports or [proxy_port])
    if host_firewall:
        ports = list(allowed_ports) if allowed_ports is not None else [proxy_port]
        applied = restrict_host_access(client, info, ports,
                                       allow_host_services=allow_host_services)
        info = replace(info, host_firewall=applied)
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
    v4: tuple[str, str] | None = None
    v6: tuple[str, str] | None = None
    for cfg in configs:
        sub = cfg.get("Subnet")
        if not sub:
            continue
        net = ipaddress.ip_network(sub)
        gw = (cfg.get("Gateway") or str(next(net.hosts()))).split("/")[0]
        if net.version == 4 and v4 is None:
            v4 = (sub, gw)
        elif net.version == 6 and v6 is None and attrs.get("EnableIPv6"):
            v6 = (sub, gw)
    if v4 is None:
        raise SandboxError(f"network '{name}' has no IPv4 subnet")
    bridge = (attrs.get("Options") or {}).get("com.docker.network.bridge.name") or (
        "br-" + attrs["Id"][:12]
    )
    return SandboxNetwork(name=name, id=attrs["Id"], subnet=v4[0], gateway=v4[1], bridge=bridge,
                          subnet6=v6[0] if v6 else None, gateway6=v6[1] if v6 else None)


def remove_network(client: docker.DockerClient, name: str = NETWORK_NAME) -> None:
    """Remove the sandbox network (and its host firewall chains) if it exists.

    Fails (docker APIError) while containers are attached.
    """
    try:
        info = inspect_network(client, name)
    except NotFound:
        return
    client.api.remove_network(name)
    if shutil.which("nft") is not None and os.geteuid() == 0:
        capture.remove(info.bridge)
    for family in (4, 6):
        if _tool(family) is not None:
            _drop_chain(family, info.bridge)


def install_capture(info: SandboxNetwork, cap: Capture, proxy_ports: Sequence[int]) -> bool:
    """The capture table on the network's bridge: TCP to the captured ports redirected to the
    transparent listener at the gateway, the proxy ports at the gateway as they are, the rest
    dropped and counted. Whether it changed."""
    cap = replace(cap, placement="router", interface=info.bridge,
                  allow=tuple(cap.allow) + tuple((info.gateway, int(p)) for p in proxy_ports))
    try:
        return capture.apply(info.bridge, cap)
    except capture.CaptureError as e:
        raise SandboxError(str(e)) from None


# --- host firewall ------------------------------------------------------------------------------
#
# One chain per bridge and family, SG-<bridge>, jumped to from INPUT for packets that come in on
# the bridge. It is replaced atomically (iptables-restore --noflush: declaring the chain flushes
# it in the same transaction), so there is no moment without the final DROP. A comment on the
# DROP rule records the policy; when it is already in place nothing is run but one `-S`.


def _tool(family: int, restore: bool = False) -> str | None:
    if os.geteuid() != 0:
        return None
    name = ("iptables" if family == 4 else "ip6tables") + ("-restore" if restore else "")
    return shutil.which(name)


def _ipt(family: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = _tool(family)
    if exe is None:
        raise SandboxError(f"{'ip6' if family == 6 else 'ip'}tables is not available (needs root)")
    res = subprocess.run([exe, "-w", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise SandboxError(f"{os.path.basename(exe)} {' '.join(args)}: {res.stderr.strip()}")
    return res


def _chain(bridge: str) -> str:
    return f"SG-{bridge}"[:28]


def _drop_chain(family: int, bridge: str) -> None:
    chain = _chain(bridge)
    while _ipt(family, "-D", "INPUT", "-i", bridge, "-j", chain, check=False).returncode == 0:
        pass
    _ipt(family, "-F", chain, check=False)
    _ipt(family, "-X", chain, check=False)


def _rules(family: int, gateway: str | None, ports: Sequence[int] | None,
           udp_ports: Sequence[int] = ()) -> list[str]:
    """The chain's rules as `iptables -S` prints them, without `-A CHAIN`. ports None: all.
    udp_ports: Sandgate's DNS (transparent capture, sandgate.capture.nftables).

    No gateway (a network without IPv6, for family 6): no rule, everything is dropped.
    """
    if gateway is None:
        return []
    dest = f"-d {gateway}/{32 if family == 4 else 128}"
    rules: list[str] = []
    if family == 6:
        # Neighbour discovery with the host (solicitation 135, advertisement 136): without it
        # IPv6 to the gateway cannot work at all.
        rules += [f"-p ipv6-icmp -m icmp6 --icmpv6-type {t} -j ACCEPT" for t in (135, 136)]
    if ports is None:
        rules.append(f"{dest} -j ACCEPT")
    rules += [f"{dest} -p tcp -m tcp --dport {int(port)} -j ACCEPT" for port in ports or ()]
    if ports is not None:
        rules += [f"{dest} -p udp -m udp --dport {int(port)} -j ACCEPT" for port in udp_ports]
    return rules


def _apply_chain(family: int, bridge: str, rules: list[str], policy: str) -> None:
    chain = _chain(bridge)
    wanted = [f"-A {chain} {rule}" for rule in rules]
    wanted.append(f'-A {chain} -m comment --comment "{policy}" -j DROP')
    current = _ipt(family, "-S", chain, check=False)
    have = [ln for ln in current.stdout.splitlines() if ln.startswith("-A ")]
    jump = _ipt(family, "-C", "INPUT", "-i", bridge, "-j", chain, check=False).returncode == 0
    if current.returncode != 0 or have != wanted:
        exe = _tool(family, restore=True)
        if exe is None:
            raise SandboxError(f"{'ip6' if family == 6 else 'ip'}tables-restore is not available")
        script = "\n".join(["*filter", f":{chain} - [0:0]", *wanted, "COMMIT", ""])
        res = subprocess.run([exe, "-w", "--noflush"], input=script, capture_output=True,
                             text=True, timeout=30)
        if res.returncode != 0:
            raise SandboxError(f"{os.path.basename(exe)}: {res.stderr.strip()}")
    if not jump:
        _ipt(family, "-I", "INPUT", "1", "-i", bridge, "-j", chain)


def restrict_host_access(
    client: docker.DockerClient,
    info: SandboxNetwork,
    allowed_ports: Sequence[int] | None = (DEFAULT_PROXY_PORT,),
    *,
    allow_host_services: bool = False,
) -> bool:
    """Let the host accept the network's packets only at its gateway's allowed TCP ports (IPv4,
    and IPv6 if the network has it; without IPv6 every IPv6 packet from the bridge is dropped).
    allowed_ports None means the default proxy port; an empty one accepts nothing (the proxy is
    not on this host). allow_host_services=True accepts every port of the gateway address.

    Idempotent: the chains SG-<bridge> are replaced atomically, and left alone when they already
    hold this policy. Returns whether the firewall is in place; logs a warning when it cannot be
    (not root, no iptables, remote Docker engine).
    """
    endpoint = docker_endpoint(getattr(client.api, "base_url", None))
    if not endpoint.startswith(("unix:", "http+docker://localhost", "http+unix:")):
        log.warning("Docker engine at %s is not local: cannot firewall the host side of %s",
                    endpoint, info.name)
        return False
    if _tool(4) is None or _tool(4, restore=True) is None:
        log.warning("not root or no iptables: sandboxes on %s can reach every address and port "
                    "of this host (not only the proxy at %s)", info.name, info.gateway)
        return False
    if allowed_ports is None:
        allowed_ports = (DEFAULT_PROXY_PORT,)
    # a capture table on this bridge redirects to this host: its listener (and DNS) stay open
    tcp_capture, udp_ports = capture.listener_ports(info.bridge)
    ports = None if allow_host_services else sorted({int(p) for p in
                                                     [*allowed_ports, *tcp_capture]})
    what = "all" if ports is None else ",".join(map(str, ports)) or "none"
    if udp_ports and ports is not None:
        what += " udp:" + ",".join(map(str, udp_ports))
    _apply_chain(4, info.bridge, _rules(4, info.gateway, ports, udp_ports),
                 f"sandgate {info.gateway} tcp:{what}")
    v6 = _tool(6) is not None and _tool(6, restore=True) is not None
    if v6:
        _apply_chain(6, info.bridge, _rules(6, info.gateway6, ports, udp_ports),
                     f"sandgate {info.gateway6 or 'no-ipv6'} tcp:{what}")
    elif info.gateway6 is not None:
        log.warning("no ip6tables: sandboxes on %s can reach every IPv6 address and port of this "
                    "host", info.name)
        return False
    else:
        log.warning("no ip6tables: IPv6 from %s is not filtered (the network has no IPv6)",
                    info.name)
    if ports is None:
        log.warning("host firewall: %s (%s) may reach EVERY port of this host at %s%s "
                    "(allow_host_services)", info.name, info.bridge, info.gateway,
                    f" and {info.gateway6}" if info.gateway6 else "")
    else:
        log.info("host firewall: %s (%s) may reach this host only at %s%s tcp/%s", info.name,
                 info.bridge, info.gateway, f" and {info.gateway6}" if info.gateway6 else "",
                 what)
    return True
