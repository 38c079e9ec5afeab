"""Exact proofs over the rule language (not sampling): `narrower_than` and secret `hosts:`.

1. `identities.B.narrower_than: A` holds iff for every request R (scheme, host, port, method,
   path) that decide() allows for B with rule b, decide() allows R for A too, with a rule a that
   binds every secret b binds (injected or substituted) and may dial every private range b may
   dial; and every CONNECT that decide_connect() passes through for B, it passes through for A
   (with the private ranges covered as well).
2. `secrets.S.hosts: [...]` holds iff every host matched by a host pattern of an allow rule
   that injects or substitutes S is matched by one of those patterns.

How it is exact. A request is judged by finitely many facts, so the infinite request space falls
into finitely many cells that every rule treats alike:

* hosts: each exact host named by a pattern, and for each `*.suffix` wildcard one fresh witness
  `x.suffix` that equals no exact host. Any other host matches exactly the same patterns as one
  of these (the wildcards it matches are the suffixes of its longest matched one), or none;
* schemes and ports: those the rules name (a request on any other matches no rule);
* methods: those the rules name, plus one fresh method that stands for all the others.

Inside a cell only the path varies. Paths are normalised (sandgate.policy.paths) before they are
matched, so each glob is a regular language over normalised paths: the glob becomes a regular
expression, greenery turns it into a finite automaton, and the set of paths on which a rule
decides is `L(rule) - L(deny rules) - L(earlier allow rules)` within the language of normalised
paths. Inclusion, difference and emptiness of automata are decidable and exact, and a non-empty
difference yields a concrete shortest path. Every counter-example is re-judged by decide() /
decide_connect() before it is reported: the proof and the proxy cannot disagree silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import quote

from greenery import Charclass, Fsm, parse

from sandgate.decision import Decision, decide, decide_connect
from sandgate.policy.model import HostPattern, IPNetwork, Policy, Rule, Source
from sandgate.policy.paths import DOUBLE_STAR, PathPattern, normalise_path
from sandgate.request import RequestInfo, parse_url

# --- paths as regular languages -------------------------------------------------------------

# A character of a normalised path segment: normalise_path turns backslashes into slashes and
# refuses C0 controls and DEL; anything else (any Unicode) may appear, once percent-decoded.
_SEG_CHAR = r"[^/\\\x00-\x1f\x7f]"
_SEG_CHAR_NO_DOT = r"[^/\\\x00-\x1f\x7f.]"
# A segment is never "." or ".." (dot segments are resolved).
_SEGMENT = (f"({_SEG_CHAR_NO_DOT}{_SEG_CHAR}*|\\.{_SEG_CHAR_NO_DOT}{_SEG_CHAR}*"
            f"|\\.\\.{_SEG_CHAR}+)")
# Every output of normalise_path, and nothing else: "/" or segments, maybe a trailing slash.
NORMALISED_PATH_REGEX = f"(/|(/{_SEGMENT})+/?)"

# Characters greenery's regex syntax treats as special outside a class.
_RX_SPECIAL = frozenset("\\[]|().?*+{}")


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _RX_SPECIAL else c for c in text)


def glob_regex(pattern: PathPattern) -> str:
    """The regular expression (greenery and Python `re` syntax) of the normalised paths a glob
    matches (see paths.match_segments).

    A normalised path is the concatenation of "/" + segment for each element of
    path[1:].split("/") (a trailing slash is an empty last element), so a glob is the
    concatenation of one piece per glob segment: `**` is zero or more "/"+segment, `*` as a
    whole segment one non-empty segment, `*` inside a segment `[^/]*`, and the empty segment
    (a trailing slash) "/" alone.
    """
    out: list[str] = []
    for seg in pattern.segments:
        if seg == DOUBLE_STAR:
            out.append("(/[^/]*)*")
        elif seg == "*":
            out.append("/[^/]+")
        else:
            out.append("/" + "[^/]*".join(_escape(x) for x in seg.split("*")))
    return "".join(out)


@lru_cache(maxsize=1)
def normalised_paths() -> Fsm:
    """The automaton of every normalised path."""
    return parse(NORMALISED_PATH_REGEX).to_fsm().reduce()


@lru_cache(maxsize=4096)
def path_language(patterns: tuple[PathPattern, ...] | None) -> Fsm:
    """The normalised paths any of these globs matches (None: every normalised path)."""
    everything = normalised_paths()
    if patterns is None:
        return everything
    if not patterns:
        return everything - everything  # a rule without globs matches no path
    rx = "|".join(f"({glob_regex(p)})" for p in patterns)
    return (parse(rx).to_fsm() & everything).reduce()


def _surrogate(u: int) -> bool:
    return 0xD800 <= u <= 0xDFFF


_NICE = "abcdefghijklmnopqrstuvwxyz0123456789-_~ABCDEFGHIJKLMNOPQRSTUVWXYZ."


def _char_of(cc: Charclass) -> str | None:
    """A readable character of a character class (never a lone surrogate)."""
    for ch in _NICE:
        if cc.accepts(ch):
            return ch
    ranges: Sequence[tuple[int, int]] = cc.ord_ranges
    if not cc.negated:
        for lo, hi in ranges:
            u = 0xE000 if _surrogate(lo) else lo
            if u <= hi:
                return chr(u)
        return None
    for u in [0x20, *(hi + 1 for _, hi in ranges)]:
        u = 0xE000 if _surrogate(u) else u
        if u < 0x110000 and cc.accepts(chr(u)):
            return chr(u)
    return None


def shortest_string(fsm: Fsm) -> str | None:
    """A shortest string the automaton accepts, spelled with readable characters; None when it
    accepts nothing."""
    trans: dict[Any, dict[Any, Any]] = {s: dict(fsm.map[s]) for s in fsm.states}
    back: dict[Any, set[Any]] = {s: set() for s in fsm.states}
    for s, row in trans.items():
        for dst in row.values():
            back[dst].add(s)
    live = set(fsm.finals)
    todo = list(live)
    while todo:
        s = todo.pop()
        for p in back[s]:
            if p not in live:
                live.add(p)
                todo.append(p)
    if fsm.initial not in live:
        return None
    prev: dict[Any, tuple[Any, str] | None] = {fsm.initial: None}
    queue = [fsm.initial]
    i = 0
    while i < len(queue):
        s = queue[i]
        i += 1
        if s in fsm.finals:
            out: list[str] = []
            step = prev[s]
            while step is not None:
                out.append(step[1])
                step = prev[step[0]]
            return "".join(reversed(out))
        edges = []
        for cc, dst in trans[s].items():
            ch = _char_of(cc)
            if ch is not None and dst in live and dst not in prev:
                edges.append((_NICE.find(ch) if ch in _NICE else len(_NICE), ch, dst))
        for _, ch, dst in sorted(edges, key=lambda e: (e[0], e[1])):
            if dst not in prev:
                prev[dst] = (s, ch)
                queue.append(dst)
    raise ProofError("a non-empty path language has no printable witness")


def raw_path(normalised: str) -> str:
    """A request path that normalises to `normalised` (which must be a normalised path)."""
    raw = quote(normalised, safe="/:@!$&'()*+,;=-._~")
    if normalise_path(raw) != normalised:
        raise ProofError(f"witness path {normalised!r} does not survive normalisation")
    return raw


# --- hosts ------------------------------------------------------------------------------------

_FRESH = ("x", "y", "z", "w", "v")


def host_witnesses(patterns: Iterable[HostPattern]) -> list[str]:
    """One host per class of hosts that the patterns cannot tell apart (hosts that match no
    pattern excepted): every exact host, and a fresh label under each wildcard."""
    pats = list(patterns)
    exact = sorted({p.suffix for p in pats if not p.wildcard})
    out = list(exact)
    taken = set(exact)
    for suffix in sorted({p.suffix for p in pats if p.wildcard}):
        n = 0
        while True:
            label = _FRESH[n] if n < len(_FRESH) else f"x{n}"
            host = label + suffix
            n += 1
            if host not in taken:
                break
        if len(host) <= 253:  # longer names are not hosts; a shorter label is always found first
            out.append(host)
            taken.add(host)
    return out


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# --- private ranges ---------------------------------------------------------------------------


def cidrs_covered(inner: Sequence[IPNetwork], outer: Sequence[IPNetwork]) -> bool:
    """Is every address of `inner` inside the union of `outer`?"""
    for net in inner:
        rest: list[IPNetwork] = [net]
        for o in outer:
            if o.version != net.version:
                continue
            nxt: list[IPNetwork] = []
            for r in rest:
                if r.subnet_of(o):  # type: ignore[arg-type]
                    continue
                if o.subnet_of(r):  # type: ignore[arg-type]
                    nxt.extend(r.address_exclude(o))  # type: ignore[arg-type]
                else:
                    nxt.append(r)
            rest = nxt
        if rest:
            return False
    return True


# --- results ----------------------------------------------------------------------------------


class ProofError(RuntimeError):
    """The prover and decide() disagree, or a witness cannot be built: a bug, never a verdict."""


@dataclass(frozen=True, slots=True)
class ProofResult:
    kind: Literal["narrower_than", "secret_hosts"]
    claim: str  # "bash-tool narrower than coding-agent", "secret anthropic only to api.x.com"
    ok: bool
    source: Source | None  # where the claim is declared
    counterexample: str | None = None  # "POST https://h:443/p", "CONNECT h:443" or a host
    details: tuple[str, ...] = ()  # why the counter-example refutes the claim

    def __str__(self) -> str:
        if self.ok:
            return f"proof ok: {self.claim}"
        where = f" ({self.source})" if self.source else ""
        lines = [f"proof FAILED: {self.claim}{where}"]
        if self.counterexample is not None:
            lines.append(f"  counter-example: {self.counterexample}")
        lines += [f"  {d}" for d in self.details]
        return "\n".join(lines)


def prove(policy: Policy) -> list[ProofResult]:
    """Every claim the policy declares, proved or refuted with a counter-example."""
    out: list[ProofResult] = []
    for name, ident in policy.identities.items():
        if ident.narrower_than is not None:
            out.append(prove_narrower(policy, name, ident.narrower_than))
    for name, ref in policy.secrets.items():
        if ref.hosts is not None:
            out.append(prove_secret_hosts(policy, name))
    return out


# --- narrower_than ----------------------------------------------------------------------------

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


def _fresh_method(named: set[str]) -> str:
    for m in _METHODS:
        if m not in named:
            return m
    n = 0
    while f"OTHER{n}" in named:
        n += 1
    return f"OTHER{n}"


def _applies(r: Rule, scheme: str, host: str, port: int, method: str) -> bool:
    """decision._l7_matches without the path."""
    return (not r.passthrough and scheme in r.schemes and port in r.ports
            and (r.methods is None or method in r.methods) and r.matches_host(host))


def _regions(rules: Sequence[Rule]) -> list[tuple[Rule, Fsm]]:
    """For the rules that apply in a cell: each allow rule and the paths on which decide()
    allows with it (it matches, no earlier allow matches, no deny matches)."""
    taken: Fsm | None = None
    for r in rules:
        if r.action == "deny":
            lang = path_language(r.paths)
            taken = lang if taken is None else taken | lang
    out: list[tuple[Rule, Fsm]] = []
    for r in rules:
        if r.action != "allow":
            continue
        lang = path_language(r.paths)
        out.append((r, lang if taken is None else lang - taken))
        taken = lang if taken is None else taken | lang
    return out


def _compatible(narrow: Rule, other: Rule) -> bool:
    return narrow.secrets <= other.secrets and cidrs_covered(narrow.private_cidrs,
                                                             other.private_cidrs)


def _cell_gap(narrow: Sequence[Rule], other: Sequence[Rule]) -> tuple[Rule, str] | None:
    """A narrow allow rule and a normalised path it decides on where the other identity does
    not allow with a compatible rule; None when there is none."""
    o_regions = _regions(other)
    for a, region in _regions(narrow):
        if region.empty():
            continue
        good = [o for r, o in o_regions if _compatible(a, r)]
        bad = region
        for g in good:
            bad = bad - g
        w = shortest_string(bad)
        if w is not None:
            return a, w
    return None


def _secrets(names: Iterable[str]) -> str:
    s = sorted(names)
    return ", ".join(s) if s else "no secret"


def _why_incompatible(narrow: str, a: Rule, other: str, o: Rule) -> str:
    missing = a.secrets - o.secrets
    if missing:
        return (f"{other} allows it by rule '{o.name}' ({o.source}), which binds "
                f"{_secrets(o.secrets)}; rule '{a.name}' of {narrow} binds "
                f"{_secrets(missing)} on it")
    return (f"{other} allows it by rule '{o.name}' ({o.source}), whose private_cidrs "
            f"({', '.join(map(str, o.private_cidrs)) or 'none'}) do not cover those of rule "
            f"'{a.name}' of {narrow} ({', '.join(map(str, a.private_cidrs))})")


def prove_narrower(policy: Policy, narrow: str, other: str) -> ProofResult:
    claim = f"{narrow} narrower than {other}"
    n_ident = policy.identities.get(narrow)
    o_ident = policy.identities.get(other)
    src = n_ident.source if n_ident else None
    if n_ident is None or o_ident is None:
        missing = narrow if n_ident is None else other
        return ProofResult("narrower_than", claim, False, src,
                           details=(f"identity '{missing}' is not defined",))
    rules = (*n_ident.rules, *o_ident.rules)
    hosts = host_witnesses(p for r in rules for p in r.hosts)

    # L7: every request decide() allows.
    schemes = sorted({s for r in rules for s in r.schemes})
    ports = sorted({p for r in rules for p in r.ports})
    named = {m for r in rules if r.methods is not None for m in r.methods}
    methods = [*sorted(named), _fresh_method(named)]
    memo: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Rule, str] | None] = {}
    for scheme in schemes:
        for host in hosts:
            for port in ports:
                for method in methods:
                    n_app = tuple(i for i, r in enumerate(n_ident.rules)
                                  if _applies(r, scheme, host, port, method))
                    if not any(n_ident.rules[i].action == "allow" for i in n_app):
                        continue
                    o_app = tuple(i for i, r in enumerate(o_ident.rules)
                                  if _applies(r, scheme, host, port, method))
                    key = (n_app, o_app)
                    if key not in memo:
                        memo[key] = _cell_gap([n_ident.rules[i] for i in n_app],
                                              [o_ident.rules[i] for i in o_app])
                    gap = memo[key]
                    if gap is not None:
                        return _l7_counterexample(policy, narrow, other, claim, src, scheme,
                                                  host, port, method, *gap)

    # CONNECT: every tunnel decide_connect() passes through without interception.
    for host in hosts:
        for port in sorted({p for r in rules if "https" in r.schemes for p in r.ports}):
            dn = decide_connect(policy, narrow, host, port)
            if not (dn.allowed and dn.rule is not None and dn.rule.passthrough):
                continue
            do = decide_connect(policy, other, host, port)
            if do.allowed and do.rule is not None and do.rule.passthrough:
                if cidrs_covered(dn.rule.private_cidrs, do.rule.private_cidrs):
                    continue
                why = _why_incompatible(narrow, dn.rule, other, do.rule)
            elif do.allowed:
                why = f"{other} does not pass it through: {do.reason}"
            else:
                why = f"{other} refuses it: {do.reason}"
            return ProofResult("narrower_than", claim, False, src,
                               counterexample=f"CONNECT {_url_host(host)}:{port}",
                               details=(f"{narrow}: {dn.reason}", why))
    return ProofResult("narrower_than", claim, True, src)


def _l7_counterexample(policy: Policy, narrow: str, other: str, claim: str, src: Source | None,
                       scheme: str, host: str, port: int, method: str, rule: Rule,
                       path: str) -> ProofResult:
    raw = raw_path(path)
    req = RequestInfo(scheme, host, port, method, raw)
    url = f"{scheme}://{_url_host(host)}:{port}{raw}"
    if parse_url(method, url) != req:
        raise ProofError(f"counter-example {method} {url} does not parse back to itself")
    dn = decide(policy, narrow, req)
    do = decide(policy, other, req)
    _agree(dn.allowed and dn.rule == rule, f"{narrow} should allow {method} {url} by rule "
           f"'{rule.name}'", dn)
    if do.allowed:
        assert do.rule is not None
        _agree(not _compatible(rule, do.rule), f"{other} should not allow {method} {url} with "
               f"rule '{do.rule.name}'", do)
        why = _why_incompatible(narrow, rule, other, do.rule)
    else:
        why = f"{other} refuses it: {do.reason}"
    return ProofResult("narrower_than", claim, False, src, counterexample=f"{method} {url}",
                       details=(f"{narrow} allows it: {dn.reason}", why))


def _agree(ok: bool, claim: str, d: Decision) -> None:
    if not ok:
        raise ProofError(f"proof and decide() disagree: {claim}, but decide() says: {d.reason}")


# --- secret hosts -----------------------------------------------------------------------------


def prove_secret_hosts(policy: Policy, secret: str) -> ProofResult:
    ref = policy.secrets[secret]
    allowed = ref.hosts or ()
    claim = f"secret {secret} only to {', '.join(p.text for p in allowed)}"
    details: list[str] = []
    first: str | None = None
    for iname, ident in policy.identities.items():
        for r in ident.rules:
            if r.action != "allow" or secret not in r.secrets:
                continue
            how = " and ".join(
                w for w, on in (("injects", r.inject is not None and secret in r.inject.secrets),
                                ("substitutes", secret in r.substitute)) if on)
            for host in host_witnesses((*r.hosts, *allowed)):
                if not r.matches_host(host) or any(p.matches(host) for p in allowed):
                    continue
                pat = next(p for p in r.hosts if p.matches(host))
                first = first or host
                details.append(f"rule '{r.name}' of identity '{iname}' ({r.source}) {how} it "
                               f"for host pattern {pat.text}, which matches {host}")
                break
    if details:
        return ProofResult("secret_hosts", claim, False, ref.source, counterexample=first,
                           details=tuple(details))
    return ProofResult("secret_hosts", claim, True, ref.source)


__all__ = [
    "NORMALISED_PATH_REGEX",
    "ProofError",
    "ProofResult",
    "cidrs_covered",
    "glob_regex",
    "host_witnesses",
    "path_language",
    "prove",
    "prove_narrower",
    "prove_secret_hosts",
    "raw_path",
    "shortest_string",
]
