"""`sandgate run`: build every part (build.py), then serve until a signal, then stop what was
started, in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from sandgate import gctune
from sandgate.addons.lifecycle import drain, listener_up
from sandgate.admin.login import FailureLimit
from sandgate.audit import events as audit
from sandgate.runner.build import build
from sandgate.runner.config import RunConfig

log = logging.getLogger("sandgate")


async def serve(cfg: RunConfig, ready: asyncio.Event | None = None) -> None:
    """Build every part (build.py), then serve: signals, the admin API, the policy DNS, the
    policy watcher, mitmproxy's master until it stops; then stop what was started."""
    p = await build(cfg)
    loop, tasks, spawn, key = p.loop, p.tasks, p.spawn, p.key
    broker, sink, shared, approvals, gate = p.broker, p.sink, p.shared, p.approvals, p.gate
    live, metrics, recent, exports = p.live, p.metrics, p.recent, p.exports
    m, lifecycle = p.master, p.lifecycle

    drained: dict[str, Any] = {}

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
            spend_windows=lambda: gate.counts.open_windows(),
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
