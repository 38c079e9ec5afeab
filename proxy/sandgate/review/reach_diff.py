"""`sandgate diff OLD_DIR NEW_DIR`: what each identity can reach that it could not (and the
reverse), computed from the compiled policies, without traffic.

For each identity the old and new rules are searched together with the proofs' machinery
(sandgate.review.reach): every (scheme, host class, port, method, query) cell, and in each cell
every pair (old deciding rule, new deciding rule) that occurs on some normalised path, with a
shortest such path as its example. A pair differs when one side allows and the other does not,
or both allow with different secrets, private ranges or body limit. Tunnels (passthrough) are
compared per host class and port with decide_connect. Identical changes over several methods are
merged into one entry. The search is exact: an empty diff means the reach is the same.

Reach is every grant, not only which requests pass: a pair of deciding rules also differs when
the approval gate changes (`ask` -> `allow`, fewer approvers, mode hold -> async) or the
credential (which secret, GitHub App repositories and permissions, OAuth scopes, the SigV4
service and region, where a secret is read): sandgate.review.grants says which of those widen,
in the words the diff prints. DNS query types beyond A/AAAA are compared per host class with
decide_name (the names that resolve at all follow the requests that pass).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sandgate.decision import decide_connect, decide_name
from sandgate.netguard import parse_ip_literal
from sandgate.policy.call_rules import describe_filter
from sandgate.policy.llmproofs import llm_widenings
from sandgate.policy.model import Budget, Identity, Policy, Rule, SecretRef
from sandgate.policy.overlap import signed_covers
from sandgate.review.callproofs import calls_gained, tools_gained
from sandgate.review.grants import Delta, credential_text, describe_gate, grant_deltas, grant_key
from sandgate.review.proofs import applies, cidrs_covered, glob_nfa, host_witnesses
from sandgate.review.reach import Witness, cells, decider, path_search

Kind = Literal["reachable", "unreachable", "changed", "passthrough", "mode", "dns"]
Secrets = Mapping[str, SecretRef]
Budgets = Mapping[str, Budget]


@dataclass(slots=True)
class ReachChange:
    identity: str
    kind: Kind
    host: str  # as a reviewer reads it: "api.github.com", "*.github.com", "any public host"
    scheme: str = "https"
    port: int = 443
    methods: list[str] = field(default_factory=list)
    example: str = ""  # one concrete request ("GET https://h:443/p?q=v") or "CONNECT h:443"
    old_rule: Rule | None = None
    new_rule: Rule | None = None
    widened: bool = False  # reach grew: new requests, new secrets, wider ranges, a tunnel
    note: str = ""
    query: str = ""  # the constrained query values this change is about ("service=x")
    # what the deciding rule grants with it (reachable/unreachable): ", injects gh
    # gh-app(repo=api, contents=read), held for 2 approvers, mode hold"
    grant: str = ""
    deltas: list[Delta] = field(default_factory=list)  # "changed": each dimension that changed

    def _rule(self, r: Rule | None) -> str:
        if r is None:
            return "refused"
        return f"rule '{r.name}' ({r.source})"

    @property
    def what(self) -> str:
        if self.kind == "dns":
            return f"DNS lookups of {self.host}"
        ms = ", ".join(self.methods)
        q = f" with query {self.query}" if self.query else ""
        return f"{ms} {self.scheme}://{self.host}:{self.port}{q}".strip()

    def summary(self) -> str:
        if self.kind == "mode":
            return self.note
        if self.kind == "dns":
            return f"{self.what} (e.g. {self.example}): {self.note}"
        if self.kind == "passthrough":
            return f"{self.example}: {self.note}"
        if self.kind == "reachable":
            return (f"{self.what} becomes reachable (e.g. {self.example}) by "
                    f"{self._rule(self.new_rule)}{_paths(self.new_rule)}{self.grant}"
                    f"{_calls(self.new_rule)}")
        if self.kind == "unreachable":
            return (f"{self.what} becomes unreachable (e.g. {self.example}); was "
                    f"{self._rule(self.old_rule)}{_paths(self.old_rule)}{self.grant}"
                    f"{_calls(self.old_rule)}")
        return f"{self.what} (e.g. {self.example}): {self.note}"

    def as_dict(self) -> dict[str, Any]:
        def rule(r: Rule | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {"name": r.name, "source": str(r.source), "secrets": sorted(r.secrets),
                    "paths": [p.text for p in r.paths] if r.paths is not None else None,
                    "private_cidrs": [str(n) for n in r.private_cidrs],
                    "passthrough": r.passthrough}
        return {"identity": self.identity, "kind": self.kind, "widened": self.widened,
                "scheme": self.scheme, "host": self.host, "port": self.port,
                "methods": self.methods, "query": self.query, "example": self.example,
                "note": self.note,
                "grants": [{"dimension": d.dimension, "change": d.words, "widened": d.widened}
                           for d in self.deltas],
                "old": rule(self.old_rule), "new": rule(self.new_rule)}


def _paths(r: Rule | None) -> str:
    if r is None or r.paths is None:
        return ", any path"
    return ", paths " + ", ".join(p.text for p in r.paths)


def _grant(secrets: Secrets, r: Rule | None, host: str) -> str:
    """What the rule grants a request to `host` besides passing it: its credentials with
    their scope, and its approval gate."""
    if r is None:
        return ""
    out = f", injects {credential_text(secrets, r, host)}" if r.secrets else ""
    return out + (f", {describe_gate(r.ask)}" if r.ask is not None else "")


def _terms(r: Rule) -> tuple[object, ...]:
    return (r.secrets, r.private_cidrs, r.max_request_bytes, r.call, r.operations,
            r.copy_sources, r.llm)


def _wider(o: Rule, n: Rule, ob: Budgets, nb: Budgets) -> bool:
    """Does the new deciding rule grant more than the old one on the same request?"""
    return (not n.secrets <= o.secrets or not cidrs_covered(n.private_cidrs, o.private_cidrs)
            or (o.max_request_bytes is not None and (n.max_request_bytes is None
                                                     or n.max_request_bytes > o.max_request_bytes))
            or calls_gained(o, n) != [] or not signed_covers(o, n)
            or llm_widenings(o, n, ob, nb) != [])


def _budget(budgets: Budgets, r: Rule) -> tuple[object, ...] | None:
    """The budget a rule's `llm:` counts against, as its policy defines it (where it is
    written left out: a budget moved in its file is the same budget)."""
    b = budgets.get(r.llm.budget) if r.llm is not None and r.llm.budget else None
    return None if b is None else (b.name, b.per, b.scope, b.input_tokens, b.output_tokens,
                                   b.cost_usd)


def _changed_note(o: Rule, n: Rule, deltas: Sequence[Delta], tools: Iterable[str] = (),
                 ob: Budgets | None = None, nb: Budgets | None = None) -> str:
    parts = [str(d) for d in deltas]
    if o.private_cidrs != n.private_cidrs:
        parts.append(f"private_cidrs {', '.join(map(str, o.private_cidrs)) or 'none'} -> "
                     f"{', '.join(map(str, n.private_cidrs)) or 'none'}")
    if o.max_request_bytes != n.max_request_bytes:
        parts.append(f"max_request_bytes {o.max_request_bytes} -> {n.max_request_bytes}")
    if o.call != n.call:
        parts.append(_calls_note(o, n, tools))
    ob, nb = ob or {}, nb or {}
    if o.llm != n.llm or _budget(ob, o) != _budget(nb, n):
        wider = llm_widenings(o, n, ob, nb)
        parts.append(f"llm {_llm_words(o)} -> {_llm_words(n)}"
                     + (f" (wider: {'; '.join(map(str, wider))})" if wider else ""))
    for key in ("operations", "copy_sources"):  # what a signing rule signs
        ov, nv = _signed(o, key), _signed(n, key)
        if ov != nv:
            parts.append(f"{key} {ov} -> {nv}")
    return (f"{'; '.join(parts)} (rule '{o.name}' ({o.source}) -> rule '{n.name}' "
            f"({n.source}))")


def _llm_words(r: Rule) -> str:
    f = r.llm
    if f is None:
        return "none"
    words = [f"models {', '.join(f.models)}" if f.models else "any model"]
    if f.max_tokens is not None:
        words.append(f"max_tokens {f.max_tokens} ({f.on_max_tokens})")
    if f.budget is not None:
        words.append(f"budget {f.budget}")
    if f.own_credentials == "replace":
        words.append("own credentials replaced")
    return "{" + "; ".join(words) + "}"


def _signed(r: Rule, key: str) -> str:
    """A signing rule's operations or copy sources as a change note shows them."""
    if r.inject is None or r.inject.sign is None:
        return "(signs nothing)"
    v = r.operations if key == "operations" else (
        None if r.copy_sources is None else tuple(p.text for p in r.copy_sources))
    return ", ".join(v) if v is not None else ("any" if key == "operations" else "none")


def _calls_note(o: Rule, n: Rule, tools: Iterable[str] = ()) -> str:
    """A change of the deciding rule's mcp:/jsonrpc:, in the words of the filter (a tool glob
    and the tools the policies name that it gains, a deny_tools entry removed), with the
    calls it now lets through or no longer does (judged by the two rules' filters: deny
    entries of the identity's other rules on the same request are not counted)."""
    gained, lost = calls_gained(o, n), calls_gained(n, o)
    words = _filter_words(o, n, tools)
    if gained is None or lost is None:
        return "; ".join([*words, "mcp:/jsonrpc: changed (too many globs to list the calls)"])
    parts = [f"{what} {_few(calls)}" for what, calls in
             (("now forwards", gained), ("no longer forwards", lost)) if calls]
    calls = "; ".join(parts) or "mcp:/jsonrpc: rewritten, the same calls pass"
    return "; ".join([*words, f"calls: {calls}"])


def _filter_words(o: Rule, n: Rule, tools: Iterable[str]) -> list[str]:
    """tools/deny_tools/methods/deny_methods of the two filters, entry by entry."""
    fo, fn = o.call, n.call
    if fo is None or fn is None:
        return [f"{'mcp:/jsonrpc: removed' if fn is None else 'mcp:/jsonrpc: added'}"]
    out: list[str] = []
    for key, a, b in (("tools", fo.tools, fn.tools), ("methods", fo.methods, fn.methods),
                      ("resources", fo.resources, fn.resources),
                      ("prompts", fo.prompts, fn.prompts)):
        if a == b:
            continue
        text = (f"{key} {'any' if a is None else '[' + ', '.join(a) + ']'} -> "
                f"{'any' if b is None else '[' + ', '.join(b) + ']'}")
        new = [g for g in b or () if g not in (a or ())]
        if key == "tools" and (b is None or any("*" in g or "?" in g for g in new)):
            members = tools_gained(o, n, tools)
            text += (" (a tool glob widened by its new members: "
                     f"{_few(members)}, and any other name it matches)" if members else
                     " (a tool glob: any name it matches)")
        out.append(text)
    for key, a2, b2 in (("deny_tools", fo.deny_tools, fn.deny_tools),
                        ("deny_methods", fo.deny_methods, fn.deny_methods)):
        if a2 != b2:
            out.append(f"{key} " + " ".join([*(f"+{g}" for g in b2 if g not in a2),
                                             *(f"-{g}" for g in a2 if g not in b2)]))
    if fo.arguments != fn.arguments:
        def args(f: tuple[tuple[str, str], ...]) -> str:
            return "{" + ", ".join(f"{k}: {v}" for k, v in f) + "}"
        out.append(f"arguments {args(fo.arguments)} -> {args(fn.arguments)}")
    return out


def _few(items: Sequence[str], at_most: int = 6) -> str:
    more = f" (and {len(items) - at_most} more)" if len(items) > at_most else ""
    return ", ".join(items[:at_most]) + more


def _calls(r: Rule | None) -> str:
    """The rule's call filter in a change summary."""
    return f", {describe_filter(r.call)}" if r is not None and r.call is not None else ""


def _host_label(host: str, rules: Sequence[Rule]) -> str:
    """The host pattern a witness host stands for."""
    pats = [p for r in rules for p in r.hosts]
    if any(not p.wildcard and p.suffix == host for p in pats):
        return host
    best = max((p for p in pats if p.wildcard and p.matches(host)), key=lambda p: len(p.suffix),
               default=None)
    if best is None:
        return host
    return "any public host" if best.suffix == "" else best.text


def identity_changes(old: Identity | None, new: Identity | None,
                     old_secrets: Secrets | None = None, new_secrets: Secrets | None = None,
                     tools: Iterable[str] = (), old_budgets: Budgets | None = None,
                     new_budgets: Budgets | None = None) -> list[ReachChange]:
    """Every change of reach of one identity between two versions of it (None: absent).
    `old_secrets`/`new_secrets`: the policies' secrets (a secret's scope is part of what a rule
    grants; None: compared by name only); `tools`: tool names the policies write out (a
    widened tool glob is shown by the ones it gains); `old_budgets`/`new_budgets`: the
    policies' `budgets:` (a budget's limits are part of what an `llm:` rule grants; None:
    compared by name only)."""
    ob: Budgets = old_budgets or {}
    nb: Budgets = new_budgets if new_budgets is not None else ob
    os_: Secrets = old_secrets if old_secrets is not None else {}
    ns: Secrets = new_secrets if new_secrets is not None else os_
    if old_secrets is None:
        os_ = ns
    name = (new or old).name if (new or old) is not None else "?"  # type: ignore[union-attr]
    ro = old.rules if old is not None else ()
    rn = new.rules if new is not None else ()
    out: list[ReachChange] = []
    om = old.mode if old is not None else "enforce"
    nm = new.mode if new is not None else "enforce"
    if om != nm:
        out.append(ReachChange(name, "mode", "*", widened=nm == "report",
                               note=f"mode {om} -> {nm}"
                               + (": refusals by the rules are forwarded (uninjected), so the "
                                  "identity reaches every host" if nm == "report" else "")))
    rules = (*ro, *rn)
    k = len(ro)

    def same(o: Rule | None, n: Rule | None) -> bool:
        if o is None or n is None:
            return o is n
        return (_terms(o) == _terms(n) and grant_key(os_, o) == grant_key(ns, n)
                and _budget(ob, o) == _budget(nb, n))
    groups: dict[tuple[object, ...], ReachChange] = {}
    named = {m for r in rules if r.methods is not None for m in r.methods}
    memo: dict[tuple[bool, ...], list[tuple[int | None, int | None, str]]] = {}
    for scheme, host, port, method, query in cells(rules) if rules else []:
        app = tuple(applies(r, scheme, host, port, method, query) for r in rules)
        if not any(app):
            continue
        if app not in memo:
            memo[app] = _pairs(ro, rn, app, k, same)
        for io, i_n, path in memo[app]:
            o = ro[io] if io is not None else None
            n = rn[i_n] if i_n is not None else None
            # query parameters neither deciding rule constrains are noise in the example
            names = {q for r in (o, n) if r is not None for q, _ in r.query}
            shown_q = tuple((q, v) for q, v in query if q in names)
            w = Witness(scheme, host, port, method, path, shown_q)
            kind: Kind = ("reachable" if o is None else "unreachable" if n is None
                          else "changed")
            label = _host_label(host, rules)
            key = (kind, label, scheme, port, shown_q, o, n)
            ch = groups.get(key)
            if ch is None:
                deltas = (grant_deltas(os_, o, ns, n, host) if o is not None and n is not None
                          else [])
                if o is not None and n is not None and not deltas and same(o, n):
                    continue  # the grants differ only on other hosts (a SigV4 scope)
                widened = kind == "reachable" or (
                    o is not None and n is not None
                    and (_wider(o, n, ob, nb) or any(d.widened for d in deltas)))
                ch = groups[key] = ReachChange(
                    name, kind, label, scheme, port, [], str(w), o, n, widened,
                    _changed_note(o, n, deltas, tools, ob, nb) if o is not None and n is not None
                    else "", "&".join(f"{q}={v}" for q, v in shown_q),
                    _grant(ns, n, host) if o is None else _grant(os_, o, host)
                    if n is None else "", deltas)
            shown = method if method in named else f"any other method (e.g. {method})"
            if shown not in ch.methods:
                ch.methods.append(shown)
    out += groups.values()
    out += _tunnel_changes(name, old, new)
    out += _dns_changes(name, old, new)
    return out


def _dns_changes(name: str, old: Identity | None, new: Identity | None) -> list[ReachChange]:
    """Query types beyond A/AAAA the policy DNS answers (decide_name), per host class. Whether
    a name resolves at all follows the requests that pass, shown above."""
    rules = [*(old.rules if old else ()), *(new.rules if new else ())]
    types = sorted({t for r in rules for t in r.dns_types})
    if not types:
        return []
    pol = [Policy(identities={name: i} if i is not None else {}, secrets={})
           for i in (old, new)]
    out = []
    for host in host_witnesses(p for r in rules for p in r.hosts):
        if parse_ip_literal(host) is not None:
            continue
        ds = [[decide_name(p, name, host, t) for t in types] for p in pol]
        added = [t for t, a, b in zip(types, *ds, strict=True) if b.allowed and not a.allowed]
        gone = [t for t, a, b in zip(types, *ds, strict=True) if a.allowed and not b.allowed]
        if not added and not gone:
            continue
        o = next((a.rule for a in ds[0] if a.allowed), None)
        n = next((b.rule for b in ds[1] if b.allowed), None)
        by = n if added else o
        note = ("DNS types " + " ".join([*(f"+{t}" for t in added), *(f"-{t}" for t in gone)])
                + (f" (rule '{by.name}' ({by.source}))" if by is not None else ""))
        out.append(ReachChange(name, "dns", _host_label(host, rules), "dns", 53, [],
                               f"{(added or gone)[0]} {host}", o, n, bool(added), note))
    return out


def _pairs(ro: Sequence[Rule], rn: Sequence[Rule], app: tuple[bool, ...],
           k: int, same: Callable[[Rule | None, Rule | None], bool]
           ) -> list[tuple[int | None, int | None, str]]:
    """Every (old decider, new decider) pair that differs and occurs on some path of a cell."""
    found: list[tuple[int | None, int | None, str]] = []
    seen: set[tuple[int | None, int | None]] = set()
    rules = (*ro, *rn)
    while True:
        def bad(v: Sequence[bool]) -> bool:
            io, i_n = decider(ro, v[:k]), decider(rn, v[k:])
            if (io, i_n) in seen:
                return False
            return not same(ro[io] if io is not None else None,
                            rn[i_n] if i_n is not None else None)
        path = path_search(rules, app, bad)
        if path is None:
            return found
        v = [a and (r.paths is None or glob_nfa(r.paths).matches(path))
             for a, r in zip(app, (*ro, *rn), strict=True)]
        pair = (decider(ro, v[:k]), decider(rn, v[k:]))
        seen.add(pair)
        found.append((*pair, path))


def _tunnel_changes(name: str, old: Identity | None, new: Identity | None) -> list[ReachChange]:
    rules = [*(old.rules if old else ()), *(new.rules if new else ())]
    if not any(r.passthrough for r in rules):
        return []
    out = []
    pol = [Policy(identities={name: i} if i is not None else {}, secrets={})
           for i in (old, new)]
    for host in host_witnesses(p for r in rules for p in r.hosts):
        for port in sorted({p for r in rules if "https" in r.schemes for p in r.ports}):
            ds = [decide_connect(p, name, host, port) for p in pol]
            pt = [d.allowed and d.rule is not None and d.rule.passthrough for d in ds]
            if pt[0] == pt[1] and (not pt[0] or _same_tunnel(ds[0].rule, ds[1].rule)):
                continue
            o, n = (d.rule if t else None for d, t in zip(ds, pt, strict=True))
            note = ("tunnelled uninspected (passthrough) by rule "
                    f"'{n.name}' ({n.source}): no method, path or secret check inside"
                    if n is not None and o is None else
                    f"no longer tunnelled by passthrough rule '{o.name}' ({o.source})"
                    if o is not None and n is None else
                    "passthrough private_cidrs change")
            out.append(ReachChange(name, "passthrough", _host_label(host, rules), "https", port,
                                   [], f"CONNECT {host}:{port}", o, n,
                                   n is not None and (o is None or not cidrs_covered(
                                       n.private_cidrs, o.private_cidrs)), note))
    return out


def _same_tunnel(a: Rule | None, b: Rule | None) -> bool:
    return a is not None and b is not None and a.private_cidrs == b.private_cidrs


@dataclass(slots=True)
class ReachDiff:
    old: str
    new: str
    changes: list[ReachChange]
    added: list[str] = field(default_factory=list)  # identities only in new
    removed: list[str] = field(default_factory=list)

    @property
    def widened(self) -> bool:
        return any(c.widened for c in self.changes)

    @property
    def narrowed(self) -> bool:
        return any(not c.widened for c in self.changes)

    def as_dict(self) -> dict[str, Any]:
        return {"old": self.old, "new": self.new, "widened": self.widened,
                "narrowed": self.narrowed, "identities_added": self.added,
                "identities_removed": self.removed,
                "changes": [c.as_dict() for c in self.changes]}


def reach_diff(old: Policy, new: Policy, old_name: str = "old",
               new_name: str = "new") -> ReachDiff:
    names = list(dict.fromkeys([*old.identities, *new.identities]))
    changes: list[ReachChange] = []
    tools = known_tools(old, new)
    for n in names:
        changes += identity_changes(old.identities.get(n), new.identities.get(n),
                                    old.secrets, new.secrets, tools, old.budgets, new.budgets)
    return ReachDiff(old_name, new_name, changes,
                     [n for n in names if n not in old.identities],
                     [n for n in names if n not in new.identities])


def known_tools(*policies: Policy) -> frozenset[str]:
    """The tool names the policies write out: plain names in `tools`/`deny_tools`, and the
    tools their fixtures call."""
    out: set[str] = set()
    for p in policies:
        for ident in p.identities.values():
            for r in ident.rules:
                if r.call is not None:
                    out.update(t for t in (*(r.call.tools or ()), *r.call.deny_tools)
                               if "*" not in t and "?" not in t)
        for t in p.tests:
            if t.call is not None:
                out.update(m.tool for m in t.call.messages if m.tool is not None)
    return frozenset(out)


_ORDER = {"mode": 0, "passthrough": 1, "reachable": 2, "changed": 3, "dns": 4,
          "unreachable": 5}


def _by_identity(d: ReachDiff) -> dict[str, list[ReachChange]]:
    out: dict[str, list[ReachChange]] = {}
    for c in sorted(d.changes, key=lambda c: (not c.widened, _ORDER[c.kind], c.host)):
        out.setdefault(c.identity, []).append(c)
    return out


def _counts(d: ReachDiff) -> str:
    w = sum(c.widened for c in d.changes)
    return (f"{len(d.changes)} change(s) of reach: {w} widening, {len(d.changes) - w} "
            "narrowing or neutral")


def format_text(d: ReachDiff) -> str:
    out: list[str] = []
    for ident, chs in _by_identity(d).items():
        tag = " (new identity)" if ident in d.added else (
            " (removed identity)" if ident in d.removed else "")
        out.append(f"identity {ident}{tag}:")
        out += [f"  {'+' if c.widened else '-'} {c.summary()}" for c in chs]
    out.append(f"{d.old} -> {d.new}: {_counts(d)}" if d.changes else
               f"{d.old} -> {d.new}: no change of reach")
    return "\n".join(out)


def md_cell(text: str) -> str:
    return html.escape(text, quote=False).replace("|", "\\|").replace("*", "\\*")


def format_markdown(d: ReachDiff) -> str:
    out = ["## Sandgate reach diff", ""]
    if not d.changes:
        out.append(f"No change of reach between `{d.old}` and `{d.new}`.")
        return "\n".join(out) + "\n"
    mark = ":warning: **widens reach**" if d.widened else "narrows reach only"
    out += [f"`{d.old}` → `{d.new}`: {mark}; {_counts(d)}.", ""]
    for ident, chs in _by_identity(d).items():
        tag = " (new identity)" if ident in d.added else (
            " (removed identity)" if ident in d.removed else "")
        out += [f"### `{ident}`{tag}", "", "| | change | request | by | grants |",
                "|---|---|---|---|---|"]
        for c in chs:
            r = c.new_rule if c.kind != "unreachable" else c.old_rule
            by = (f"`{r.name}` ({r.source}){_paths(r) if c.kind != 'dns' else ''}"
                  if r is not None else "")
            sec = c.grant.removeprefix(", ").removeprefix("injects ")
            what = c.note if c.kind in ("mode", "passthrough", "changed", "dns") else c.kind
            sign = ":heavy_plus_sign:" if c.widened else ":heavy_minus_sign:"
            out.append(f"| {sign} | {md_cell(what)} | "
                       f"{md_cell(c.what if c.kind != 'mode' else '*')}<br>e.g. "
                       f"`{c.example}` | {md_cell(by)} | {md_cell(sec)} |")
        out.append("")
    return "\n".join(out)


def format_json(d: ReachDiff) -> str:
    return json.dumps(d.as_dict(), indent=2)


def exit_status(d: ReachDiff, fail_on_narrowing: bool) -> int:
    """0: no change of reach (or only narrowing, unless asked to fail on it); 1: reach widened
    (or narrowed with fail_on_narrowing)."""
    if d.widened or (fail_on_narrowing and d.changes):
        return 1
    return 0


__all__ = ["ReachChange", "ReachDiff", "exit_status", "format_json",
           "format_markdown", "format_text", "identity_changes", "reach_diff"]
