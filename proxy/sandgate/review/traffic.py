"""Recorded traffic: the requests of an audit log, replayed against policies.

`read_audit` turns the `request` and `connect` events that sandgate.audit.events writes (fields
identity, method, scheme, host, port, path; query values REDACTED except those of parameters a
rule constrains, which are judged with the path) into `Recorded` requests. An event that cannot
be replayed (not JSON, a field missing or of the wrong type, a target the request parser
refuses) is kept as `Unreplayable` with its line and why: nothing is dropped silently. Other
events (policy, shutdown, token, websocket) are counted by name.

`diff` replays every recorded request against two policies with `sandgate.decision.judge`, the
judge `check` and `explain` use (the proxy's request parser, decision and, for IP literals and
--resolve names, address step), and groups the requests whose outcome changes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sandgate.audit import events as A
from sandgate.decision import judge, shown_outcome
from sandgate.policy.call_rules import describe
from sandgate.policy.model import Policy
from sandgate.request import parse_url, split_authority
from sandgate.rpc.jsonrpc import Call, Message

REPLAYED_EVENTS = ("request", "connect")


@dataclass(frozen=True, slots=True)
class Recorded:
    """One replayable request (or CONNECT) of an audit log."""

    line: int  # 1-based line in the audit log
    event: str  # "request" or "connect"
    identity: str
    method: str  # "CONNECT" for a connect event
    target: str  # an absolute URL (path part only), or host:port for CONNECT
    decision: str | None  # as recorded: allow / deny / report
    code: str | None  # as recorded
    secrets: tuple[str, ...]  # names injected or substituted, as recorded (without @version)
    dialed: str | None  # ip:port as recorded
    sandbox: str | None = None  # the caller's sandbox id as recorded (per-sandbox secrets)
    gateway: bool = False  # came in on the gateway listener: judged without a CONNECT
    # the JSON-RPC call its body carried (the event's `rpc`): methods and tool names, never
    # arguments, so `arguments:` constraints are not replayed
    call: Call | None = None
    websocket: bool = False  # the request opened a WebSocket (the event's `websocket`)

    @property
    def connect(self) -> bool:
        return self.event == "connect"

    @property
    def request_line(self) -> str:
        shown = f" [{describe(self.call)}]" if self.call is not None else ""
        return f"{self.method} {self.target}{shown}{' (WebSocket)' if self.websocket else ''}"


@dataclass(frozen=True, slots=True)
class Unreplayable:
    line: int
    event: str | None
    reason: str


@dataclass(slots=True)
class AuditTraffic:
    source: str
    recorded: list[Recorded] = field(default_factory=list)
    unreplayable: list[Unreplayable] = field(default_factory=list)
    other_events: Counter[str] = field(default_factory=Counter)  # event name -> count


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def path_part(path: str) -> str:
    """The recorded path and the query parameters whose values the audit kept (those a rule
    constrains, audit.redact_path); redacted parameters and the fragment are dropped, so a
    rule constraining one of those matches nothing on replay."""
    path, _, query = path.split("#", 1)[0].partition("?")
    kept = [p for p in query.split("&")
            if p and p != A.REDACTED and p.partition("=")[2] != A.REDACTED]
    return path + ("?" + "&".join(kept) if kept else "")


def _secret_names(raw: Any) -> tuple[str, ...] | None:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        return None
    return tuple(sorted({s.split("@", 1)[0] for s in raw}))


def _opt_str(ev: Mapping[str, Any], key: str) -> str | None:
    v = ev.get(key)
    return v if isinstance(v, str) else None


def _valid(key: str, value: Any) -> bool:
    if key == A.PORT:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str) and bool(value)


def parse_event(line_no: int, ev: Any) -> Recorded | Unreplayable | str:
    """One audit event -> a Recorded request, an Unreplayable one, or (for an event that is not
    a request) its event name."""
    if not isinstance(ev, dict):
        return Unreplayable(line_no, None, f"not a JSON object but {type(ev).__name__}")
    event = ev.get(A.EVENT)
    if event not in REPLAYED_EVENTS:
        return str(event)
    assert isinstance(event, str)
    connect = event == "connect"
    needed = (A.IDENTITY, A.HOST, A.PORT) if connect else (
        A.IDENTITY, A.METHOD, A.SCHEME, A.HOST, A.PORT, A.PATH)
    bad = [k for k in needed if not _valid(k, ev.get(k))]
    if bad:
        what = "missing or invalid field(s): " + ", ".join(bad)
        if bad == [A.IDENTITY] and ev.get(A.IDENTITY) is None:
            what += " (refused before the caller was identified)"
        return Unreplayable(line_no, event, what)
    secrets = _secret_names(ev.get(A.SECRETS))
    if secrets is None:
        return Unreplayable(line_no, event, "invalid field: secrets (not a list of names)")
    host: str = ev[A.HOST]
    port: int = ev[A.PORT]
    try:
        if connect:
            h, p = split_authority(_authority(host, port), "https")
            method = "CONNECT"
            target = _authority(h, p)
        else:
            path = path_part(ev[A.PATH]) or "/"
            target = f"{ev[A.SCHEME].lower()}://{_authority(host, port)}{path}"
            method = ev[A.METHOD]
            method = parse_url(method, target).method
    except ValueError as e:
        return Unreplayable(line_no, event, f"cannot be parsed as a request: {e}")
    call = recorded_call(ev.get("rpc"))
    if call is False:
        return Unreplayable(line_no, event, "invalid field: rpc (not a list of calls)")
    return Recorded(line_no, event, ev[A.IDENTITY], method, target, _opt_str(ev, A.DECISION),
                    _opt_str(ev, A.CODE), secrets, _opt_str(ev, A.DIALED),
                    _opt_str(ev, A.SANDBOX), _opt_str(ev, A.GATEWAY) is not None, call or None,
                    ev.get(A.WEBSOCKET) is True and not connect)


def recorded_call(rpc: Any) -> Call | Literal[False] | None:
    """The call of an event's `rpc` entries (None: none; False: malformed)."""
    if rpc is None:
        return None
    if not isinstance(rpc, list) or not rpc or not all(isinstance(c, dict) for c in rpc):
        return False
    messages = []
    for c in rpc:
        kind, method, name = c.get("kind"), c.get("method"), c.get("tool", c.get("name"))
        if kind not in ("request", "notification", "response") or not (
                method is None or isinstance(method, str)) or not (
                name is None or isinstance(name, str)):
            return False
        mid = c.get("id")
        messages.append(Message(kind, method, mid if isinstance(mid, int | str) else None,
                                name, None))
    return Call(tuple(messages), batch=len(messages) > 1)


def read_audit(lines: Iterable[str], source: str = "-") -> AuditTraffic:
    """Every request and connect event of an audit log (JSON lines, as sandgate.audit.events
    writes)."""
    out = AuditTraffic(source)
    for n, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        try:
            ev = json.loads(text)
        except ValueError as e:
            out.unreplayable.append(Unreplayable(n, None, f"not JSON: {e}"))
            continue
        got = parse_event(n, ev)
        if isinstance(got, Recorded):
            out.recorded.append(got)
        elif isinstance(got, Unreplayable):
            out.unreplayable.append(got)
        else:
            out.other_events[got] += 1
    return out


# --- diff ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Outcome:
    """What a policy does with one request, as far as a diff compares it."""

    decision: str  # allow / deny / report
    rule: str | None  # the allowing rule, or the deny rule that refused
    code: str | None  # why not (None when allowed)
    secrets: tuple[str, ...]  # injected or substituted (the allowing rule's)
    passthrough: bool | None  # CONNECT only

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"decision": self.decision, "rule": self.rule, "code": self.code,
                             "secrets": list(self.secrets)}
        if self.passthrough is not None:
            d["passthrough"] = self.passthrough
        return d

    def __str__(self) -> str:
        s = self.decision
        if self.rule:
            s += f" by rule '{self.rule}'"
        if self.code:
            s += f" ({self.code})"
        if self.secrets:
            s += f", injects {', '.join(self.secrets)}"
        if self.passthrough:
            s += ", passthrough"
        return s


def outcome(policy: Policy, rec: Recorded, resolve: Mapping[str, str]) -> Outcome:
    """Judge one recorded request exactly as `sandgate explain` would. Raises ValueError for a
    request the parser refuses (read_audit has already weeded those out)."""
    v = judge(policy, rec.identity, rec.method, rec.target, resolve, rec.sandbox, rec.gateway,
              rec.call, "websocket" if rec.websocket else None)
    d = v.decision
    decision = shown_outcome(policy, rec.identity, d)
    return Outcome(decision, d.rule_name, str(d.code) if d.code else None,
                   tuple(sorted(v.secrets)), v.passthrough if v.connect else None)


def change_kinds(old: Outcome, new: Outcome) -> tuple[str, ...]:
    """How an outcome changed: `allow->deny` (any change of decision), `rule changed`,
    `secrets changed`, `code changed`, `passthrough changed`; empty when unchanged."""
    kinds: list[str] = []
    if old.decision != new.decision:
        kinds.append(f"{old.decision}->{new.decision}")
    if old.rule != new.rule:
        kinds.append("rule changed")
    if old.secrets != new.secrets:
        kinds.append("secrets changed")
    if old.code != new.code and old.decision == new.decision:
        kinds.append("code changed")
    if old.passthrough != new.passthrough:
        kinds.append("passthrough changed")
    return tuple(kinds)


@dataclass(slots=True)
class Change:
    """Identical changes grouped: one identity, one request, the same old and new outcome."""

    identity: str
    request: str
    old: Outcome
    new: Outcome
    kinds: tuple[str, ...]
    count: int = 0
    lines: list[int] = field(default_factory=list)  # audit lines (all of them)

    def as_dict(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "identity": self.identity, "request": self.request,
                "count": self.count, "old": self.old.as_dict(), "new": self.new.as_dict(),
                "lines": self.lines[:20]}


@dataclass(slots=True)
class DiffResult:
    source: str
    replayed: int = 0
    unchanged: int = 0
    changes: list[Change] = field(default_factory=list)
    unreplayable: list[Unreplayable] = field(default_factory=list)
    other_events: Counter[str] = field(default_factory=Counter)

    @property
    def changed(self) -> int:
        return sum(c.count for c in self.changes)

    def kind_counts(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for c in self.changes:
            for k in c.kinds:
                out[k] += c.count
        return dict(sorted(out.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "audit": self.source, "replayed": self.replayed, "changed": self.changed,
            "unchanged": self.unchanged, "distinct_changes": len(self.changes),
            "kinds": self.kind_counts(),
            "changes": [c.as_dict() for c in self.changes],
            "not_replayable": len(self.unreplayable),
            "not_replayable_events": [{"line": u.line, "event": u.event, "reason": u.reason}
                                      for u in self.unreplayable],
            "other_events": dict(sorted(self.other_events.items())),
        }


_NO_OVERRIDES: Mapping[str, str] = {}


def diff(old: Policy, new: Policy, traffic: AuditTraffic,
         resolve: Mapping[str, str] = _NO_OVERRIDES) -> DiffResult:
    """Replay every recorded request against both policies; group the ones that change."""
    res = DiffResult(traffic.source, unreplayable=list(traffic.unreplayable),
                     other_events=Counter(traffic.other_events))
    groups: dict[tuple[str, str, Outcome, Outcome], Change] = {}
    for rec in traffic.recorded:
        try:
            a = outcome(old, rec, resolve)
            b = outcome(new, rec, resolve)
        except ValueError as e:  # defensive: read_audit parsed it already
            res.unreplayable.append(Unreplayable(rec.line, rec.event, f"cannot be judged: {e}"))
            continue
        res.replayed += 1
        kinds = change_kinds(a, b)
        if not kinds:
            res.unchanged += 1
            continue
        key = (rec.identity, rec.request_line, a, b)
        ch = groups.get(key)
        if ch is None:
            ch = groups[key] = Change(rec.identity, rec.request_line, a, b, kinds)
        ch.count += 1
        ch.lines.append(rec.line)
    res.unreplayable.sort(key=lambda u: u.line)
    res.changes = sorted(groups.values(), key=lambda c: (c.kinds, c.identity, c.request, c.old,
                                                         c.new))
    return res


def format_diff(res: DiffResult, old_name: str, new_name: str) -> str:
    """The text report of `sandgate diff`."""
    out: list[str] = []
    for c in res.changes:
        out.append(f"{' + '.join(c.kinds)}  x{c.count}  {c.identity}  {c.request}")
        out.append(f"    old: {c.old}")
        out.append(f"    new: {c.new}")
        shown = ", ".join(str(n) for n in c.lines[:5])
        more = f" (+{len(c.lines) - 5} more)" if len(c.lines) > 5 else ""
        out.append(f"    audit lines: {shown}{more}")
    for u in res.unreplayable:
        out.append(f"not replayable: {res.source}:{u.line}: {u.event or 'line'}: {u.reason}")
    kinds = ", ".join(f"{k}: {n}" for k, n in res.kind_counts().items())
    other = sum(res.other_events.values())
    out.append(
        f"{res.replayed} recorded request(s) replayed against {old_name} and {new_name}: "
        f"{res.changed} changed ({len(res.changes)} distinct{'; ' + kinds if kinds else ''}), "
        f"{res.unchanged} unchanged; {len(res.unreplayable)} not replayable; "
        f"{other} other event(s) not requests"
        + (f" ({', '.join(f'{k}: {n}' for k, n in sorted(res.other_events.items()))})"
           if other else ""))
    return "\n".join(out)


def recorded_by_identity(recorded: Sequence[Recorded]) -> dict[str, list[Recorded]]:
    out: dict[str, list[Recorded]] = {}
    for r in recorded:
        out.setdefault(r.identity, []).append(r)
    return out
