"""`sandgate run`'s options as one value (`RunConfig`), and the checks and words made from
them before anything starts: listener addresses, --resolve pins, the start banner."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sandgate.admin.access import AdminUser
from sandgate.audit.export.startup import ExportConfig
from sandgate.audit.options import AuditSettings
from sandgate.identity.agents import AgentProcesses
from sandgate.identity.base import AddressIdentitySource
from sandgate.identity.roles import Role, Split
from sandgate.limits import LimitsConfig
from sandgate.netguard import IPAddress, IPNetwork
from sandgate.policy import live as livepolicy
from sandgate.secrets.vault import VaultConfig

if TYPE_CHECKING:
    from sandgate.dns.run import DnsConfig
    from sandgate.state import StateConfig
    from sandgate.workers.control import WorkerRole

log = logging.getLogger("sandgate")

DEFAULT_MAX_REQUEST_BODY = "32m"


@dataclass
class RunConfig:
    policies: Path
    confdir: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    sets: Sequence[str] = ()
    resolve: dict[str, str] = field(default_factory=dict)
    upstream_cas: Sequence[Path] = ()
    audit_file: Path | None = None
    vault: VaultConfig | None = None
    secret_ttl: float = 300.0
    address_sources: Sequence[AddressIdentitySource] = ()
    max_request_body: str = DEFAULT_MAX_REQUEST_BODY
    canary: bool = False
    audit_best_effort: bool = False
    # the policy `sandgate run` validated before printing or binding anything (else loaded here)
    loaded: livepolicy.LoadedPolicy | None = None
    admin: tuple[str, int] | None = None  # --admin HOST:PORT
    admin_token: str | None = field(default=None, repr=False)
    admin_max_token_ttl: int = 24 * 3600
    drain_timeout: float = 30.0
    watch_interval: float | None = 0.5  # None: no file watching (SIGHUP and the API still work)
    log_format: str = "text"
    socks5: tuple[str, int] | None = None  # --socks5 HOST:PORT (off unless given)
    socks5_allow: tuple[IPNetwork, ...] = ()  # --socks5-allow CIDR (empty: every source)
    # set in the processes `--workers N` starts: SO_REUSEPORT, `worker` in audit events, the
    # admin API on the worker's control socket (the supervisor owns the --admin listener)
    worker: WorkerRole | None = None
    gateway: tuple[str, int] | None = None  # --gateway HOST:PORT
    gateway_tls_name: str | None = None  # --gateway-tls-name: TLS only, a cert for this name
    admin_open: Sequence[str] = ()  # admin paths served without the bearer token
    instance: str = "sandgate"  # this replica's name: in every audit event and sandgate_info
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # pattern 1 with the split (--role-listen, --tool-identity): sandgate.identity.roles
    split: Split | None = None
    role_listens: Sequence[tuple[Role, str, int]] = ()
    # pattern 1 without a hook (--agent-dir, --agent-split): sandgate.identity.agents
    agents: AgentProcesses | None = None
    transparent: tuple[str, int] | None = None  # --transparent HOST:PORT (nftables redirects)
    audit: AuditSettings = field(default_factory=AuditSettings)  # format, chain, rotation
    admin_users: tuple[AdminUser, ...] = ()  # --admin-users (sandgate.admin.access)
    admin_login_limit: int = 5  # --admin-login-limit: wrong tokens a minute per source
    dns: DnsConfig | None = None  # --dns HOST:PORT: the policy DNS (sandgate.dns)
    exports: ExportConfig = field(default_factory=ExportConfig)  # --otlp, --audit-syslog
    state: StateConfig | None = None  # --state redis://: the fleet's shared state



def parse_resolve(specs: Sequence[str]) -> dict[str, str]:
    """`HOST=IP` pairs from --resolve. Ports come from the request, never from here."""
    from sandgate.policy.hosts import normalise_host

    out: dict[str, str] = {}
    for spec in specs:
        host, sep, ip = spec.partition("=")
        if not sep or not host or not ip:
            raise ValueError(f"--resolve {spec!r}: expected HOST=IP, e.g. api.example.com=10.0.0.5")
        try:
            addr = ipaddress.ip_address(ip.strip().strip("[]"))
        except ValueError:
            raise ValueError(f"--resolve {spec!r}: {ip!r} is not an IP address") from None
        out[normalise_host(host)] = str(addr)
    return out


def upstream_bundle(conf: Path, extra: Sequence[Path]) -> Path | None:
    """System roots plus the operator's private CAs: --upstream-ca adds, it does not replace."""
    if not extra:
        return None
    import certifi

    parts = [Path(certifi.where()).read_text()]
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    if system.exists():
        parts.append(system.read_text())
    for p in extra:
        text = p.read_text()
        if "BEGIN CERTIFICATE" not in text:
            raise ValueError(f"--upstream-ca {p}: no PEM certificate in the file")
        parts.append(text)
    bundle = conf / "upstream-ca-bundle.pem"
    # atomically: with --workers N a restarting worker rewrites it while the others read it
    tmp = conf / f".upstream-ca-bundle.{os.getpid()}.pem"
    tmp.write_text("\n".join(parts))
    os.replace(tmp, bundle)
    return bundle


def self_addresses(host: str, port: int) -> tuple[tuple[IPAddress, int], ...]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address("0.0.0.0")
    out: list[tuple[IPAddress, int]] = [(ip, port)]
    if ip.is_unspecified:
        out.append((ipaddress.ip_address("::"), port))
    return tuple(out)


def check_listeners(cfg: RunConfig) -> None:
    """No two listeners (proxy, SOCKS5, admin) on one address (ValueError says which)."""
    named = [("--listen", (cfg.listen_host, cfg.listen_port))]
    if cfg.socks5 is not None:
        named.append(("--socks5", cfg.socks5))
    if cfg.admin is not None:
        named.append(("--admin", cfg.admin))
    named += [(f"--role-listen {role}", (host, port)) for role, host, port in cfg.role_listens]
    if cfg.transparent is not None:
        named.append(("--transparent", cfg.transparent))
    for i, (name, addr) in enumerate(named):
        for other, other_addr in named[:i]:
            if same_address(addr, other_addr):
                raise ValueError(f"{name} {addr[0]}:{addr[1]} is the address of {other} "
                                 f"({other_addr[0]}:{other_addr[1]}); give each listener its "
                                 "own port")
    if cfg.socks5_allow and cfg.socks5 is None:
        raise ValueError("--socks5-allow restricts the SOCKS5 listener: give --socks5 HOST:PORT")


def same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Would these two listeners collide (same port, and the same or an unspecified host)?"""
    if a[1] != b[1]:
        return False
    unspecified = {"", "0.0.0.0", "::"}
    return a[0] == b[0] or a[0] in unspecified or b[0] in unspecified



def banner(cfg: RunConfig, conf: Path) -> str:
    socks = ""
    if cfg.socks5 is not None:
        allow = ", ".join(str(n) for n in cfg.socks5_allow) or "every source"
        socks = f"sandgate: SOCKS5 on {cfg.socks5[0]}:{cfg.socks5[1]} (from {allow})\n"
    return (
        f"sandgate: listening on {cfg.listen_host}:{cfg.listen_port}, policies {cfg.policies}\n"
        + socks
        + (f"sandgate: transparent capture on {cfg.transparent[0]}:{cfg.transparent[1]} "
           "(identity by source address)\n" if cfg.transparent else "")
        + (f"sandgate: gateway on {'https' if cfg.gateway_tls_name else 'http'}://"
           f"{cfg.gateway_tls_name or cfg.gateway[0]}:{cfg.gateway[1]}/PREFIX\n"
           if cfg.gateway else "") +
        f"sandgate: CA for sandboxes: sandgate ca --confdir {conf}\n"
        f"sandgate: a token: sandgate token issue --confdir {conf} --identity coding-agent\n"
        f"sandgate: try: curl --cacert <(sandgate ca --confdir {conf}) "
        f"-x http://coding-agent:$TOKEN@{cfg.listen_host}:{cfg.listen_port} "
        "https://api.anthropic.com/v1/messages -d '{}'\n"
    )
