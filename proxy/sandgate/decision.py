"""The decision: a pure function of (identity, request, policy).

The proxy, `sandgate check`, `sandgate explain` and later tools all call these and nothing else
to judge a request, so they can never disagree. A decision has one of three outcomes: allow
(inspected and forwarded), deny (refused), or tunnel (a `passthrough` rule forwards the bytes
without interception: nothing inside is judged, injected or scrubbed). A tunnel is never shown
as a deny: it is the widest reach a rule can grant.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sandgate.errors import AddressRefused, Code, Refused, SandboxRequired
from sandgate.llm.llmcall import LlmCall
from sandgate.netguard import choose_address, classify, known_addresses, parse_ip_literal
from sandgate.policy.hosts import normalise_host
from sandgate.policy.model import (
    MCP_HOUSEKEEPING,
    CallFilter,
    Identity,
    LlmRule,
    Policy,
    Rule,
    glob_matches,
)
from sandgate.policy.paths import normalise_path
from sandgate.request import RequestInfo, default_port, has_dot_segment, parse_url, split_authority
from sandgate.rpc.jsonrpc import Call, Message
from sandgate.secrets.aws_request import AwsParts, misfit
from sandgate.secrets.aws_request import parse as aws_parts
from sandgate.secrets.scope import resolve as resolve_secret_path

Outcome = Literal["allow", "deny", "tunnel", "ask"]


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    code: Code | None  # None when allowed; otherwise why not
    reason: str  # one human sentence, always set
    rule: Rule | None = None  # the rule that allowed, or the deny rule that refused
    hint: str | None = None  # how to fix the policy, for refusals: safe to show the sandbox
    # For operators only (explain, audit): where rules are defined, other identities' names.
    # Never part of a refusal body: a sandbox learns nothing about the policy's layout.
    detail: str | None = None
    # allowed, and passed through uninspected by `rule` (a passthrough rule): the third outcome
    tunnel: bool = False
    # Allowed at the HTTP level, and a rule that matched carries `mcp:`/`jsonrpc:`: the body's
    # calls must be judged (decide again with `call=`) before it goes on; this many bytes of
    # body at most. None: no call to judge (or it was judged).
    call_limit: int | None = None
    # allowed by an `action: ask` rule (`rule`): the proxy holds the request until approved
    # (sandgate.approvals), the fourth outcome
    ask: bool = False
    # an LLM call (decided with `llm=`) on a rule with `llm: {on_max_tokens: lower}` asking for
    # more output than its cap, or none: the proxy forwards it with this cap
    lower_max_tokens: int | None = None

    @property
    def outcome(self) -> Outcome:
        if self.tunnel:
            return "tunnel"
        return ("ask" if self.ask else "allow") if self.allowed else "deny"

    @property
    def rule_name(self) -> str | None:
        return self.rule.name if self.rule else None

    def refused(self) -> Refused:
        """This refusal as the error the proxy raises (the addon answers it in one place)."""
        assert self.code is not None, "an allowing decision refuses nothing"
        return Refused(self.code, self.reason, self.hint)


# Refusals an identity in `mode: report` only reports: what the rules say, nothing else.
REPORTABLE = frozenset({Code.NO_RULE, Code.DENIED_BY_RULE})


def reported(policy: Policy, identity: str, d: Decision) -> bool:
    """True when this refusal is only reported (the identity is in report mode and the rules,
    not an identity, address or safety check, refused): the request goes out uninjected."""
    if d.allowed or d.code not in REPORTABLE:
        return False
    ident = policy.identities.get(identity)
    return ident is not None and ident.mode == "report"


def _unknown_identity(policy: Policy, identity: str) -> Decision:
    known = ", ".join(sorted(policy.identities)) or "(none)"
    return Decision(
        False, Code.UNKNOWN_IDENTITY,
        f"identity '{identity}' is not defined in the policy",
        hint=f"the operator must add identities.{identity} to the policy, or issue the token for "
        "an identity that exists",
        detail=f"known identities: {known}",
    )


def _host(raw: str) -> str | None:
    try:
        return normalise_host(raw)
    except ValueError:
        return None


Query = tuple[tuple[str, str], ...] | None


def _l7_matches(rule: Rule, scheme: str, host: str, port: int, method: str, path: str,
                query: Query) -> bool:
    return (
        not rule.passthrough
        and scheme in rule.schemes
        and port in rule.ports
        and (rule.methods is None or method in rule.methods)
        and rule.matches_host(host)
        and (rule.paths is None or any(p.matches(path) for p in rule.paths))
        and rule.matches_query(query)
    )


def decide(policy: Policy, identity: str, req: RequestInfo, call: Call | None = None,
           aws: AwsParts | None = None, llm: LlmCall | None = None) -> Decision:
    """Judge a request; with `call`, also the JSON-RPC messages of its body (sandgate.rpc.jsonrpc)
    against the `mcp:`/`jsonrpc:` of the rules that match it: an allow rule with such a filter
    matches only when it allows every message, and a deny entry (deny_tools, deny_methods) of
    any matching rule refuses the whole call (a batch included). A protocol upgrade
    (`req.upgrade`) is refused by any matching rule with such a filter unless the rule says
    `websocket: true` and the upgrade is to WebSocket (upgrade_refused), like a deny entry:
    whichever rule would have allowed it. With `aws`, also what a SigV4
    signature would vouch for (sandgate.secrets.aws_request): a signing rule matches only when
    it judges all of it (its `operations:`, its `copy_sources:`, no header it does not judge).
    `aws` None: not read yet (the proxy's head stage; the proxy decides again with it before
    anything is signed). With `llm`, also the LLM call the body makes (sandgate.llm.llmcall): a
    rule with `llm:` matches only when its `models` list the call's model and its output cap
    is within `max_tokens` (or the rule lowers it: Decision.lower_max_tokens); `llm` None:
    not read yet (the proxy decides again with it once the body is read)."""
    ident = policy.identities.get(identity)
    if ident is None:
        return _unknown_identity(policy, identity)
    host = _host(req.host)
    if host is None:
        return Decision(False, Code.BAD_REQUEST, f"the host {req.host[:100]!r} is not valid")
    try:
        path = normalise_path(req.path)
    except ValueError as e:
        return Decision(False, Code.BAD_REQUEST, f"the request path cannot be judged: {e}")
    if has_dot_segment(req.path):  # judged resolved, it would go on unresolved
        return Decision(False, Code.BAD_REQUEST,
                        f"the path {req.path[:120]!r} has a '.' or '..' segment (perhaps "
                        "percent-encoded): Sandgate judges the resolved path "
                        f"({path[:120]}) and the upstream may not resolve it",
                        hint="send the resolved path")
    scheme = req.scheme.lower()
    method = req.method.upper()
    target = f"{method} {scheme}://{host}:{req.port}{path}"

    allow: Rule | None = None
    ask: Rule | None = None  # the first matching ask rule: it wins over every allow rule
    limits: list[int] = []
    missed: tuple[Rule, Message, str] | None = None  # the first rule a call did not fit
    unsigned: tuple[Rule, str, str] | None = None  # the first signing rule that would not sign
    llm_unfit: tuple[Rule, Code, str, str] | None = None  # the first `llm:` rule it misfits
    for rule in ident.rules:
        if not _l7_matches(rule, scheme, host, req.port, method, path, req.query):
            continue
        if rule.action == "deny":
            return Decision(
                False, Code.DENIED_BY_RULE,
                f"deny rule '{rule.name}' of identity '{identity}' matches {target}",
                rule=rule,
                hint=f"deny rules win over allow rules; narrow or remove rule '{rule.name}' "
                "if this request should pass",
                detail=f"rule '{rule.name}' is defined at {rule.source}",
            )
        if req.upgrade is not None and refuses_upgrade(rule, req.upgrade):
            return _upgrade_refused(identity, rule, req.upgrade, target)
        if aws is not None and rule.inject is not None and rule.inject.sign is not None:
            unfit = misfit(rule, aws)
            if unfit is not None:
                unsigned = unsigned or (rule, *unfit)
                continue
        if rule.call is not None:
            if call is None:
                limits.append(rule.call.max_body)
            else:
                fit = _call_fits(rule.call, call)
                if fit is not None:
                    verdict, msg, why = fit
                    if verdict == "deny":
                        return _call_denied(identity, rule, msg, why)
                    # the refusal names the rule that came closest to allowing the call (the
                    # one listing the tool, whose `arguments` it failed), not the first
                    if missed is None or _closeness(why) > _closeness(missed[2]):
                        missed = (rule, msg, why)
                    continue
        if llm is not None and rule.llm is not None:
            misfit_llm = llm_misfit(rule.llm, llm)
            if misfit_llm is not None:
                llm_unfit = llm_unfit or (rule, *misfit_llm)
                continue
        if rule.ask is not None and not _housekeeping(rule, method, call):
            ask = ask or rule
        elif allow is None:
            allow = rule
    if ask is not None:
        return Decision(True, None, f"held for approval by ask rule '{ask.name}' of identity "
                        f"'{identity}' ({ask.source}): forwarded only once approved",
                        rule=ask, call_limit=min(limits) if limits else None, ask=True)
    if allow is not None:
        kept = (": MCP housekeeping is not held by ask rules (set `ask_housekeeping: true` "
                "in its mcp: to hold it)" if allow.ask is not None else "")
        return Decision(True, None, f"allowed by rule '{allow.name}' of identity '{identity}' "
                        f"({allow.source}){kept}", rule=allow,
                        call_limit=min(limits) if limits else None,
                        lower_max_tokens=_lowered(allow, llm))
    if llm_unfit is not None:
        rule, code, why, fix = llm_unfit
        return Decision(False, code, f"{why} for {identity} (rule '{rule.name}')", rule=rule,
                        hint=fix, detail=f"rule '{rule.name}' is defined at {rule.source}")
    if unsigned is not None:
        rule, why, fix = unsigned
        return Decision(
            False, Code.NO_RULE, f"{target} is not signed for {identity}: rule '{rule.name}' "
            f"{why}", hint=fix, detail=f"rule '{rule.name}' is defined at {rule.source}")
    if missed is not None:
        rule, msg, why = missed
        return Decision(
            False, Code.NO_RULE,
            f"{msg.shown} is not permitted for {identity}: {why} in rule '{rule.name}'",
            rule=None,
            hint=f"rule '{rule.name}' allows this server; to allow {msg.shown}, add it to "
            f"the rule's `{rule.call.protocol if rule.call else 'mcp'}:` "
            f"({'arguments' if _closeness(why) == 2 else _call_key(msg)})",
            detail=f"rule '{rule.name}' is defined at {rule.source}",
        )
    return Decision(
        False, Code.NO_RULE,
        f"identity '{identity}' has no rule allowing {target}",
        hint=_no_rule_hint(ident, scheme, host, req.port, method, path, req.query),
    )


def llm_misfit(f: LlmRule, c: LlmCall) -> tuple[Code, str, str] | None:
    """None when the rule's `llm:` lets the call through (perhaps with its cap lowered);
    otherwise (code, why, how to fix)."""
    if f.models is not None:
        if c.model is None:
            return (Code.MODEL_NOT_ALLOWED, "the call names no model",
                    "name the model in the request (the rule allows "
                    f"{', '.join(f.models)})")
        if not any(glob_matches(p, c.model) for p in f.models):
            return (Code.MODEL_NOT_ALLOWED, f"model {c.model[:100]!r} is not allowed",
                    f"use one of the allowed models ({', '.join(f.models)}), or add it to the "
                    "rule's llm.models")
    if f.max_tokens is not None and f.on_max_tokens == "refuse":
        if c.max_tokens is None:
            return (Code.MAX_TOKENS_OVER_CAP, "the call sets no output cap (max_tokens) and "
                    f"the rule caps it at {f.max_tokens}",
                    f"set max_tokens (at most {f.max_tokens}) in the request")
        if c.max_tokens > f.max_tokens:
            return (Code.MAX_TOKENS_OVER_CAP, f"max_tokens {c.max_tokens} is over the cap of "
                    f"{f.max_tokens}", f"ask for at most {f.max_tokens} output tokens")
    return None


def _lowered(rule: Rule, c: LlmCall | None) -> int | None:
    f = rule.llm
    if c is None or f is None or f.max_tokens is None or f.on_max_tokens != "lower":
        return None
    return f.max_tokens if c.max_tokens is None or c.max_tokens > f.max_tokens else None


def refuses_upgrade(rule: Rule, upgrade: str) -> bool:
    """A rule that judges the calls of its requests (`mcp:`, `jsonrpc:`, `llm:`) refuses a
    protocol upgrade unless it says `websocket: true` and the upgrade is to WebSocket: the
    stream would carry calls it never judged."""
    judges = [f.websocket for f in (rule.call, rule.llm) if f is not None]
    return bool(judges) and not (all(judges) and upgrade == "websocket")


def _upgrade_refused(identity: str, rule: Rule, upgrade: str, target: str) -> Decision:
    """A protocol upgrade on a rule that judges calls: its stream would carry calls no rule
    judged, so it is refused unless the rule opts in (`websocket: true`, WebSocket only)."""
    key = rule.call.protocol if rule.call is not None else "llm"
    if upgrade == "websocket":
        hint = (f"add `websocket: true` to rule '{rule.name}' if a WebSocket is meant (each of "
                "its messages is then judged as a request body is), or send the calls as POST "
                "requests")
    else:
        hint = ("only WebSocket can be judged message by message (with `websocket: true` on "
                "the rule); send the calls as POST requests")
    what = "a WebSocket" if upgrade == "websocket" else f"a switch to {upgrade[:40]!r}"
    return Decision(
        False, Code.UPGRADE_REFUSED,
        f"rule '{rule.name}' of identity '{identity}' judges the {key} calls on {target}; "
        f"{what} would carry calls it never judges",
        rule=rule, hint=hint, detail=f"rule '{rule.name}' is defined at {rule.source}")


def _closeness(why: str) -> int:
    """How close a rule came to allowing a message (message_verdict's "no" reasons): it lists
    the tool but an argument fails (2), it allows the method but not the name (1), or not even
    the method (0)."""
    return 2 if why.startswith("argument") else 0 if why.startswith("`methods`") else 1


def _housekeeping(rule: Rule, method: str, call: Call | None) -> bool:
    """Is this request MCP housekeeping that an ask rule does not hold (MCP_HOUSEKEEPING)?
    Then the ask rule allows it as an allow rule would (credentials included): otherwise every
    MCP session would wait for approvers before its first call. Without a body: the GET of
    the event stream and the DELETE ending the session (a body, if any, is judged again with
    its call); with a call: when every message is housekeeping or an answer to the server."""
    f = rule.call
    if rule.ask is None or f is None or f.protocol != "mcp" or f.ask_housekeeping:
        return False
    if call is None or not call.messages:
        return method in ("GET", "DELETE")
    return all(m.kind == "response" or m.method is None
               or any(glob_matches(p, m.method) for p in MCP_HOUSEKEEPING)
               for m in call.messages)


def _call_key(msg: Message) -> str:
    if msg.method == "tools/call":
        return "tools"
    if msg.method == "prompts/get":
        return "prompts"
    if msg.method == "resources/read":
        return "resources"
    return "methods"


def _call_denied(identity: str, rule: Rule, msg: Message, why: str) -> Decision:
    return Decision(
        False, Code.DENIED_BY_RULE,
        f"{msg.shown} is not permitted for {identity}: {why} in rule '{rule.name}'",
        rule=rule,
        hint=f"deny entries win; remove it from rule '{rule.name}' if this call should pass",
        detail=f"rule '{rule.name}' is defined at {rule.source}",
    )


def _call_fits(f: CallFilter, call: Call) -> tuple[str, Message, str] | None:
    """None when the filter allows every message of the call; otherwise ("deny" for a deny
    entry, "no" for a message it does not allow, the message, why). Deny entries are looked for
    in every message first: one anywhere in a batch refuses it."""
    missed: tuple[str, Message, str] | None = None
    for m in call.messages:
        verdict = message_verdict(f, m)
        if verdict is None:
            continue
        if verdict[0] == "deny":
            return verdict[0], m, verdict[1]
        missed = missed or (verdict[0], m, verdict[1])
    return missed


def message_verdict(f: CallFilter, m: Message) -> tuple[str, str] | None:
    """One message under one rule's filter: None (allowed), or ("deny"|"no", why)."""
    if m.kind == "response" or m.method is None:
        return None  # answers a server's request (sampling, roots, elicitation): not a call
    method = m.method
    for pat in f.deny_methods:
        if glob_matches(pat, method):
            return "deny", f"deny_methods lists {pat!r}"
    if method == "tools/call" and m.name is not None:
        for pat in f.deny_tools:
            if glob_matches(pat, m.name):
                return "deny", f"deny_tools lists {pat!r}"
    allowed = f.allowed_methods
    if allowed is not None and not any(glob_matches(p, method) for p in allowed):
        return "no", "`methods` does not list it"
    named = {"tools/call": f.tools, "prompts/get": f.prompts,
             "resources/read": f.resources}.get(method)
    if named is not None and m.name is not None and not any(
            glob_matches(p, m.name) for p in named):
        return "no", f"`{_call_key(m)}` does not list it"
    if method == "tools/call" and m.arguments is not None:
        for name, pat in f.arguments:
            value = m.arguments.get(name)
            if not isinstance(value, str) or not glob_matches(pat, value):
                got = "is missing" if value is None else (
                    "is not a string" if not isinstance(value, str) else "has another value")
                return "no", f"argument {name} {got} (`arguments` wants {pat!r})"
    return None


def decide_connect(policy: Policy, identity: str, host: str, port: int) -> Decision:
    """Judge a CONNECT to host:port, before any request inside the tunnel is visible."""
    ident = policy.identities.get(identity)
    if ident is None:
        return _unknown_identity(policy, identity)
    h = _host(host)
    if h is None:
        return Decision(False, Code.BAD_REQUEST, f"the CONNECT host {host[:100]!r} is not valid")
    target = f"CONNECT {h}:{port}"
    reach = [r for r in ident.rules if "https" in r.schemes and port in r.ports
             and r.matches_host(h)]
    l7_denies: list[Rule] = []
    for r in reach:
        if r.action != "deny":
            continue
        if r.methods is None and r.paths is None and not r.query_constrained:
            return Decision(
                False, Code.DENIED_BY_RULE,
                f"deny rule '{r.name}' of identity '{identity}' matches {target}", rule=r,
                hint=f"deny rules win over allow rules; narrow or remove rule '{r.name}' "
                "if this host should be reachable",
                detail=f"rule '{r.name}' is defined at {r.source}",
            )
        l7_denies.append(r)
    allows = [r for r in reach if r.action == "allow"]
    passthrough = [r for r in allows if r.passthrough]
    intercepted = [r for r in allows if not r.passthrough]
    if passthrough and not l7_denies:
        r = passthrough[0]
        return Decision(True, None, f"tunnelled uninspected by passthrough rule '{r.name}' of "
                        f"identity '{identity}' ({r.source}): nothing inside is judged",
                        rule=r, tunnel=True)
    if intercepted:
        r = intercepted[0]
        return Decision(True, None, f"tunnel allowed by rule '{r.name}' of identity "
                        f"'{identity}' ({r.source}); each request inside is judged again",
                        rule=r)
    if passthrough:
        # Only passthrough allows it, but a deny rule needs to see requests on this host.
        d = l7_denies[0]
        return Decision(
            False, Code.DENIED_BY_RULE,
            f"passthrough rule '{passthrough[0].name}' cannot be used for {target}: deny rule "
            f"'{d.name}' must inspect requests to this host", rule=d,
            hint=f"drop passthrough from rule '{passthrough[0].name}' so the deny rule can apply",
            detail=f"rule '{passthrough[0].name}' is defined at {passthrough[0].source}",
        )
    return Decision(
        False, Code.NO_RULE,
        f"identity '{identity}' has no rule allowing {target}",
        hint=_no_rule_hint(ident, "https", h, port, None, None, ()),
    )


def _names(values: Iterable[object]) -> str:
    items = sorted(values, key=lambda v: (0, v, "") if isinstance(v, int) else (1, 0, str(v)))
    return ", ".join(str(v) for v in items)


def _no_rule_hint(ident: Identity, scheme: str, host: str, port: int, method: str | None,
                  path: str | None, query: Query) -> str:
    """What the identity's rules for this host do allow, and a rule that would allow this."""
    notes: list[str] = []
    for r in ident.rules:
        if r.action != "allow" or not r.matches_host(host):
            continue
        if r.passthrough and method is not None:
            notes.append(f"rule '{r.name}' tunnels this host without interception "
                         "(passthrough), so it never matches an inspected request")
            continue
        limits: list[str] = []
        if scheme not in r.schemes:
            limits.append(f"schemes {_names(r.schemes)}")
        if port not in r.ports:
            limits.append(f"ports {_names(r.ports)}")
        if method is not None and r.methods is not None and method not in r.methods:
            limits.append(f"methods {_names(r.methods)}")
        if path is not None and r.paths is not None and not any(
                p.matches(path) for p in r.paths):
            limits.append(f"paths {', '.join(p.text for p in r.paths)}")
        if method is not None and not r.matches_query(query):
            limits.append(_query_limit(r, query))
        if limits:
            notes.append(f"rule '{r.name}' allows this host for {'; '.join(limits)}")
    parts = [f"hosts: [{_yaml_host(host)}]"]
    if scheme != "https":
        parts.append(f"schemes: [{scheme}]")
    if port != default_port(scheme):
        parts.append(f"ports: [{port}]")
    if method is not None:
        parts.append(f"methods: [{method}]")
    if path is not None:
        parts.append(f"paths: [{_yaml_path(path)}]")
    name = "allow-" + re.sub(r"[^a-z0-9]+", "-", host).strip("-")
    snippet = f"- {{name: {name}, {', '.join(parts)}}}"
    prefix = ("; ".join(notes) + ". ") if notes else "no rule of this identity names this host. "
    return f"{prefix}To allow it, add under identities.{ident.name}.rules: {snippet}"


def _query_limit(r: Rule, query: Query) -> str:
    """Which `query:` constraint of the rule the request misses, and why."""
    for name in sorted(r.query_absent):
        if query is not None and any(n.casefold() == name.casefold() for n, _ in query):
            return f"query {name} absent (the request gives {name})"
    for name, allowed in (*r.query, *r.query_optional):
        if query is not None and (name, allowed) in r.query_optional and not any(
                n.casefold() == name.casefold() for n, _ in query):
            continue
        values = sorted({v for n, v in query or () if n == name})
        want = f"query {name}={'|'.join(sorted(allowed))}"
        if query is None:
            return (f"{want} (this query cannot be read unambiguously: a ';', '#', '+' or a "
                    "malformed %-escape)")
        if any(n != name and n.casefold() == name.casefold() for n, _ in query):
            return f"{want} (the request also spells {name} with other letter case)"
        if not values:
            return f"{want} (the request has no {name})"
        if len(values) > 1:
            return f"{want} (the request gives {name} more than once, with different values)"
        if values[0] not in allowed:
            return f"{want}"
    if query is None:
        return "query (this query cannot be read unambiguously: a ';', '#', '+' or a malformed " \
            "%-escape)"
    return "query"


def _yaml_host(host: str) -> str:
    return f"'{host}'" if ":" in host else host


def _yaml_path(path: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9/_.\-~]*", path):
        return path
    return "'" + path.replace("'", "''") + "'"


# --- the address step, and one judgement for tools -------------------------------------------

ADDRESS_UNCHECKED = "address not checked: resolved at request time"


def judge_address(d: Decision, host: str, port: int, overrides: Mapping[str, str],
                  report: bool = False) -> tuple[Decision, str]:
    """The proxy's address step for an allowing decision, when the address is known without DNS
    (an IP literal, or a name pinned with --resolve): the same netguard.choose_address over the
    allowing rule's private_cidrs that the proxy runs before it dials. `report`: a refusal that
    is only reported (report mode), which the proxy forwards after the same step without any
    private_cidrs.

    Returns the decision after that step (a refusal with the address code when the address may
    not be dialled) and one line saying what happened to the address. The proxy's own listening
    address (self_address) is not known here and not checked.
    """
    if (not d.allowed or d.rule is None) and not report:
        return d, "not dialled: refused before the address step"
    ips = known_addresses(host, overrides)
    if ips is None:
        return d, ADDRESS_UNCHECKED
    cidrs = d.rule.private_cidrs if d.allowed and d.rule is not None else ()
    try:
        target = choose_address(host, port, ips, cidrs,
                                only_public=d.allowed and d.rule is not None and d.rule.public)
    except AddressRefused as e:
        why = (f"rule '{d.rule.name}' ({d.rule.source}) allows the request"
               if d.allowed and d.rule is not None else
               "the rules refuse it and the identity is in report mode, so it would be "
               "forwarded without credentials (and without any private_cidrs)")
        return Decision(False, e.code, e.reason, rule=d.rule, hint=e.hint,
                        detail=f"{why}; the address step refuses it"), f"refused: {e.reason}"
    kind = classify(target.ip)
    return d, f"dials {target.ip} ({'public' if kind is None else kind + ', in private_cidrs'})"


def require_sandbox(policy: Policy, rule: Rule, identity: str, sandbox: str | None) -> None:
    """The proxy's sandbox step for an allowing rule, before any secret is read: raises
    SandboxRequired when a secret the rule binds is per sandbox (a `{{ sandbox }}` path, a
    dynamic secret) and the caller has no sandbox id that can be put into its path."""
    for name in sorted(rule.secrets):
        resolve_secret_path(policy.secrets[name], identity, sandbox)


def judge_sandbox(policy: Policy, identity: str, d: Decision, sandbox: str | None) -> Decision:
    """`require_sandbox` as a decision: the refusal the proxy answers (403 sandbox_required)."""
    if not d.allowed or d.tunnel or d.rule is None:
        return d
    try:
        require_sandbox(policy, d.rule, identity, sandbox)
    except SandboxRequired as e:
        return Decision(False, e.code, e.reason, rule=d.rule, hint=e.hint,
                        detail=f"rule '{d.rule.name}' ({d.rule.source}) allows the request; "
                        "the sandbox step refuses it")
    return d


def decide_request(policy: Policy, identity: str, req: RequestInfo,
                   gateway: bool = False, call: Call | None = None,
                   aws: AwsParts | None = None, llm: LlmCall | None = None) -> Decision:
    """What the proxy does with a request as a client sends it, in the order the proxy meets it.

    An https request through the proxy comes inside a CONNECT tunnel: the tunnel is judged
    first (`decide_connect`, the function the proxy calls at CONNECT). A passthrough tunnel
    forwards the request unseen (outcome tunnel); a refused tunnel answers every request inside
    with its refusal (unless only reported); otherwise the request itself is judged
    (`decide`, the function the proxy calls per request). Plain http and gateway requests
    have no tunnel: they are judged by `decide` alone. `call`: the JSON-RPC call the body
    carries (`decide` judges it against the matching rules' mcp:/jsonrpc:)."""
    if req.scheme.lower() == "https" and not gateway:
        c = decide_connect(policy, identity, req.host, req.port)
        if c.tunnel:
            assert c.rule is not None
            return dataclasses.replace(
                c, reason=f"{req.method.upper()} https://{req.host}:{req.port}/... is "
                f"tunnelled uninspected by passthrough rule '{c.rule.name}' of identity "
                f"'{identity}' ({c.rule.source}): the proxy never sees the request, so no rule "
                "judges its method, path or query, nothing is injected and nothing scrubbed",
                hint=f"drop passthrough from rule '{c.rule.name}' so that requests to this "
                "host are inspected")
        if not c.allowed and not reported(policy, identity, c):
            return c
    return decide(policy, identity, req, call, aws, llm)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the proxy does with one request or tunnel, as `check` and `explain` show it."""

    request: str  # "GET https://host:443/path" or "CONNECT host:port"
    decision: Decision  # after the sandbox and address steps
    address: str  # what happened to the address (see judge_address)
    connect: bool

    @property
    def passthrough(self) -> bool:
        return self.decision.tunnel

    @property
    def secrets(self) -> frozenset[str]:
        """The secrets injected or substituted: the allowing rule's (none for a tunnel)."""
        d = self.decision
        if not d.allowed or d.rule is None or self.connect or d.tunnel:
            return frozenset()
        return d.rule.secrets


def judge(policy: Policy, identity: str, method: str, target: str,
          overrides: Mapping[str, str], sandbox: str | None = None,
          gateway: bool = False, call: Call | None = None,
          upgrade: str | None = None,
          headers: Sequence[tuple[str, str]] = (),
          llm: LlmCall | None = None) -> Verdict:
    """`METHOD URL` (or `CONNECT host:port`) through the proxy's request parser, decision
    (`decide_request`: the tunnel first), sandbox step and, where the address is known, its
    address step. Raises ValueError for a bad request. `sandbox` is the caller's sandbox id
    (None: a caller without one, refused on a rule needing a per-sandbox secret); `gateway`:
    the URL is the upstream request a gateway path maps to (no CONNECT precedes it); `call`:
    the JSON-RPC call its body carries (judged by the rules' mcp:/jsonrpc: as the proxy judges
    the body; a tunnelled request's body is never seen); `upgrade`: the protocol the request
    asks to switch to ("websocket"; with `call`, a message on that WebSocket); `headers`: the
    request's headers, of which a signing rule judges those a SigV4 signature covers (no body:
    an Action is given in the query); `llm`: the LLM call its body makes (judged by the
    rules' `llm:` as the proxy judges the body).

    A passthrough tunnel is dialled at CONNECT; an intercepted one dials per request inside it,
    so a CONNECT verdict checks the address only for passthrough.
    """
    if method.strip().upper() == "CONNECT":
        host, port = split_authority(target, "https")
        d = decide_connect(policy, identity, host, port)
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if d.allowed and not d.tunnel:
            note = "not dialled at CONNECT: each request inside is judged and dialled again"
        else:
            d, note = judge_address(d, host, port, overrides)
        return Verdict(f"CONNECT {shown}", d, note, True)
    req = dataclasses.replace(parse_url(method, target), upgrade=upgrade)
    d = decide_request(policy, identity, req, gateway, call,
                       aws_parts(headers, req.query, path=req.path), llm)
    d = judge_sandbox(policy, identity, d, sandbox)
    d, note = judge_address(d, req.host, req.port, overrides, reported(policy, identity, d))
    query = target.partition("#")[0].partition("?")[2]  # shown as given (parsed by parse_url)
    return Verdict(f"{req.method} {req.target}{'?' + query if query else ''}", d, note, False)


def shown_outcome(policy: Policy, identity: str, d: Decision) -> str:
    """The outcome as explain, fixtures and diff show it: allow, deny, tunnel, or report (the
    rules refused and the identity is in report mode: forwarded without credentials)."""
    return "report" if reported(policy, identity, d) else d.outcome


# --- names: the policy DNS (sandgate.dns) ----------------------------------------------------

# The query types every name a rule could reach answers; any other needs the rule's `dns: types`.
ADDRESS_TYPES = frozenset({"A", "AAAA"})


def _blocked_pairs(ident: Identity, host: str) -> tuple[set[tuple[str, int]], set[int]]:
    """(scheme, port) pairs a deny rule refuses on `host` whatever the request (no methods,
    paths or query: decide_connect and decide refuse it outright), and the https ports on
    which some deny rule must inspect requests (so a passthrough tunnel is refused there)."""
    whole: set[tuple[str, int]] = set()
    inspected: set[int] = set()
    for r in ident.rules:
        if r.action != "deny" or not r.matches_host(host):
            continue
        if r.methods is None and r.paths is None and not r.query_constrained:
            whole |= {(s, p) for s in r.schemes for p in r.ports}
        elif "https" in r.schemes:
            inspected |= set(r.ports)
    return whole, inspected


def _could_reach(rule: Rule, whole: set[tuple[str, int]], inspected: set[int]) -> bool:
    """Could some connection this allow rule matches be let through (by decide_connect and
    then decide)? Not when every (scheme, port) it allows is refused whole by a deny rule, or,
    for a passthrough rule, also needs inspecting."""
    for scheme in rule.schemes:
        for port in rule.ports:
            if (scheme, port) in whole:
                continue
            if rule.passthrough and port in inspected:
                continue
            return True
    return False


def decide_name(policy: Policy, identity: str, qname: str, qtype: str = "A") -> Decision:
    """Does the policy DNS answer `qname` (query type `qtype`) for `identity`?

    A name resolves iff some rule of the identity could reach it: an allow rule (intercepted or
    passthrough, `public: true` included) whose hosts match it, unless deny rules refuse every
    scheme and port that rule allows there (a deny rule with no methods, paths or query; for a
    passthrough rule, any deny rule on https that must inspect it). A and AAAA are answered for
    such a name; another query type only when the reaching rule lists it in `dns: types`.
    Everything else is refused (NXDOMAIN or REFUSED on the wire) and never asked upstream.
    `explain --dns`, fixtures with `dns:` and the DNS server all call this.
    """
    ident = policy.identities.get(identity)
    if ident is None:
        return _unknown_identity(policy, identity)
    qtype = qtype.upper()
    host = _host(qname)
    if host is None:
        return Decision(False, Code.BAD_REQUEST, f"the name {qname[:100]!r} is not a valid "
                        "host name")
    if parse_ip_literal(host) is not None:
        return Decision(False, Code.BAD_REQUEST, f"{host} is an address, not a name: nothing "
                        "to resolve")
    target = f"{qtype} {host}"
    whole, inspected = _blocked_pairs(ident, host)
    reaching = [r for r in ident.rules if r.action == "allow" and r.matches_host(host)]
    reachable = [r for r in reaching if _could_reach(r, whole, inspected)]
    for r in reachable:
        if qtype in ADDRESS_TYPES or qtype in r.dns_types:
            return Decision(True, None, f"{target} resolves: rule '{r.name}' of identity "
                            f"'{identity}' ({r.source}) could reach {host}", rule=r)
    if reachable:
        r = reachable[0]
        return Decision(
            False, Code.NO_RULE,
            f"{target} is refused: rule '{r.name}' of identity '{identity}' reaches {host}, "
            f"but only A and AAAA are answered for it",
            hint=f"add `dns: {{types: [{qtype}]}}` to rule '{r.name}' if {qtype} lookups of "
            "its hosts are needed (each answered type is a channel through DNS)",
            detail=f"rule '{r.name}' is defined at {r.source}")
    if reaching:
        r = reaching[0]
        deny = next((d for d in ident.rules if d.action == "deny" and d.matches_host(host)),
                     None)
        return Decision(
            False, Code.DENIED_BY_RULE,
            f"{target} is refused: deny rules of identity '{identity}' refuse every "
            f"connection rule '{r.name}' would allow to {host}", rule=deny,
            hint="deny rules win over allow rules; narrow the deny rule if this host should "
            "be reachable",
            detail=f"rule '{r.name}' is defined at {r.source}")
    return Decision(
        False, Code.NO_RULE,
        f"{target} is refused: no rule of identity '{identity}' could reach {host}",
        hint=f"a name resolves only when a rule allows its host: add under "
        f"identities.{identity}.rules: - {{name: allow-"
        f"{re.sub(r'[^a-z0-9]+', '-', host).strip('-')}, hosts: [{host}]}}")
