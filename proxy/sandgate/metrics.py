"""Prometheus metrics: every metric object lives here, in Sandgate's own registry.

Requests, CONNECTs, refusals, injections, exfiltration attempts and redactions are counted from
the audit stream (`Metrics.on_audit`, an `AuditLog` listener): the one point that sees every
decision, so the proxy's hooks carry no metric calls. The secret broker reports fetches, cache
hits and Vault latency through `Metrics` as its observer; the admin listener reads the gauges of
open connections and tunnels when it is scraped.

No label carries a secret value, a token, a path or a query. Identity, rule and secret label
values are bounded by the loaded policy: anything else is counted as "unknown".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sandgate.audit import events as A
from sandgate.errors import Code
from sandgate.llm.spend import shipped_prices
from sandgate.policy.model import Policy, glob_matches

UNKNOWN = "unknown"
NONE = "none"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    300.0)
# Refusals of Sandgate's own limits (sandgate.limits, sandgate.mitm.guards.wirelimits)
LIMIT_CODES = frozenset(str(c) for c in (
    Code.TOO_LARGE, Code.HEADERS_TOO_LARGE, Code.RATE_LIMITED, Code.BUDGET_EXHAUSTED,
    Code.TOO_MANY_CONNECTIONS, Code.HEADER_TIMEOUT, Code.IDLE_TIMEOUT, Code.UPSTREAM_TIMEOUT))
APPROVAL_ACTIONS = frozenset({"requested", "voted", "decided", "used", "timed_out", "withdrawn",
                              "webhook_sent", "webhook_failed"})
_MAX_CHILDREN = 4096  # remembered label children (Metrics._child); past that, looked up
_MAX_MODEL_LABELS = 4096  # model strings whose label is remembered (_Bounds.model_label)
MAX_SANDBOX_LABELS = 1000  # distinct sandbox label values; later sandboxes count as "other"
TOKEN_KINDS = ("input", "output", "cached", "reasoning")
_TOKEN_KEYS = tuple((k, f"{k}_tokens") for k in TOKEN_KINDS)  # the audit usage's keys
_VAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sandgate")
    except PackageNotFoundError:
        return UNKNOWN


class _Bounds:
    """Label values the loaded policy allows, computed once per policy object."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.rules = {name: frozenset(r.name for r in ident.rules)
                      for name, ident in policy.identities.items()}
        self.secrets = frozenset(policy.secrets)
        # JSON-RPC label values: the names and globs the rules' mcp:/jsonrpc: write
        filters = [r.call for i in policy.identities.values() for r in i.rules
                   if r.call is not None]
        self.tool_globs = sorted({g for f in filters for g in (*(f.tools or ()), *f.deny_tools)})
        self.method_globs = sorted({g for f in filters for g in (*(f.allowed_methods or ()),
                                                                 *f.deny_methods)})
        # LLM model label values: the rules' `llm.models`, then the price globs (sandgate.llm.spend)
        self.model_globs = list(dict.fromkeys(
            [g for i in policy.identities.values() for r in i.rules if r.llm is not None
             for g in r.llm.models or ()]
            + [p.model for p in (*policy.prices, *shipped_prices())]))
        self.model_labels: dict[str, str] = {}  # a model string -> its label (see model_label)

    def model_label(self, value: object) -> str:
        """Metrics._named over model_globs, remembered per model string: matched once, not per
        call against every price glob (bounded: a sandbox chooses the strings)."""
        if not isinstance(value, str):
            return Metrics._named(value, self.model_globs)
        label = self.model_labels.get(value)
        if label is None:
            label = Metrics._named(value, self.model_globs)
            if len(self.model_labels) < _MAX_MODEL_LABELS:
                self.model_labels[value] = label
        return label


class Metrics:
    def __init__(self, policy: Callable[[], Policy], instance: str = "sandgate") -> None:
        self._policy = policy
        self._bounds: _Bounds | None = None
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # see _child
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sandgate_requests", "Requests judged, by identity, rule, decision "
            "(allow, deny, report) and Sandgate code (none when allowed)",
            ["identity", "rule", "decision", "code"], registry=r)
        self.connects = Counter(
            "sandgate_connects", "CONNECTs judged, by decision and code",
            ["decision", "code"], registry=r)
        self.leases = Counter(
            "sandgate_lease_events", "Dynamic-secret lease events (mint, renew, revoke, "
            "expire, sandbox_end) by outcome (ok, failed, pending, expired, abandoned)",
            ["action", "outcome"], registry=r)
        self.approvals = Counter(
            "sandgate_approval_events", "Approval events of `action: ask` rules (requested, "
            "voted, decided, used, timed_out, withdrawn, webhook_sent, webhook_failed)",
            ["action"], registry=r)
        self.request_duration = Histogram(
            "sandgate_request_duration_seconds", "Time from the request head to the end of the "
            "response (streams included), by decision", ["decision"],
            buckets=_REQUEST_BUCKETS, registry=r)
        self.upstream_responses = Counter(
            "sandgate_upstream_responses", "Upstream responses forwarded, by status class",
            ["status_class"], registry=r)
        self.injections = Counter(
            "sandgate_injections", "Requests a secret was injected into, by secret name",
            ["secret"], registry=r)
        self.secret_fetches = Counter(
            "sandgate_secret_fetches", "Secret reads from Vault, by secret name and outcome "
            "(ok, notfound, denied, timeout, unreachable, server, invalid, other)",
            ["secret", "outcome"], registry=r)
        self.vault_latency = Histogram(
            "sandgate_vault_request_duration_seconds", "Latency of each call to Vault",
            buckets=_VAULT_BUCKETS, registry=r)
        self.cache_hits = Counter(
            "sandgate_secret_cache_hits", "Secret lookups served from the cache", ["secret"],
            registry=r)
        self.cache_misses = Counter(
            "sandgate_secret_cache_misses", "Secret lookups that needed Vault", ["secret"],
            registry=r)
        self.exfiltration = Counter(
            "sandgate_exfiltration_attempts", "Requests or WebSocket messages refused for "
            "carrying a credential where its rule does not bind it, by secret name "
            "(canary for decoys)", ["secret"], registry=r)
        self.calls = Counter(
            "sandgate_rpc_calls", "JSON-RPC / MCP messages judged, by identity, method, tool "
            "(tools/call) and decision (allow, deny, batch: allowed alone but refused with its "
            "batch, report); method and tool are the policy's name or glob that matches, else "
            "unknown", ["identity", "method", "tool", "decision"], registry=r)
        self.limit_refusals = Counter(
            "sandgate_limit_refusals", "Requests, CONNECTs and connections stopped by a limit "
            "(size, rate, budget, connections, timeouts), by code", ["code"], registry=r)
        self.dns_answers = Counter(
            "sandgate_dns_answers", "Policy DNS queries (--dns) by outcome: answer, nodata, "
            "nxdomain and refused (the policy refused), nxdomain_upstream, servfail, "
            "unknown_source, rate_limited, formerr, notimp, dropped", ["outcome"], registry=r)
        self.llm_tokens = Counter(
            "sandgate_llm_tokens", "Tokens LLM calls spent as their answers report them, by "
            "identity, sandbox, model (the policy's glob it matches) and kind (input, output; "
            "cached and reasoning are parts of those)",
            ["identity", "sandbox", "model", "kind"], registry=r)
        self.llm_cost = Counter(
            "sandgate_llm_cost_usd", "US dollars LLM calls cost (priced by the policy's prices "
            "and the shipped table), by identity, sandbox and model",
            ["identity", "sandbox", "model"], registry=r)
        self._sandboxes: set[str] = set()
        self.redactions = Counter(
            "sandgate_redactions", "Secret values scrubbed from what went back to sandboxes",
            registry=r)
        self.open_connections = Gauge(
            "sandgate_open_client_connections", "Client connections open now", registry=r)
        self.open_tunnels = Gauge(
            "sandgate_open_tunnels", "CONNECT tunnels open now", registry=r)
        self.inflight = Gauge(
            "sandgate_inflight_flows", "Requests, streams and WebSockets in progress now",
            registry=r)
        self.policy_info = Gauge(
            "sandgate_policy_info", "The loaded policy: its content hash", ["version"],
            registry=r)
        self.policy_loaded = Gauge(
            "sandgate_policy_loaded_timestamp_seconds", "When the serving policy was loaded",
            registry=r)
        self.reloads = Counter(
            "sandgate_policy_reloads", "Policy reload attempts, by outcome (ok, unchanged, "
            "error) and trigger (file, signal, api)", ["outcome", "trigger"], registry=r)
        self.last_reload = Gauge(
            "sandgate_policy_last_reload_timestamp_seconds", "When a reload last had this "
            "outcome", ["outcome"], registry=r)
        self.draining = Gauge(
            "sandgate_draining", "1 while shutting down (no new connections accepted)",
            registry=r)
        # Which replica answered this scrape (--instance): Prometheus adds its own `instance`
        # (the scraped address) too; this one names the replica as the audit lines do.
        self.info = Gauge("sandgate_info", "Always 1; labels name this replica and version",
                          ["instance", "version"], registry=r)
        self.info.labels(instance=instance, version=_version()).set(1)

    # ------------------------------------------------------------------ label bounds

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client validates and locks on each
        call, several times per request. Only for metrics whose children are never removed
        (none of these is cleared); label values are already bounded by the policy."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            if len(self._children) < _MAX_CHILDREN:
                self._children[key] = child
        return child

    def _b(self) -> _Bounds:
        policy = self._policy()
        if self._bounds is None or self._bounds.policy is not policy:
            self._bounds = _Bounds(policy)
        return self._bounds

    def _identity(self, value: object) -> str:
        if value is None:
            return NONE
        return value if isinstance(value, str) and value in self._b().rules else UNKNOWN

    def _rule(self, identity: str, value: object) -> str:
        if value is None:
            return NONE
        rules = self._b().rules.get(identity)
        return value if isinstance(value, str) and rules is not None and value in rules \
            else UNKNOWN

    @staticmethod
    def _named(value: object, globs: list[str]) -> str:
        """A method or tool as the policy names it: itself when written exactly, else the
        first glob matching it, else unknown (a sandbox chooses these strings)."""
        if value is None:
            return NONE
        if not isinstance(value, str):
            return UNKNOWN
        if value in globs:
            return value
        return next((g for g in globs if glob_matches(g, value)), UNKNOWN)

    def secret_label(self, name: object) -> str:
        if not isinstance(name, str):
            return UNKNOWN
        if name.startswith("canary:"):
            return "canary"
        return name if name in self._b().secrets else UNKNOWN

    # ------------------------------------------------------------------ the audit point

    def _count_calls(self, identity: str, decision: str, fields: Mapping[str, Any]) -> None:
        for c in fields.get("rpc") or ():
            outcome = str(c.get("decision") or UNKNOWN)
            self.calls.labels(identity, self._named(c.get("method"), self._b().method_globs),
                              self._named(c.get("tool"), self._b().tool_globs),
                              "report" if decision == "report" else outcome).inc()

    def _sandbox(self, value: object) -> str:
        if not isinstance(value, str):
            return NONE
        if value in self._sandboxes:
            return value
        if len(self._sandboxes) < MAX_SANDBOX_LABELS:
            self._sandboxes.add(value)
            return value
        return "other"

    def _count_llm(self, identity: str, fields: Mapping[str, Any]) -> None:
        llm = fields.get(A.LLM)
        if not isinstance(llm, dict) or not isinstance(llm.get("usage"), dict):
            return
        sandbox = self._sandbox(fields.get(A.SANDBOX))
        model = self._b().model_label(llm.get("model"))
        usage = llm["usage"]
        for kind, key in _TOKEN_KEYS:
            n = usage.get(key)
            if isinstance(n, int) and n > 0:
                self._child(self.llm_tokens, identity, sandbox, model, kind).inc(n)
        cost = llm.get("cost_usd")
        if isinstance(cost, int | float) and cost > 0:
            self._child(self.llm_cost, identity, sandbox, model).inc(cost)

    def on_audit(self, event: str, fields: Mapping[str, Any]) -> None:
        code = fields.get(A.CODE)
        if event in ("request", "connect", "limit") and code in LIMIT_CODES:
            self.limit_refusals.labels(str(code)).inc()
        if event == "request":
            identity = self._identity(fields.get(A.IDENTITY))
            rule = self._rule(identity, fields.get(A.RULE))
            decision = str(fields.get(A.DECISION) or UNKNOWN)
            code = str(fields.get(A.CODE) or NONE)
            self._child(self.requests, identity, rule, decision, code).inc()
            duration = fields.get(A.DURATION_MS)
            if isinstance(duration, int | float):
                self._child(self.request_duration, decision).observe(duration / 1000)
            status = fields.get(A.UPSTREAM_STATUS)
            if isinstance(status, int) and 100 <= status < 600:
                self._child(self.upstream_responses, f"{status // 100}xx").inc()
            for s in fields.get(A.SECRETS) or ():
                self._child(self.injections, self.secret_label(str(s).partition("@")[0])).inc()
            self._count_calls(identity, decision, fields)
            self._count_llm(identity, fields)
        elif event == "approval":
            action = str(fields.get("action") or UNKNOWN)
            self.approvals.labels(action if action in APPROVAL_ACTIONS else UNKNOWN).inc()
        elif event == "lease":
            self.leases.labels(str(fields.get("action") or UNKNOWN),
                               str(fields.get("outcome") or UNKNOWN)).inc()
            return
        elif event == "connect":
            self.connects.labels(str(fields.get(A.DECISION) or UNKNOWN),
                                 str(fields.get(A.CODE) or NONE)).inc()
        else:
            if event != "websocket":
                return
            if fields.get("rpc"):  # a message judged on a WebSocket (addons/wsrpc)
                self._count_calls(self._identity(fields.get(A.IDENTITY)),
                                  str(fields.get(A.DECISION) or UNKNOWN), fields)
        for entry in fields.get(A.EXFIL) or ():
            text = str(entry)
            name = "canary:" if text.startswith("canary:") else text.partition(":")[0]
            self.exfiltration.labels(self.secret_label(name)).inc()
        redactions = fields.get(A.REDACTIONS)
        if isinstance(redactions, int) and redactions > 0:
            self.redactions.inc(redactions)

    # ------------------------------------------------------------------ the secret broker

    def secret_cache(self, name: str, hit: bool) -> None:
        self._child(self.cache_hits if hit else self.cache_misses, self.secret_label(name)).inc()

    def secret_fetch(self, name: str, outcome: str) -> None:
        self.secret_fetches.labels(self.secret_label(name), outcome).inc()

    def vault_call(self, seconds: float) -> None:
        self.vault_latency.observe(seconds)

    # ------------------------------------------------------------------ policy

    def policy_swapped(self, version: str, loaded_at: float) -> None:
        self.policy_info.clear()
        self.policy_info.labels(version).set(1)
        self.policy_loaded.set(loaded_at)

    def reload_outcome(self, outcome: str, trigger: str, at: float) -> None:
        self.reloads.labels(outcome, trigger).inc()
        self.last_reload.labels(outcome).set(at)

    def render(self) -> bytes:
        return generate_latest(self.registry)
