"""What the admin API of one process answers from (`AdminState`), and the plain functions that
read it: the `/v1/policy` document and the `/readyz` answer (also the web console's overview).

The listener (sandgate.admin.listener), a worker's control socket and the console's LocalSource
all read this process through these; none of them builds another copy.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandgate.admin.access import AdminUser
from sandgate.admin.login import FailureLimit
from sandgate.approvals.service import Approvals
from sandgate.console.ring import EventRing
from sandgate.metrics import Metrics
from sandgate.policy.live import LivePolicy
from sandgate.secrets.vault import SecretBroker

if TYPE_CHECKING:
    from sandgate.llm.spend import WindowView
    from sandgate.state.fleet import Fleet

DEFAULT_TOKEN_TTL = 3600
DEFAULT_MAX_TOKEN_TTL = 24 * 3600


@dataclass
class AdminState:
    live: LivePolicy
    broker: SecretBroker
    metrics: Metrics
    token_key: bytes
    admin_token: str
    listener_up: Callable[[], bool]
    draining: Callable[[], bool]
    max_token_ttl: int = DEFAULT_MAX_TOKEN_TTL
    # writes an audit event (event, **fields); tokens issued here are audited (never the token)
    audit: Callable[..., None] | None = None
    # the proxy's --resolve pins: explain shows the address step exactly as the proxy runs it
    resolve: Mapping[str, str] = field(default_factory=dict)
    # --admin-open: paths served without the token (kubelet probes and Prometheus carry none);
    # only these two can be opened, and neither answers with anything secret
    open_paths: frozenset[str] = frozenset()
    # --admin-users: named users with roles (the admin token is the user `admin`)
    users: tuple[AdminUser, ...] = ()
    # a worker's control socket: the front's forwarded user (sandgate.admin.access) is trusted
    trust_forwarded: bool = False
    # `action: ask`: the approvals this process holds or decides (sandgate.approvals)
    approvals: Approvals | None = None
    # --state: sandbox ends and reloads reach every replica; /readyz shows the fleet's state
    fleet: Fleet | None = None
    # the recent decisions the web console shows (fed by the audit stream: runner/build.py)
    recent: EventRing | None = None
    # the LLM budget windows open now, as the proxy counts them (the console's spend view):
    # this process's, or the fleet's with --state (sandgate.state.counts.Counts.open_windows)
    spend_windows: Callable[[], Awaitable[list[WindowView]]] | None = None
    # wrong tokens per source, shared by the admin API and the console's login (admin_login)
    login_limit: FailureLimit = field(default_factory=FailureLimit)


def needs_vault(state: AdminState) -> bool:
    return any(r.secrets for ident in state.live.policy.identities.values()
               for r in ident.rules)


def policy_doc(state: AdminState) -> dict[str, Any]:
    """The `/v1/policy` answer (also the web console's overview)."""
    cur = state.live.current
    p = cur.policy
    return {
        "version": cur.version,
        "loaded_at": cur.loaded_at,
        "loaded_at_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cur.loaded_at)),
        "directory": str(state.live.directory),
        "files": list(cur.files),
        "identities": {
            name: {"mode": ident.mode,
                   "rules": [{"name": r.name, "action": r.verb,
                              "hosts": [h.text for h in r.hosts],
                              "secrets": sorted(r.secrets),
                              "passthrough": r.passthrough} for r in ident.rules]}
            for name, ident in sorted(p.identities.items())},
        "secrets": sorted(p.secrets),
        "last_reload": state.live.last.as_dict() if state.live.last else None,
    }


async def readiness(state: AdminState) -> tuple[int, dict[str, Any]]:
    """The `/readyz` answer of this process: (200 or 503, body with the reasons)."""
    reasons: list[str] = []
    if state.draining():
        reasons.append("shutting down: not accepting new connections")
    elif not state.listener_up():
        reasons.append("the proxy listener is not up")
    if needs_vault(state):
        problem = await state.broker.check()
        if problem is not None:
            reasons.append(f"vault: {problem}")
    body: dict[str, Any] = {"ready": not reasons, "reasons": reasons,
                            "policy_version": state.live.current.version}
    if state.fleet is not None:
        fleet = body["fleet"] = state.fleet.agreement()
        if not fleet["available"] and state.fleet.cfg.fail == "closed":
            reasons.append("shared state unavailable (--state-fail closed)")
            body["ready"] = False
    if state.live.problems:
        # the last reload failed: the previous policy keeps serving, so still ready
        body["policy_reload_problems"] = list(state.live.problems)
    return (200 if not reasons else 503), body
