"""Every part of `sandgate run` built in one function, in start-up order, each with its
collaborators: the policy, Vault, the audit log, the fleet's state, the gate, metrics, exports,
mitmproxy's master with every patch installed and Sandgate's addons."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from mitmproxy import master, options
from mitmproxy.addons import default_addons, errorcheck, termlog
from mitmproxy.utils import human

from sandgate import confdir
from sandgate.addons.gate import Gate, GateConfig
from sandgate.addons.lifecycle import Lifecycle, formatter, open_connections
from sandgate.addons.pinned import Pinned, check_sets, gateway_mode, pinned
from sandgate.approvals.service import Approvals
from sandgate.audit import events as audit
from sandgate.audit import options as audit_setup
from sandgate.audit.export import startup as export_setup
from sandgate.audit.export.startup import Exports
from sandgate.console import ring as console_ring
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.limits import Limiter
from sandgate.metrics import Metrics
from sandgate.mitm import pinning, registry
from sandgate.mitm.guards import wirelimits
from sandgate.mitm.speedups import parking, speed, upstreampool
from sandgate.policy import live as livepolicy
from sandgate.policy.model import Policy
from sandgate.runner.config import (
    RunConfig,
    check_listeners,
    same_address,
    self_addresses,
    upstream_bundle,
)
from sandgate.secrets.keyforms import PrivateKey, held_key_values
from sandgate.secrets.vault import SecretBroker
from sandgate.tokens import canary

if TYPE_CHECKING:  # imported when --state is given (Redis)
    from sandgate.state.shared import SharedState

log = logging.getLogger("sandgate")


@dataclass
class Parts:
    """What build() made, for serve() to run and stop."""

    loop: asyncio.AbstractEventLoop
    tasks: set[asyncio.Task[Any]]  # started by spawn(), cancelled when serving ends
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    conf: Path
    key: bytes  # the proxy-token key
    broker: SecretBroker
    sink: audit.AuditLog
    shared: SharedState | None  # --state
    approvals: Approvals
    gate: Gate
    live: livepolicy.LivePolicy
    metrics: Metrics
    recent: console_ring.EventRing | None  # the console's recent decisions
    exports: Exports
    master: master.Master
    lifecycle: Lifecycle


async def build(cfg: RunConfig) -> Parts:
    """Every part of `sandgate run`, built in start-up order, each with its collaborators;
    nothing listens yet but what mitmproxy's master binds when it runs (serve.py)."""
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
    sink = await asyncio.to_thread(  # a key from Vault is read here: off the loop
        audit_setup.open_log, cfg.audit, cfg.audit_file, conf, cfg.vault, cfg.instance,
        cfg.worker)
    live = livepolicy.LivePolicy(cfg.policies, loaded)
    metrics = Metrics(lambda: live.policy, instance=cfg.instance)
    broker = SecretBroker(cfg.vault, policy.secrets, ttl=cfg.secret_ttl, observer=metrics,
                          audit=sink.emit)  # lease events: mint, renew, revoke (never a value)
    try:
        await broker.start()
    except Exception as e:  # keep serving: each request needing a secret fails closed
        log.warning("sandgate: Vault not ready at start (%s); requests needing secrets get 503",
                    type(e).__name__)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        t = loop.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    limiter = Limiter(cfg.limits)
    shared = None
    if cfg.state is not None:  # rates, connections, budgets, ended sandboxes for the fleet
        from sandgate.state.shared import connect

        # the fleet calls back into this process: the policy it serves (`live`), the broker for
        # an ended sandbox, a reload
        shared = connect(cfg.state, limiter, cfg.instance, cfg.admin_max_token_ttl,
                         audit=sink.emit, version=lambda: live.current.version,
                         on_end=broker.end_sandbox, on_reload=lambda: live.reload("fleet"))

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
    # what the gate is given, read where it always was (a bad size or key fails before exports)
    max_request_body = int(human.parse_size(cfg.max_request_body) or 0)
    own = own_keys(sink, conf, cfg.worker.token if cfg.worker is not None else cfg.admin_token)
    parking.add_metrics(metrics.registry)
    if cfg.transparent is not None:  # the capture tables' counters, read when scraped
        from sandgate.capture.nft_counters import add_metrics as add_capture_metrics

        add_capture_metrics(metrics.registry)
    if shared is not None:
        from sandgate.state.shared import add_metrics

        add_metrics(shared, metrics.registry)
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
    gate = Gate(GateConfig(
        policy=policy,
        broker=broker,
        identifier=Identifier(key, tuple(cfg.address_sources), cfg.split, cfg.agents),
        audit=sink,
        resolve_overrides=dict(cfg.resolve),
        self_addresses=selves,
        max_request_body=max_request_body,
        audit_best_effort=cfg.audit_best_effort,
        canaries=canaries(policy),
        own=own,
        socks5_allow=tuple(cfg.socks5_allow),
        gateway_tls=cfg.gateway_tls_name is not None,
        limiter=limiter,
        counts=shared.counts if shared is not None else None,
        approvals=approvals,
        flow_audited=exports.flow_audited,  # --otlp: each audited flow's span
    ))

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
    addons = registry.install_all(m, cfg.limits, limit_event,
                                  worker=cfg.worker is not None)
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
    broker.trust_upstream_cas(str(bundle) if bundle is not None else None)  # token endpoints
    gateway = gateway_mode(*cfg.gateway, cfg.gateway_tls_name) if cfg.gateway else None
    values = pinned(cfg.max_request_body, str(bundle) if bundle is not None else None,
                    cfg.socks5, gateway, [(h, p) for _, h, p in cfg.role_listens],
                    cfg.transparent, cfg.limits.idle_timeout)
    opts.update(**values)
    m.addons.add(Pinned(values))

    addons.set_inert(speed.inert_addons(m, values))
    return Parts(loop=loop, tasks=tasks, spawn=spawn, conf=conf, key=key, broker=broker,
                 sink=sink, shared=shared, approvals=approvals, gate=gate, live=live,
                 metrics=metrics, recent=recent, exports=exports, master=m, lifecycle=lifecycle)



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
