"""Bring up mitmproxy with the Sandgate addon: the `sandgate run` main job."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from mitmproxy import master, options
from mitmproxy.addons import default_addons, errorcheck, termlog
from mitmproxy.utils import human

from sandgate import confdir, gctune
from sandgate.addons.gate import Gate, GateConfig
from sandgate.addons.lifecycle import Lifecycle, drain, formatter, listener_up, open_connections
from sandgate.addons.pinned import Pinned, check_sets, gateway_mode, pinned
from sandgate.admin.access import AdminUser
from sandgate.admin.login import FailureLimit
from sandgate.approvals.service import Approvals
from sandgate.audit import options as audit_setup
from sandgate.audit import stream as audit
from sandgate.audit.export import startup as export_setup
from sandgate.audit.export.startup import ExportConfig
from sandgate.audit.options import AuditSettings
from sandgate.console import ring as console_ring
from sandgate.identity.agents import AgentProcesses
from sandgate.identity.base import AddressIdentitySource, Caller
from sandgate.identity.resolve import Identifier
from sandgate.identity.roles import Role, Split
from sandgate.limits import Limiter, LimitsConfig
from sandgate.metrics import Metrics
from sandgate.mitm import pinning, registry
from sandgate.mitm.guards import wirelimits
from sandgate.mitm.speedups import parking, speed, upstreampool
from sandgate.netguard import IPAddress, IPNetwork
from sandgate.policy import live as livepolicy
from sandgate.policy.model import Policy
from sandgate.secrets.keyforms import PrivateKey, held_key_values
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.tokens import canary

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


async def serve(cfg: RunConfig, ready: asyncio.Event | None = None) -> None:
    pinning.check_version()  # the patches below were checked against this mitmproxy only
    conf = confdir.ensure_confdir(cfg.confdir)
    confdir.ensure_ca(conf)
    key = confdir.token_key(conf)
    loaded = cfg.loaded or livepolicy.load(cfg.policies)
    policy = loaded.policy
    if cfg.vault is None:
        raise ValueError("no Vault configured")
    check_listeners(cfg)
    if cfg.admin is not None:
        if not cfg.admin_token:
            raise ValueError("--admin needs a token: set SANDGATE_ADMIN_TOKEN or give "
                             "--admin-token-file")
    broker = SecretBroker(cfg.vault, policy.secrets, ttl=cfg.secret_ttl)
    try:
        await broker.start()
    except Exception as e:  # keep serving: each request needing a secret fails closed
        log.warning("sandgate: Vault not ready at start (%s); requests needing secrets get 503",
                    type(e).__name__)
    sink = await asyncio.to_thread(  # a key from Vault is read here: off the loop
        audit_setup.open_log, cfg.audit, cfg.audit_file, conf, cfg.vault, cfg.instance,
        cfg.worker)
    broker.leases.audit = sink.emit  # mint, renew, revoke (never a value)
    loop = asyncio.get_running_loop()

    limiter = Limiter(cfg.limits)
    shared = None
    if cfg.state is not None:  # rates, connections, budgets, ended sandboxes for the fleet
        from sandgate.state.shared import connect

        shared = connect(cfg.state, limiter, cfg.instance, cfg.admin_max_token_ttl,
                         audit=sink.emit)

    def sandbox_gone(caller: Caller, why: str) -> None:  # a Docker thread: hop to the loop
        assert caller.sandbox is not None
        sandbox = caller.sandbox
        loop.call_soon_threadsafe(lambda: spawn(broker.end_sandbox(sandbox, why)))
        if shared is not None:
            loop.call_soon_threadsafe(lambda: spawn(shared.fleet.end_sandbox(sandbox, why)))

    for src in cfg.address_sources:
        if hasattr(src, "on_sandbox_end"):  # Docker labels: container death ends a sandbox
            src.on_sandbox_end = sandbox_gone

    def canaries(p: Policy) -> dict[str, str]:
        return {f"canary:{name}": canary(key, name) for name in p.identities} \
            if cfg.canary else {}

    selves = self_addresses(cfg.listen_host, cfg.listen_port)
    if cfg.admin is not None:  # a sandbox must never reach the admin API through the proxy
        selves += self_addresses(*cfg.admin)
    if cfg.socks5 is not None:
        selves += self_addresses(*cfg.socks5)
    if cfg.gateway is not None:
        if same_address(cfg.gateway, (cfg.listen_host, cfg.listen_port)) or (
                cfg.admin is not None and same_address(cfg.gateway, cfg.admin)):
            raise ValueError(f"--gateway {cfg.gateway[0]}:{cfg.gateway[1]} is another "
                             "listener's address; give the gateway its own port")
        selves += self_addresses(*cfg.gateway)
    for _, host, port in cfg.role_listens:
        selves += self_addresses(host, port)
    if cfg.transparent is not None:
        selves += self_addresses(*cfg.transparent)
    approvals = make_approvals(cfg, broker, sink.emit)
    if cfg.dns is not None:
        selves += self_addresses(*cfg.dns.listen)
    gate = Gate(GateConfig(
        policy=policy,
        broker=broker,
        identifier=Identifier(key, tuple(cfg.address_sources), cfg.split, cfg.agents),
        audit=sink,
        resolve_overrides=dict(cfg.resolve),
        self_addresses=selves,
        max_request_body=int(human.parse_size(cfg.max_request_body) or 0),
        audit_best_effort=cfg.audit_best_effort,
        canaries=canaries(policy),
        own=own_keys(sink, conf,
                     cfg.worker.token if cfg.worker is not None else cfg.admin_token),
        socks5_allow=tuple(cfg.socks5_allow),
        gateway_tls=cfg.gateway_tls_name is not None,
        limiter=limiter,
        counts=shared.counts if shared is not None else None,
        approvals=approvals,
    ))
    live = livepolicy.LivePolicy(cfg.policies, loaded)
    metrics = Metrics(lambda: live.policy, instance=cfg.instance)
    broker.observer = metrics
    parking.add_metrics(metrics.registry)
    if cfg.transparent is not None:  # the capture tables' counters, read when scraped
        from sandgate.capture.nft_counters import add_metrics as add_capture_metrics

        add_capture_metrics(metrics.registry)
    if shared is not None:
        from sandgate.state.shared import add_metrics

        add_metrics(shared, metrics.registry)
        shared.fleet.version = lambda: live.current.version
        shared.fleet.on_end = broker.end_sandbox
        shared.fleet.on_reload = lambda: live.reload("fleet")
        if shared.config.lease_kv is not None:  # one dynamic lease per sandbox for the fleet
            from sandgate.state.fleet_leases import BrokerKV, SharedLeases
            from sandgate.state.url import lease_kv

            mount, prefix = lease_kv(shared.config.lease_kv)
            broker.leases.shared = SharedLeases(shared.counts.r, shared.config,
                                                BrokerKV(broker, mount), prefix)
    sink.add_listener(metrics.on_audit)
    recent = None if cfg.admin is None and cfg.worker is None else console_ring.attach(
        sink, cfg.worker.id if cfg.worker else None, lambda: live.current.version)  # console
    exports = export_setup.start(cfg.exports, sink, metrics.registry, cfg.instance)
    gate.cfg.flow_audited = exports.flow_audited

    def swap(new: livepolicy.LoadedPolicy) -> None:
        broker.update_secrets(new.policy.secrets)  # secrets no longer named leave the cache
        gate.set_policy(new.policy, canaries(new.policy))
        upstreampool.POOL.clear()  # parked connections were opened under the old policy
        gate.cfg.limiter.forget(new.policy.identities, new.policy.secrets)
        metrics.policy_swapped(new.version, new.loaded_at)

    def outcome(o: livepolicy.ReloadOutcome) -> None:
        metrics.reload_outcome(o.outcome, o.trigger, o.at)
        _audit_policy(sink, o, live.current)
        if o.outcome == "error":
            log.error("sandgate: policy reload (%s) failed; version %s keeps serving:\n%s",
                      o.trigger, o.version, "\n".join(o.problems))
        else:
            log.info("sandgate: policy reload (%s): %s, version %s (was %s)", o.trigger,
                     o.outcome, o.version, o.previous)

    live.on_swap.append(swap)
    live.on_outcome.append(outcome)
    metrics.policy_swapped(loaded.version, loaded.loaded_at)
    _audit_policy(sink, livepolicy.ReloadOutcome("ok", "start", loaded.version, "",
                                                 loaded.loaded_at), loaded)

    opts = options.Options(listen_host=cfg.listen_host, listen_port=cfg.listen_port,
                           confdir=str(conf))
    m = master.Master(opts)

    def limit_event(event: str, fields: dict[str, Any]) -> None:
        sink.emit(event, **fields)

    # every patch of mitmproxy internals, in its order (sandgate.mitm.registry.PATCHES), before
    # any addon: the first replaces the addon manager (hook lookup once per event name)
    addons = registry.install_all(m, cfg.limits, limit_event)
    m.addons.add(termlog.TermLog(out=sys.stderr))  # stdout carries the audit stream
    m.addons.add(*default_addons())
    m.addons.add(errorcheck.ErrorCheck())
    m.addons.add(gate)
    m.addons.add(wirelimits.WireLimits())
    m.addons.add(upstreampool.UpstreamPool())
    lifecycle = Lifecycle()
    m.addons.add(lifecycle)  # after the gate: a flow leaves it only once audited
    metrics.open_connections.set_function(lambda: open_connections(m))
    metrics.open_tunnels.set_function(
        lambda: sum(1 for c in list(gate.conns.values()) if c.tunnel is not None))
    metrics.inflight.set_function(lambda: len(lifecycle.inflight))
    for h in logging.getLogger().handlers:  # mitmproxy's own log lines, in the same format
        if isinstance(h, termlog.TermLogHandler):
            h.setFormatter(formatter(cfg.log_format))
    check_sets(cfg.sets)
    if cfg.sets:
        opts.set(*cfg.sets)
    bundle = upstream_bundle(conf, cfg.upstream_cas)
    broker.oauth2.use_ca_file(str(bundle) if bundle is not None else None)  # token endpoints
    broker.github.ssl_ctx = broker.oauth2.ssl_ctx
    gateway = gateway_mode(*cfg.gateway, cfg.gateway_tls_name) if cfg.gateway else None
    values = pinned(cfg.max_request_body, str(bundle) if bundle is not None else None,
                    cfg.socks5, gateway, [(h, p) for _, h, p in cfg.role_listens],
                    cfg.transparent, cfg.limits.idle_timeout)
    opts.update(**values)
    m.addons.add(Pinned(values))
    if cfg.worker is not None:
        from sandgate.workers.listen import share_port

        share_port()

    addons.set_inert(speed.inert_addons(m, values))

    tasks: set[asyncio.Task[Any]] = set()
    drained: dict[str, Any] = {}

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        t = loop.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def graceful() -> None:
        if lifecycle.draining:
            return
        metrics.draining.set(1)
        log.info("sandgate: SIGTERM: no new connections; draining for up to %gs",
                 cfg.drain_timeout)
        drained.update(await drain(m, lifecycle, cfg.drain_timeout))

    def on_term() -> None:
        if lifecycle.draining:  # a second SIGTERM: stop now
            m.shutdown()
            return
        spawn(graceful())

    handlers: dict[signal.Signals, Callable[[], None]] = {
        signal.SIGINT: m.shutdown,
        signal.SIGTERM: on_term,
        signal.SIGHUP: lambda: spawn(live.reload("signal")),
    }
    for sig, fn in handlers.items():
        try:
            loop.add_signal_handler(sig, fn)
        except (NotImplementedError, RuntimeError):
            pass
    admin_runner = None
    if cfg.admin is not None or cfg.worker is not None:
        from sandgate.admin.listener import start_admin
        from sandgate.admin.process import AdminState

        admin_token = cfg.worker.token if cfg.worker is not None else cfg.admin_token
        assert admin_token is not None
        state = AdminState(
            live=live, broker=broker, metrics=metrics, token_key=key,
            admin_token=admin_token, listener_up=lambda: listener_up(m),
            draining=lambda: lifecycle.draining, max_token_ttl=cfg.admin_max_token_ttl,
            audit=sink.emit, resolve=dict(cfg.resolve),
            open_paths=frozenset(cfg.admin_open) if cfg.worker is None else frozenset(),
            users=cfg.admin_users, trust_forwarded=cfg.worker is not None,
            approvals=approvals,
            fleet=shared.fleet if shared is not None else None,
            recent=recent,
            login_limit=FailureLimit.per_minute(cfg.admin_login_limit),
        )
        if cfg.worker is not None:
            from sandgate.workers.control import start_control

            role = cfg.worker
            admin_runner = await start_control(state, role, lambda: {
                "worker": role.id, "pid": os.getpid(), "listener_up": listener_up(m),
                "draining": lifecycle.draining, "policy_version": live.current.version})
        elif cfg.admin is not None:
            admin_runner = await start_admin(state, *cfg.admin)
    dns_server = None
    if cfg.dns is not None:  # the sandboxes' resolver, judged by the same policy and identities
        from sandgate.dns.run import start_dns

        def dns_audit(event: str, **fields: Any) -> None:  # a name may carry a secret value
            sink.emit(event, **audit.scrub_fields(fields, gate.secrets()))

        dns_server = await start_dns(
            cfg.dns, lambda: live.policy, gate.cfg.identifier.caller_at, dns_audit,
            lambda outcome: metrics.dns_answers.labels(outcome).inc(), cfg.resolve,
            reuse_port=cfg.worker is not None)
    if cfg.watch_interval:
        spawn(live.watch(cfg.watch_interval))
    if shared is not None:
        shared.fleet.start()
    if ready is not None:
        loop.call_soon(ready.set)
    gctune.settle()  # the heap built so far is frozen; young collections less often
    try:
        await m.run()
    finally:
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if admin_runner is not None:
            await admin_runner.cleanup()
        if dns_server is not None:
            await dns_server.close()
        if shared is not None:
            await shared.fleet.close()
        with contextlib.suppress(Exception):
            sink.emit("shutdown", policy_version=live.current.version,
                      drained=drained.get("drained"), unfinished=drained.get("unfinished"),
                      drain_seconds=drained.get("seconds"))
        with contextlib.suppress(Exception):
            await approvals.aclose()
        await broker.aclose()
        exports.close()  # after the shutdown event: syslog gets it too
        sink.close()


def own_keys(sink: audit.AuditLog, conf: Path, admin_token: str | None
             ) -> tuple[tuple[str, str | bytes], ...]:
    """Sandgate's own credentials, scrubbed and detected like the secrets it holds (a
    webhook's signing secret is a policy secret: the broker's):

    - the audit checkpoints' signing key;
    - the CA's private key: it signs every certificate the sandboxes trust (the certificate
      beside it in the same file is public and is not included);
    - the proxy-token key: it mints a token for any identity;
    - the admin API's token (or a worker's control token)."""
    own: list[tuple[str, str | bytes]] = []
    if sink.signing_key is not None:
        own += [("audit-signing-key", v) for v in held_key_values(sink.signing_key)]
    ca = serialization.load_pem_private_key((conf / confdir.CA_KEY_FILE).read_bytes(), None)
    if isinstance(ca, PrivateKey):
        own += [("ca-private-key", v) for v in held_key_values(ca)]
    own.append(("proxy-token-key", confdir.token_key(conf)))
    if admin_token:
        own.append(("admin-token", admin_token))
    return tuple(own)


def make_approvals(cfg: RunConfig, broker: SecretBroker,
                   audit_emit: Callable[..., None]) -> Approvals:
    """The approvals of `action: ask` rules: shared through Redis when configured."""
    from sandgate.approvals import approval_store_for
    from sandgate.approvals.webhook import WebhookSender

    store = approval_store_for(None)
    if cfg.state is not None:  # --state: any replica can decide what another one holds
        from sandgate.state import open_state

        # blocking: a held request waits on the decisions channel (its own timeout bounds it)
        store = approval_store_for(open_state(cfg.state, blocking=True),
                                   prefix=cfg.state.prefix.rstrip(":"), owned=True)
    return Approvals(store, audit=audit_emit,
                     instance=cfg.instance,
                     notify=WebhookSender(broker, audit_emit).notify)


def _audit_policy(sink: audit.AuditLog, o: livepolicy.ReloadOutcome,
                  current: livepolicy.LoadedPolicy) -> None:
    """The `policy` audit event: what is serving, and whether a reload took effect."""
    try:
        sink.emit("policy", outcome=o.outcome, trigger=o.trigger, version=o.version,
                  previous=o.previous or None, files=list(current.files),
                  problems=list(o.problems))
    except Exception:
        log.exception("sandgate: audit failed")


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

