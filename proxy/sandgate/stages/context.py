"""What every stage shares: the proxy's configuration and its state across flows.

`GateState` holds what outlives one flow (the serving policy, the connections, the compiled
secret set); the addon (`sandgate.addons.gate.Gate`) is a `GateState` with mitmproxy's hooks on
top, and every stage takes it as its first argument. Per-flow state is the `FlowRecord`
(`record(flow)`), per-connection state the `Conn` (`GateState.conn`): both in stages/flow.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy.mode_specs import ReverseMode

from sandgate.approvals.service import Approvals
from sandgate.approvals.store import MemoryStore
from sandgate.audit import events as A
from sandgate.identity.resolve import Identifier
from sandgate.limits import Limiter, LimitsConfig
from sandgate.netguard import IPAddress, IPNetwork
from sandgate.policy.model import Policy, Rule
from sandgate.rpc.mcpsession import session_key
from sandgate.scrub.flowsecrets import ScrubSets
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.vault import SecretBroker
from sandgate.stages.flow import METADATA_KEY, Conn, FlowRecord
from sandgate.state.counts import Counts
from sandgate.state.local import LocalCounts

# (event, flow, its record, the event's fields as written, the flow's secret set)
FlowAudited = Callable[[str, http.HTTPFlow, FlowRecord, dict[str, Any], SecretSet], None]


@dataclass
class GateConfig:
    policy: Policy
    broker: SecretBroker
    identifier: Identifier
    audit: A.AuditLog
    resolve_overrides: dict[str, str] = field(default_factory=dict)
    self_addresses: tuple[tuple[IPAddress, int], ...] = ()
    max_request_body: int = 32 * 1024 * 1024
    # secret-like name -> decoy value (`sandgate run --canary`): refused in requests, scrubbed
    canaries: dict[str, str] = field(default_factory=dict)
    # Sandgate's own credentials (the audit checkpoints' signing key, as the values of
    # `sandgate.secrets.keyforms`): never sent by a sandbox, never shown to one
    own: tuple[tuple[str, str | bytes], ...] = ()
    # forward even while the audit log cannot be written (--audit-best-effort); off: fail closed
    audit_best_effort: bool = False
    # rates, budgets, connection counts and head limits (sandgate.limits, `sandgate run` flags)
    limiter: Limiter = field(default_factory=lambda: Limiter(LimitsConfig()))
    # --socks5-allow: the source ranges the SOCKS5 listener serves (empty: every source)
    socks5_allow: tuple[IPNetwork, ...] = ()
    # the gateway listener takes TLS only (`--gateway-tls-name`)
    gateway_tls: bool = False
    # `action: ask` rules: where approvals are asked, waited for and remembered
    approvals: Approvals = field(default_factory=lambda: Approvals(MemoryStore()))
    # called with each flow's audit event once it is written: its span (sandgate.audit.export)
    flow_audited: FlowAudited | None = None
    # who counts rates, connections per identity and budgets: None is this process (the
    # limiter); `--state redis://` the fleet (sandgate.state)
    counts: Counts | None = None


class GateState:
    """The proxy-wide state the stages read: one instance, the addon itself."""

    def __init__(self, config: GateConfig) -> None:
        self.cfg = config
        self.conns: dict[str, Conn] = {}
        self._placeholders = dict(config.policy.placeholders)
        self._scrub_sets = ScrubSets()
        # MCP session ids are bound by a MAC under this key (the same in every worker/replica)
        self.session_key = session_key(config.identifier.token_key)
        self._local_counts = LocalCounts(lambda: self.cfg.limiter)

    @property
    def counts(self) -> Counts:
        """What the stages ask to count (sandgate.state.counts)."""
        return self.cfg.counts if self.cfg.counts is not None else self._local_counts

    @property
    def policy(self) -> Policy:
        return self.cfg.policy

    def set_policy(self, policy: Policy, canaries: dict[str, str] | None = None) -> None:
        """Swap in a reloaded (fully built and validated) policy. Flows already judged keep the
        policy they started with (FlowRecord.policy); every new flow, and every new request in
        an open tunnel, is judged by this one."""
        placeholders = dict(policy.placeholders)
        if canaries is not None:
            self.cfg.canaries = canaries
        self._placeholders = placeholders
        self.cfg.policy = policy
        self._scrub_sets.invalidate()  # own_forms depend on the policy: rebuild the automaton

    @property
    def placeholders(self) -> dict[str, str]:
        """The serving policy's placeholder map (a flow keeps its own: FlowRecord.placeholders)."""
        return self._placeholders

    def flow_policy(self, rec: FlowRecord) -> Policy:
        """The one policy a flow is judged by, read at its first hook."""
        if rec.policy is None:
            rec.policy = self.cfg.policy
            rec.placeholders = self._placeholders
        return rec.policy

    def secrets(self, rec: FlowRecord | None = None) -> SecretSet:
        """Every held and retired secret value and its encodings, plus every value injected
        into `rec`'s flow (the flow owns its secrets: sandgate.scrub.flowsecrets)."""
        return self._scrub_sets.for_flow(self.cfg.broker, self.cfg.canaries, self.policy,
                                         rec.owned if rec is not None else None, self.cfg.own)

    def conn(self, client: connection.Client) -> Conn:
        c = self.conns.get(client.id)
        if c is None:
            c = self.conns[client.id] = Conn()
        return c


def record(flow: http.HTTPFlow) -> FlowRecord:
    """The flow's record, created at its first hook."""
    rec = flow.metadata.get(METADATA_KEY)
    if rec is None:
        rec = flow.metadata[METADATA_KEY] = FlowRecord()
    assert isinstance(rec, FlowRecord)
    return rec


def via_gateway(flow: http.HTTPFlow) -> bool:
    """Did the flow arrive on the gateway listener (the only reverse-mode listener)?"""
    return isinstance(flow.client_conn.proxy_mode, ReverseMode)


def allowing_rule(rec: FlowRecord) -> Rule | None:
    """The rule that allowed the request, or None in report mode (no rule allowed it, so
    nothing is bound, injected or swapped, and the address is checked without private_cidrs)."""
    assert rec.decision is not None
    rule = None if rec.reported else rec.decision.rule
    assert rule is not None or rec.reported
    return rule
