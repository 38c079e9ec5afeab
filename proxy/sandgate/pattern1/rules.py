"""The split's network rules, as iptables-restore input for the sandbox's own network namespace.

Mechanism: the owner match (`-m owner --uid-owner`, nftables' `meta skuid`) of the OUTPUT
hooks. The kernel records which user created a socket; no process can forge it without
CAP_SETUID, and after the entrypoint no process of the sandbox has a capability left. So:

  nat OUTPUT (the first packet of each TCP connection, before routing):
    loopback, the agent                    unchanged
    tool  -> any address, any port         DNAT to Sandgate's tool listener
    anyone else                            DNAT to Sandgate's other listener (refused, audited)
  filter OUTPUT (policy DROP, after nat: it sees the rewritten destination):
    Docker's resolver 127.0.0.11 rejected  (no DNS: a covert channel, and nothing needs it)
    loopback, established                  accepted
    tcp to gateway:agent ports if agent, to gateway:tool port if tool, to gateway:other port
    everything else (the agent elsewhere, UDP, ICMP, raw)   rejected

The agent elsewhere (another address, Sandgate's tool listener) is rejected in the sandbox, as
without the split; the agent is the trusted side, and its sandbox keeps behaving as before.
  IPv6: only loopback.

The bash tool reaching "the agent's listener directly" therefore lands on the tool listener,
where Sandgate takes the identity from (sandbox address, listener), never from a token.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

MARK = "sandgate-split"  # the comment on the final rule: the applied rules are recognisable
DOCKER_DNS = "127.0.0.11"

AGENT_USER = "agent"
TOOL_USER = "tool"
SHARE_GROUP = "workspace"  # agent and tool share /workspace through this group (setgid dir)

# The proxy variables the sandbox's clients read (sandgate.proxyenv sets these): the tool's
# copies point at the tool listener, without the agent's credentials.
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy", "npm_config_proxy", "npm_config_https_proxy")

ENV_TOOL_PORT = "SANDGATE_SPLIT_TOOL_PORT"
ENV_OTHER_PORT = "SANDGATE_SPLIT_OTHER_PORT"
ENV_AGENT_PORTS = "SANDGATE_SPLIT_AGENT_PORTS"  # default: the port of HTTPS_PROXY
ENV_SPLIT = "SANDGATE_SPLIT"  # "uid", the only mode (the launcher sets it, for clarity)


class SplitConfigError(ValueError):
    """The sandbox's split settings are missing or wrong: the sandbox does not start."""


@dataclass(frozen=True, slots=True)
class SplitNet:
    gateway: str  # Sandgate's IPv4 address as the sandbox reaches it
    agent_ports: tuple[int, ...]  # Sandgate listeners the agent uses (proxy, gateway, SOCKS5)
    tool_port: int
    other_port: int
    agent_uid: int
    tool_uid: int

    def validate(self) -> None:
        try:
            addr = ipaddress.IPv4Address(self.gateway)
        except ValueError:
            raise SplitConfigError(f"the proxy address {self.gateway!r} is not an IPv4 "
                                   "address (the split rules need a literal)") from None
        if addr.is_loopback or addr.is_unspecified:
            raise SplitConfigError(f"the proxy address {self.gateway} cannot be reached from "
                                   "a sandbox's network")
        ports = [*self.agent_ports, self.tool_port, self.other_port]
        for port in ports:
            if not 0 < port < 65536:
                raise SplitConfigError(f"port {port} is out of range")
        if not self.agent_ports or len(set(ports)) != len(ports):
            raise SplitConfigError(f"the agent ports {list(self.agent_ports)}, the tool port "
                                   f"{self.tool_port} and the other port {self.other_port} "
                                   "must be distinct")
        if min(self.agent_uid, self.tool_uid) <= 0 or self.agent_uid == self.tool_uid:
            raise SplitConfigError("the agent and the tool need two distinct non-root users")

    @property
    def tool_proxy(self) -> str:
        return f"http://{self.gateway}:{self.tool_port}"


def _port(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "").strip()
    if not value.isdigit():
        raise SplitConfigError(f"{name} must be a port number, got {value!r}")
    return int(value)


def split_net(env: Mapping[str, str], agent_uid: int, tool_uid: int) -> SplitNet:
    """The split settings from the sandbox's environment (set by the launcher or the compose
    file): the gateway and agent port from HTTPS_PROXY, the tool and other listener ports."""
    proxy = env.get("HTTPS_PROXY") or env.get("https_proxy") or ""
    url = urlsplit(proxy)
    if url.scheme != "http" or not url.hostname:
        raise SplitConfigError("HTTPS_PROXY must be http://HOST:PORT of Sandgate (the split "
                               "routes by it)")
    agent_ports: list[int] = [url.port or 80]
    extra = env.get(ENV_AGENT_PORTS, "").strip()
    if extra:
        try:
            agent_ports = [int(p) for p in extra.split(",")]
        except ValueError:
            raise SplitConfigError(f"{ENV_AGENT_PORTS} must be ports separated by commas, "
                                   f"got {extra!r}") from None
    net = SplitNet(gateway=url.hostname, agent_ports=tuple(agent_ports),
                   tool_port=_port(env, ENV_TOOL_PORT), other_port=_port(env, ENV_OTHER_PORT),
                   agent_uid=agent_uid, tool_uid=tool_uid)
    net.validate()
    return net


def iptables_v4(net: SplitNet) -> str:
    """iptables-restore input (nat and filter replaced whole: Docker's resolver rules go too)."""
    net.validate()
    gw, agent, tool = net.gateway, net.agent_uid, net.tool_uid
    nat = [
        "*nat",
        ":PREROUTING ACCEPT [0:0]",
        ":INPUT ACCEPT [0:0]",
        ":OUTPUT ACCEPT [0:0]",
        ":POSTROUTING ACCEPT [0:0]",
        "-A OUTPUT -o lo -j RETURN",
        f"-A OUTPUT -m owner --uid-owner {agent} -j RETURN",
        f"-A OUTPUT -p tcp -m owner --uid-owner {tool} -j DNAT --to-destination "
        f"{gw}:{net.tool_port}",
        f"-A OUTPUT -p tcp -j DNAT --to-destination {gw}:{net.other_port}",
        "COMMIT",
    ]
    filt = [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT DROP [0:0]",
        f"-A OUTPUT -d {DOCKER_DNS}/32 -j REJECT",
        "-A OUTPUT -o lo -j ACCEPT",
        "-A OUTPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        *(f"-A OUTPUT -d {gw}/32 -p tcp -m owner --uid-owner {agent} -m tcp --dport {port} "
          "-j ACCEPT" for port in net.agent_ports),
        f"-A OUTPUT -m owner --uid-owner {agent} -j REJECT",  # the agent: its proxy only
        f"-A OUTPUT -d {gw}/32 -p tcp -m owner --uid-owner {tool} -m tcp --dport "
        f"{net.tool_port} -j ACCEPT",
        f"-A OUTPUT -d {gw}/32 -p tcp -m tcp --dport {net.other_port} -j ACCEPT",
        f'-A OUTPUT -m comment --comment "{MARK}" -j REJECT',
        "COMMIT",
    ]
    return "\n".join([*nat, *filt, ""])


def iptables_v6() -> str:
    """ip6tables-restore input: the sandbox reaches Sandgate over IPv4 only."""
    return "\n".join([
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT DROP [0:0]",
        "-A OUTPUT -o lo -j ACCEPT",
        f'-A OUTPUT -m comment --comment "{MARK}" -j REJECT',
        "COMMIT",
        "",
    ])


def applied(saved: str, net: SplitNet) -> list[str]:
    """What `iptables-save` output lacks of the split (empty: it is in place)."""
    wanted = [
        ":OUTPUT DROP",
        f"--uid-owner {net.tool_uid} -j DNAT --to-destination {net.gateway}:{net.tool_port}",
        f"-j DNAT --to-destination {net.gateway}:{net.other_port}",
        MARK,
    ]
    return [w for w in wanted if w not in saved]


def tool_environment(env: Mapping[str, str], net: SplitNet, home: str,
                     secrets: Sequence[str] = ()) -> dict[str, str]:
    """The tool's environment: the sandbox's, with every proxy variable pointing at the tool
    listener (no credentials) and nothing that carries one of `secrets` (the agent's proxy
    credentials) or names the split's internals."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if name.startswith("SANDGATE_SPLIT") or any(s and s in value for s in secrets):
            continue
        out[name] = value
    for name in PROXY_VARS:
        out[name] = net.tool_proxy
    out.update(HOME=home, USER=TOOL_USER, LOGNAME=TOOL_USER)
    return out


def proxy_secrets(env: Mapping[str, str]) -> list[str]:
    """The credentials in the sandbox's proxy URLs (the agent's identity:token), to keep out of
    the tool's environment."""
    found: list[str] = []
    for name in PROXY_VARS:
        url = urlsplit(env.get(name, ""))
        if url.password:
            found.append(url.password)
    return sorted(set(found))
