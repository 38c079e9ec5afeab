"""`sandgate run --dns HOST:PORT`: the policy DNS inside the proxy process, on its policy,
identities, audit stream and metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sandgate.dns.bounds import DnsLimits
from sandgate.dns.resolver import Upstream, system_servers
from sandgate.dns.server import PolicyDns, PolicyDnsServer
from sandgate.identity.base import Caller
from sandgate.policy.model import Policy


@dataclass(frozen=True)
class DnsConfig:
    listen: tuple[str, int]
    upstream: Sequence[tuple[str, int]] = ()  # --dns-upstream; empty: this host's resolv.conf
    limits: DnsLimits = field(default_factory=DnsLimits)


def upstream_servers(cfg: DnsConfig) -> list[tuple[str, int]]:
    """The recursive servers Sandgate asks; never its own DNS listener (a loop)."""
    servers = list(cfg.upstream) or system_servers()
    if not servers:
        raise ValueError("--dns: this host's resolv.conf names no DNS server; give "
                         "--dns-upstream HOST:PORT")
    for host, port in servers:
        if port == cfg.listen[1] and host in (cfg.listen[0], "0.0.0.0", "::"):
            raise ValueError(f"--dns-upstream {host}:{port} is the policy DNS itself; name "
                             "the recursive resolver Sandgate should ask")
    return servers


async def start_dns(cfg: DnsConfig, policy: Callable[[], Policy],
                    identify: Callable[[str], Caller | None], audit: Callable[..., None],
                    count: Callable[[str], None], overrides: Mapping[str, str],
                    reuse_port: bool = False) -> PolicyDnsServer:
    upstream = Upstream(upstream_servers(cfg), cfg.limits.upstream_timeout,
                        cfg.limits.max_chain)
    server = PolicyDnsServer(PolicyDns(policy, identify, upstream, cfg.limits, audit, count,
                                       overrides), *cfg.listen, reuse_port=reuse_port)
    await server.start()
    return server


__all__ = ["DnsConfig", "start_dns", "upstream_servers"]
