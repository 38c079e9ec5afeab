"""Bring up mitmproxy with the Sandgate addon: the `sandgate run` main job."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mitmproxy import master, options
from mitmproxy.addons import default_addons, errorcheck, termlog
from mitmproxy.utils import human

from sandgate import audit, confdir
from sandgate.addons import patches
from sandgate.addons.gate import Gate, GateConfig
from sandgate.addons.pinned import Pinned, check_sets, pinned
from sandgate.identity.base import AddressIdentitySource
from sandgate.identity.resolve import Identifier
from sandgate.netguard import IPAddress
from sandgate.policy.loader import load_policy_dir
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.tokens import canary

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
    bundle.write_text("\n".join(parts))
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


async def serve(cfg: RunConfig, ready: asyncio.Event | None = None) -> None:
    conf = confdir.ensure_confdir(cfg.confdir)
    confdir.ensure_ca(conf)
    key = confdir.token_key(conf)
    policy = load_policy_dir(cfg.policies)
    if cfg.vault is None:
        raise ValueError("no Vault configured")
    broker = SecretBroker(cfg.vault, policy.secrets, ttl=cfg.secret_ttl)
    try:
        await broker.start()
    except Exception as e:  # keep serving: each request needing a secret fails closed
        log.warning("sandgate: Vault not ready at start (%s); requests needing secrets get 503",
                    type(e).__name__)
    sink = audit.AuditLog(cfg.audit_file)
    gate = Gate(GateConfig(
        policy=policy,
        broker=broker,
        identifier=Identifier(key, tuple(cfg.address_sources)),
        audit=sink,
        resolve_overrides=dict(cfg.resolve),
        self_addresses=self_addresses(cfg.listen_host, cfg.listen_port),
        max_request_body=int(human.parse_size(cfg.max_request_body) or 0),
        canaries={f"canary:{name}": canary(key, name) for name in policy.identities}
        if cfg.canary else {},
    ))

    opts = options.Options(listen_host=cfg.listen_host, listen_port=cfg.listen_port,
                           confdir=str(conf))
    m = master.Master(opts)
    m.addons.add(termlog.TermLog(out=sys.stderr))  # stdout carries the audit stream
    m.addons.add(*default_addons())
    m.addons.add(errorcheck.ErrorCheck())
    m.addons.add(gate)
    check_sets(cfg.sets)
    if cfg.sets:
        opts.set(*cfg.sets)
    bundle = upstream_bundle(conf, cfg.upstream_cas)
    values = pinned(cfg.max_request_body, str(bundle) if bundle is not None else None)
    opts.update(**values)
    m.addons.add(Pinned(values))
    patches.install()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, m.shutdown)
        except (NotImplementedError, RuntimeError):
            pass
    if ready is not None:
        loop.call_soon(ready.set)
    try:
        await m.run()
    finally:
        await broker.aclose()
        sink.close()


def banner(cfg: RunConfig, conf: Path) -> str:
    return (
        f"sandgate: listening on {cfg.listen_host}:{cfg.listen_port}, policies {cfg.policies}\n"
        f"sandgate: CA for sandboxes: sandgate ca --confdir {conf}\n"
        f"sandgate: a token: sandgate token issue --confdir {conf} --identity coding-agent\n"
        f"sandgate: try: curl --cacert <(sandgate ca --confdir {conf}) "
        f"-x http://coding-agent:$TOKEN@{cfg.listen_host}:{cfg.listen_port} "
        "https://api.anthropic.com/v1/messages -d '{}'\n"
    )

