"""Exact proofs over the rule language (not sampling): `narrower_than` and secret `hosts:`.

1. `identities.B.narrower_than: A` holds iff for every request R (scheme, host, port, method,
   path) that decide() allows for B with rule b, decide() allows R for A too, with a rule a that
   binds every secret b binds (injected or substituted) and may dial every private range b may
   dial; and every CONNECT that decide_connect() passes through for B, it passes through for A
   (with the private ranges covered as well). A tunnel is reach: an https request to a
   host:port that A tunnels (passthrough) is reached by A, with no secret; one that B tunnels
   is never judged for B, and is proved as B's CONNECT. Reach is every grant: a's approval gate
   must be no weaker than b's (b lets through without approval what A asks for: refuted), and
   a's credentials no narrower in scope (sandgate.review.grants, the reach diff's comparison);
   and every query type beyond A/AAAA the policy DNS answers B for a name, it answers A.
2. `secrets.S.hosts: [...]` holds iff every host matched by a host pattern of an allow rule
   that injects or substitutes S is matched by one of those patterns.

How it is exact. A request is judged by finitely many facts, so the infinite request space falls
into finitely many cells that every rule treats alike:

* hosts: each exact host named by a pattern, and for each `*.suffix` wildcard one fresh witness
  `x.suffix` that equals no exact host. Any other host matches exactly the same patterns as one
  of these (the wildcards it matches are the suffixes of its longest matched one), or none;
* schemes and ports: those the rules name (a request on any other matches no rule);
* methods: those the rules name, plus one fresh method that stands for all the others;
* `public: true` rules: their host pattern is a wildcard over every host (model.ANY_PUBLIC_HOST),
  whose witness is a fresh host that no other pattern matches;
* `query:` constraints: for each constrained parameter name, each value a rule names, or the
  parameter left out, which stands for every other value, a repeated or re-spelled parameter
  and an unreadable query (no constraint matches any of them). Beyond MAX_QUERY_CELLS cells the
  claim is reported as not proved.

`max_request_bytes` is compared per pair of deciding rules, like secrets and private ranges.

Inside a cell only the path varies. Paths are normalised (sandgate.policy.paths) before they are
matched, so each glob is a regular language over normalised paths (glob_regex writes it as a
regular expression). The search runs over the product of the automaton of normalised paths and
one automaton per applicable rule, whose state tells which rules match the path read so far, so
which rule decide() would pick for each identity; a breadth-first search of that finite product
either reaches a path where the narrow identity allows and the other does not (a shortest
counter-example) or exhausts it (a proof). The alphabet is finite: the characters the globs name,
"/", "." and one stand-in for every other character, which no glob can tell apart. Every
counter-example is re-judged by decide() / decide_connect() before it is reported: the proof and
the proxy cannot disagree silently.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import quote

from sandgate.decision import Decision, decide_connect, decide_name
from sandgate.errors import InternalError
from sandgate.llm.llmcall import KNOWN_HOSTS
from sandgate.netguard import parse_ip_literal
from sandgate.policy.hosts import compile_host_pattern
from sandgate.policy.llmproofs import (
    API_PATHS,
    APIS,
    FAMILY_APIS,
    UNREADABLE,
    LlmWitness,
    judged_as_llm,
    llm_fits,
    llm_gap,
    llm_witnesses,
    shown_witness,
)
from sandgate.policy.model import Budget, HostPattern, IPNetwork, Policy, Rule, Source
from sandgate.policy.overlap import signed_covers
from sandgate.policy.paths import DOUBLE_STAR, PathPattern, normalise_path
from sandgate.request import RequestInfo, parse_url
from sandgate.review.callproofs import NOT_A_CALL, acting, call_witnesses, passes, shown
from sandgate.review.grants import Delta, Secrets, grant_deltas
from sandgate.rpc.jsonrpc import Call

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

# Characters special outside a class in greenery's regex syntax (also valid escapes in `re`).
_RX_SPECIAL = frozenset("\\[]|().?*+{}")


def _escape(text: str) -> str:
    return "".join("[\\^]" if c == "^" else "[$]" if c == "$" else
                   "\\" + c if c in _RX_SPECIAL else c for c in text)


def glob_regex(pattern: PathPattern) -> str:
    """The regular expression of the normalised paths a glob matches (paths.match_segments),
    in a syntax both greenery and Python `re` read; the automaton below is this expression.

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


# The automata work over a finite alphabet of concrete characters: "/", ".", every literal
# character of every glob in the proof, and one character that stands for every other segment
# character. Globs test a character only for equality with a literal or with "/", and the
# normalised-path automaton only for "/" and ".", so all characters outside the literals behave
# identically everywhere: one representative is exact. (Characters a normalised path never
# holds, controls and backslash, are left out.)

_NS = ""  # edge label: any character but "/"


class GlobNfa:
    """The globs of one rule as one NFA: node -> epsilon successors, labelled edges."""

    def __init__(self, patterns: Sequence[PathPattern]) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[str, int]]] = []
        self.accept: set[int] = set()
        self.start = self._node()
        for p in patterns:
            cur = self._node()
            self.eps[self.start].append(cur)
            for seg in p.segments:
                if seg == DOUBLE_STAR:  # (/[^/]*)*
                    loop, inner, after = self._node(), self._node(), self._node()
                    self.eps[cur].append(loop)
                    self.edges[loop].append(("/", inner))
                    self.edges[inner].append((_NS, inner))
                    self.eps[inner].append(loop)
                    self.eps[loop].append(after)
                    cur = after
                    continue
                nxt = self._node()
                self.edges[cur].append(("/", nxt))
                cur = nxt
                if seg == "*":  # [^/]+
                    nxt = self._node()
                    self.edges[cur].append((_NS, nxt))
                    cur = nxt
                    self.edges[cur].append((_NS, cur))
                    continue
                for k, part in enumerate(seg.split("*")):
                    if k:  # [^/]* between literal parts: a fresh node with a self-loop
                        nxt = self._node()
                        self.eps[cur].append(nxt)
                        cur = nxt
                        self.edges[cur].append((_NS, cur))
                    for ch in part:
                        nxt = self._node()
                        self.edges[cur].append((ch, nxt))
                        cur = nxt
            self.accept.add(cur)
        self.literals = frozenset(ch for row in self.edges for ch, _ in row if ch not in (_NS,))
        self._step: dict[tuple[frozenset[int], str], frozenset[int]] = {}
        self.initial = self._closure({self.start})

    def _node(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def _closure(self, nodes: Iterable[int]) -> frozenset[int]:
        out = set(nodes)
        todo = list(out)
        while todo:
            for m in self.eps[todo.pop()]:
                if m not in out:
                    out.add(m)
                    todo.append(m)
        return frozenset(out)

    def step(self, state: frozenset[int], ch: str) -> frozenset[int]:
        """The subset-construction successor (memoised): a DFA built lazily."""
        key = (state, ch)
        got = self._step.get(key)
        if got is None:
            got = self._closure(m for n in state for lab, m in self.edges[n]
                                if lab == ch or (lab == _NS and ch != "/"))
            self._step[key] = got
        return got

    def accepts_state(self, state: frozenset[int]) -> bool:
        return not self.accept.isdisjoint(state)

    def matches(self, path: str) -> bool:
        state = self.initial
        for ch in path:
            state = self.step(state, ch)
            if not state:
                return False
        return self.accepts_state(state)


@lru_cache(maxsize=4096)
def glob_nfa(patterns: tuple[PathPattern, ...]) -> GlobNfa:
    return GlobNfa(patterns)


# The normalised-path DFA: states and transitions (see NORMALISED_PATH_REGEX).
_V_START, _V_SLASH, _V_DOT1, _V_DOT2, _V_SEG, _V_DEAD = range(6)
_V_FINAL = frozenset({_V_SLASH, _V_SEG})


def _v_step(state: int, ch: str) -> int:
    if state == _V_START:
        return _V_SLASH if ch == "/" else _V_DEAD
    if state == _V_DEAD:
        return _V_DEAD
    if ch == "/":  # "//", "/./" and "/../" never occur; a segment may end
        return _V_SLASH if state == _V_SEG else _V_DEAD
    if ch == "\\" or ord(ch) < 0x20 or ord(ch) == 0x7F:
        return _V_DEAD
    if ch == ".":
        return {_V_SLASH: _V_DOT1, _V_DOT1: _V_DOT2}.get(state, _V_SEG)
    return _V_SEG


def is_normalised_path(path: str) -> bool:
    """Membership in the language of normalised paths, by the automaton the proofs use."""
    state = _V_START
    for ch in path:
        state = _v_step(state, ch)
    return state in _V_FINAL


_NICE = "abcdefghijklmnopqrstuvwxyz0123456789-_~ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _alphabet(nfas: Iterable[GlobNfa]) -> list[str]:
    """The finite alphabet: "/", ".", every literal, and one stand-in for all other characters,
    in the order witnesses prefer them."""
    lits = {"/", "."}
    for n in nfas:
        lits |= n.literals
    other = next((c for c in _NICE if c not in lits), None)
    if other is None:
        other = next(chr(u) for u in range(0xA1, 0x110000)
                     if chr(u) not in lits and not 0xD800 <= u <= 0xDFFF)
    chars = [*lits, other]
    return sorted(chars, key=lambda c: (c == "/", c == ".", c not in _NICE, _NICE.find(c), c))


PathPredicate = Callable[[Sequence[bool]], bool]


def find_path(languages: Sequence[tuple[PathPattern, ...] | None],
              bad: PathPredicate) -> str | None:
    """A shortest normalised path whose membership vector in `languages` (None: every path)
    satisfies `bad`, or None when no normalised path does: breadth-first search of the product
    of the normalised-path DFA and one lazily determinised NFA per language. The product is
    finite, so the search ends, and it visits every reachable product state: exact."""
    nfas = [glob_nfa(lang) if lang is not None else None for lang in languages]
    alphabet = _alphabet(n for n in nfas if n is not None)
    empty: frozenset[int] = frozenset()
    init = (_V_START, tuple(n.initial if n is not None else empty for n in nfas))
    prev: dict[tuple[int, tuple[frozenset[int], ...]], tuple[Any, str] | None] = {init: None}
    queue = [init]
    i = 0
    while i < len(queue):
        state = queue[i]
        i += 1
        v, subs = state
        if v in _V_FINAL:
            vec = [n is None or n.accepts_state(s) for n, s in zip(nfas, subs, strict=True)]
            if bad(vec):
                out: list[str] = []
                step = prev[state]
                while step is not None:
                    out.append(step[1])
                    step = prev[step[0]]
                return "".join(reversed(out))
        for ch in alphabet:
            nv = _v_step(v, ch)
            if nv == _V_DEAD:
                continue
            nxt = (nv, tuple(n.step(s, ch) if n is not None else empty
                             for n, s in zip(nfas, subs, strict=True)))
            if nxt not in prev:
                prev[nxt] = (state, ch)
                queue.append(nxt)
    return None


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


def url_host(host: str) -> str:
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


class ProofError(InternalError):
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


def fresh_method(named: set[str]) -> str:
    for m in _METHODS:
        if m not in named:
            return m
    n = 0
    while f"OTHER{n}" in named:
        n += 1
    return f"OTHER{n}"


QueryCell = tuple[tuple[str, str], ...]


def applies(r: Rule, scheme: str, host: str, port: int, method: str,
             query: QueryCell = ()) -> bool:
    """decision._l7_matches without the path."""
    return (not r.passthrough and scheme in r.schemes and port in r.ports
            and (r.methods is None or method in r.methods) and r.matches_host(host)
            and r.matches_query(query))


# At most this many query cells per proof (the product over constrained parameter names of
# their named values plus "absent"); beyond it `check` says the claim is not proved.
MAX_QUERY_CELLS = 4096


def query_cells(rules: Iterable[Rule]) -> list[QueryCell] | None:
    """One request query per class of queries that the rules' `query:` constraints cannot tell
    apart: for each constrained name, each value some rule names, or the name left out (which
    stands for every other value, a repeated or re-spelled parameter, and an unreadable query:
    no required constraint matches any of them; a fresh value stands for them where optional
    or absent constraints tell "left out" from "another value"). None when there are more
    than MAX_QUERY_CELLS."""
    named: dict[str, set[str]] = {}
    rules = list(rules)
    for r in rules:
        for name, values in (*r.query, *r.query_optional):
            named.setdefault(name, set()).update(values)
        for name in r.query_absent:
            named.setdefault(name, set())
    # Where a rule lets the parameter be missing (optional, absent), "left out" no longer
    # stands for "any other value": one fresh value stands for every value no rule names (and
    # for a repeated or re-spelled parameter, which no constraint matches either).
    for name in {n for r in rules for n in (*dict(r.query_optional), *r.query_absent)}:
        fresh = next(f"other{k}" for k in range(len(named[name]) + 1)
                     if f"other{k}" not in named[name])
        named[name].add(fresh)
    count = 1
    for named_values in named.values():
        count *= len(named_values) + 1
    if count > MAX_QUERY_CELLS:
        return None
    cells: list[QueryCell] = [()]
    for name in sorted(named):
        cells = [(*c, (name, v)) for c in cells for v in sorted(named[name])] + cells
    return cells


def involved_query(query: QueryCell, rules: Iterable[Rule], scheme: str, host: str, port: int,
                   method: str) -> QueryCell:
    """The part of a query cell a witness shows: the parameters that the rules reaching this
    scheme, host, port and method constrain. A cell names a value for every parameter any rule
    of the proof constrains, so a counter-example on one host would otherwise carry the query
    values of rules on others. The whole cell when dropping the rest changes which of those
    rules match (then the decision might change too)."""
    near = [r for r in rules if not r.passthrough and scheme in r.schemes and port in r.ports
            and (r.methods is None or method in r.methods) and r.matches_host(host)]
    names = {n for r in near for n, _ in (*r.query, *r.query_optional)} | {
        n for r in near for n in r.query_absent}
    kept = tuple((n, v) for n, v in query if n in names)
    if [r.matches_query(kept) for r in near] != [r.matches_query(query) for r in near]:
        return query
    return kept


def query_string(query: QueryCell) -> str:
    """The query string of a witness (each name and value percent-encoded, so it decodes back
    to exactly itself)."""
    return "&".join(f"{quote(n, safe='')}={quote(v, safe='')}" for n, v in query)


def decider(rules: Sequence[Rule], vec: Sequence[bool]) -> int | None:
    """decide() on a membership vector: the index of the rule that decides, or None when a
    deny rule matches or no allow rule does. Deny > ask > allow: the first matching ask rule
    wins over every allow rule (an ask rule is compiled as an allow rule with `ask`)."""
    if any(m and r.action == "deny" for r, m in zip(rules, vec, strict=True)):
        return None
    matching = [i for i, (r, m) in enumerate(zip(rules, vec, strict=True))
                if m and r.action == "allow"]
    return next((i for i in matching if rules[i].ask is not None),
                matching[0] if matching else None)


def _shape(r: Rule) -> tuple[object, ...]:
    """What _cell_gap looks at in a rule."""
    return (r.action, r.paths, r.secrets, r.private_cidrs, r.max_request_bytes,
            r.operations, r.copy_sources, r.ask, r.github_scope,
            r.inject.sign if r.inject is not None else None, r.llm, r.inject is not None)


def _limit_covered(narrow: int | None, other: int | None) -> bool:
    """Every body the narrow rule's max_request_bytes lets through, the other's does (None: no
    limit of the rule's own; the proxy's --max-request-body, unknown here, applies to both)."""
    return other is None or (narrow is not None and narrow <= other)


def _compatible(narrow: Rule, other: Rule, secrets: Secrets, host: str) -> bool:
    return (narrow.secrets <= other.secrets
            and cidrs_covered(narrow.private_cidrs, other.private_cidrs)
            and _limit_covered(narrow.max_request_bytes, other.max_request_bytes)
            and signed_covers(other, narrow)
            and not _grant_widened(narrow, other, secrets, host))


def _grant_widened(narrow: Rule, other: Rule, secrets: Secrets, host: str) -> list[Delta]:
    """What the narrow identity's rule grants beyond the other's on a request to `host`: no
    approval where the other asks (or a weaker gate), a credential of wider scope
    (sandgate.review.grants: the reach diff's own comparison, other -> narrow)."""
    return [d for d in grant_deltas(secrets, other, secrets, narrow, host) if d.widened]


def _cell_gap(narrow: Sequence[Rule], other: Sequence[Rule], secrets: Secrets,
              host: str, llm: LlmWitness | None = None,
              budgets: Mapping[str, Budget] | None = None,
              upgrade: str | None = None) -> tuple[int, str] | None:
    """Within one cell (the rules that apply there, in order): a normalised path on which the
    narrow identity allows, with the rule at the returned index, and the other identity does
    not allow with a compatible rule; None when there is no such path. `llm`: the LLM call the
    body makes (sandgate.policy.llmproofs), judged where a rule's host or `api:` makes the
    path an inference call (the paths of each API are languages of the search too); on a
    WebSocket (`upgrade`) the call is a message, judged when the upgrade's rule has `llm:`
    (sandgate.stages.wsllm)."""
    k, m = len(narrow), len(other)
    known = KNOWN_HOSTS.get(host)

    def final(rules: Sequence[Rule], vec: Sequence[bool],
              apis: Sequence[bool]) -> tuple[int | None, bool]:
        head = decider(rules, vec)
        if llm is None or head is None:
            return head, False
        f = rules[head].llm
        if upgrade is not None:
            return _ws_final(rules, vec, head, llm)
        family = known or (f.api if f is not None else None)
        if family is None or not any(apis[APIS.index(a)] for a in FAMILY_APIS[family]):
            return head, False  # not an inference call: never read
        if llm == UNREADABLE:
            return (None if f is not None else head), False
        model, cap = llm
        fits = [v and llm_fits(r.llm, model, cap) for r, v in zip(rules, vec, strict=True)]
        return decider(rules, fits), True

    def verdict(vec: Sequence[bool]) -> int | None:
        """The narrow identity's deciding rule where it grants more than the other's."""
        apis = vec[k + m:]
        a, aj = final(narrow, vec[:k], apis)
        if a is None:
            return None
        o, oj = final(other, vec[k:k + m], apis)
        if o is None or not _compatible(narrow[a], other[o], secrets, host) or llm_gap(
                narrow[a], aj, other[o], oj, llm, budgets or {}) is not None:
            return a
        return None

    languages: list[tuple[PathPattern, ...] | None] = [r.paths for r in (*narrow, *other)]
    if llm is not None and upgrade is None:
        languages += [API_PATHS[a] for a in APIS]
    w = find_path(languages, lambda vec: verdict(vec) is not None)
    if w is None:
        return None
    a = verdict([lang is None or glob_nfa(lang).matches(w) for lang in languages])
    assert a is not None
    return a, w


def _ws_final(rules: Sequence[Rule], vec: Sequence[bool], head: int,
              llm: LlmWitness) -> tuple[int | None, bool]:
    """A message on a WebSocket whose upgrade rule `head` allowed (sandgate.stages.wsllm):
    unjudged unless that rule has `llm:`; else refused when unreadable, and decided with the
    call, refused when the deciding rule would hold it (ask) or binds other secrets than the
    upgrade's rule (its credentials ride on the WebSocket)."""
    if rules[head].llm is None:
        return head, False
    if llm == UNREADABLE:
        return None, False  # the WebSocket is closed
    model, cap = llm
    d = decider(rules, [v and llm_fits(r.llm, model, cap) for r, v in zip(rules, vec,
                                                                         strict=True)])
    if d is None or rules[d].ask is not None or (
            d != head and rules[d].secrets != rules[head].secrets):
        return None, True
    return d, True


def _secrets(names: Iterable[str]) -> str:
    s = sorted(names)
    return ", ".join(s) if s else "no secret"


def _why_incompatible(narrow: str, a: Rule, other: str, o: Rule,
                      secrets: Secrets | None = None, host: str | None = None) -> str:
    missing = a.secrets - o.secrets
    if missing:
        return (f"{other} allows it by rule '{o.name}' ({o.source}), which binds "
                f"{_secrets(o.secrets)}; rule '{a.name}' of {narrow} binds "
                f"{_secrets(missing)} on it")
    if not signed_covers(o, a):
        return (f"{other} allows it by rule '{o.name}' ({o.source}), which signs only some "
                f"of what rule '{a.name}' of {narrow} lets through: its `operations:` or "
                "`copy_sources:` are narrower (or rule "
                f"'{a.name}' does not sign, so it also passes requests no signing rule does)")
    if not _limit_covered(a.max_request_bytes, o.max_request_bytes):
        size = f"{a.max_request_bytes} bytes" if a.max_request_bytes is not None else (
            "no limit of its own")
        return (f"{other} allows it by rule '{o.name}' ({o.source}) only with a body of at "
                f"most {o.max_request_bytes} bytes (max_request_bytes); rule '{a.name}' of "
                f"{narrow} allows {size}")
    wider = _grant_widened(a, o, secrets, host or "") if secrets is not None else []
    if wider and cidrs_covered(a.private_cidrs, o.private_cidrs):
        verb = "holds it for approval" if o.ask is not None else "allows it"
        return (f"{other} {verb} by rule '{o.name}' ({o.source}), but rule '{a.name}' of "
                f"{narrow} grants more on it ({other} -> {narrow}): "
                + "; ".join(map(str, wider)))
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
    # a provider's own host is recognised without `api:` (llmcall.KNOWN_HOSTS): its own
    # witness where a rule judges LLM calls, never stood for by another host of a wildcard
    known = [compile_host_pattern(h) for h in KNOWN_HOSTS] if any(
        r.llm is not None for r in rules) else []
    hosts = host_witnesses([*(p for r in rules for p in r.hosts), *known])

    # L7: every request decide() allows.
    schemes = sorted({s for r in rules for s in r.schemes})
    ports = sorted({p for r in rules for p in r.ports})
    named = {m for r in rules if r.methods is not None for m in r.methods}
    methods = [*sorted(named), fresh_method(named)]
    # A WebSocket (a GET) on a rule with mcp:/jsonrpc:/llm: is refused unless it opts in:
    # one more witness, on GET (named explicitly: the fresh method stands for it otherwise).
    upgrades: list[str | None] = [None]
    if any(r.call is not None or r.llm is not None for r in rules):
        if any(r.call is not None for r in rules):
            methods.sort(key=lambda m: m != "POST")  # JSON-RPC calls are POSTed: shown first
        upgrades.append("websocket")
        if "GET" not in methods:
            methods.append("GET")
    if any(r.llm is not None for r in rules) and "POST" not in methods:
        # an LLM call is a POST (llmcall.recognise): named explicitly, as GET is above (the
        # fresh method stands for it otherwise, and is never judged as a call)
        methods.insert(0, "POST")
    queries = query_cells(rules)
    if queries is None:
        return ProofResult("narrower_than", claim, False, src, details=(
            f"not proved: the `query:` constraints of these identities name too many "
            f"parameter values (more than {MAX_QUERY_CELLS} combinations) for an exact proof",))
    # The JSON-RPC calls of rules with mcp:/jsonrpc: (sandgate.review.callproofs).
    calls = call_witnesses(rules)
    if calls is None:
        return ProofResult("narrower_than", claim, False, src, details=(
            "not proved: the mcp:/jsonrpc: globs of these identities are too many for an "
            "exact proof",))
    # The LLM calls that `llm:` rules tell apart (models, caps, an unreadable body).
    llm_calls: list[LlmWitness | None] = [None]
    if any(r.llm is not None for r in rules):
        got = llm_witnesses(rules)
        if got is None:
            return ProofResult("narrower_than", claim, False, src, details=(
                "not proved: the `llm.models` globs of these identities are too many for an "
                "exact proof",))
        llm_calls += got
    tunnel_memo: dict[tuple[str, str, int], Rule | None] = {}

    def tunnels(ident: str, scheme: str, host: str, port: int) -> Rule | None:
        """The passthrough rule that tunnels https requests to host:port (decide_request's
        first step), or None."""
        if scheme != "https":
            return None
        key = (ident, host, port)
        if key not in tunnel_memo:
            c = decide_connect(policy, ident, host, port)
            tunnel_memo[key] = c.rule if c.tunnel else None
        return tunnel_memo[key]

    # Cells whose applicable rules look alike (paths, action, what they bind) share a search.
    memo: dict[tuple[object, ...], tuple[int, str] | None] = {}
    for scheme in schemes:
        for host in hosts:
            for port in ports:
                for method in methods:
                    for query in queries:
                        if tunnels(narrow, scheme, host, port) is not None:
                            continue  # tunnelled, never judged: proved as a CONNECT below
                        n_base = [r for r in n_ident.rules
                                  if applies(r, scheme, host, port, method, query)]
                        if not any(r.action == "allow" for r in n_base):
                            continue
                        # A tunnel is reach: the other identity's passthrough tunnel forwards
                        # any request on this host:port (with no secret, its private ranges).
                        o_tunnel = tunnels(other, scheme, host, port)
                        o_base = [o_tunnel] if o_tunnel is not None else [
                            r for r in o_ident.rules
                            if applies(r, scheme, host, port, method, query)]
                        for upgrade, call in itertools.product(
                                upgrades if method == "GET" else [None], calls):
                            n_app = acting(n_base, call, upgrade)
                            o_app = acting(o_base, call, upgrade)
                            if not any(r.action == "allow" for r in n_app):
                                continue
                            # a SigV4 scope may come from the host: compared per host then
                            signs = any(r.inject is not None and r.inject.sign is not None
                                        for r in (*n_app, *o_app))
                            # an LLM call is a POST on a rule with `llm:` (or a provider's
                            # host, whose calls only such a rule judges)
                            # host, whose calls only such a rule judges), or a message on
                            # a WebSocket an `llm: {websocket: true}` rule let open
                            judging = (upgrade == "websocket" or (
                                method == "POST" and upgrade is None)) and any(
                                r.llm is not None for r in (*n_app, *o_app))
                            for lw in llm_calls if judging else [None]:
                                key = (tuple(_shape(r) for r in n_app),
                                       (host,) if signs else (), tuple(_shape(r) for r in o_app),
                                       lw, KNOWN_HOSTS.get(host) if lw is not None else None,
                                       upgrade)
                                if key not in memo:
                                    memo[key] = _cell_gap(n_app, o_app, policy.secrets, host,
                                                          lw, policy.budgets, upgrade)
                                gap = memo[key]
                                if gap is not None:
                                    shown_query = involved_query(query, rules, scheme, host,
                                                                 port, method)
                                    return _l7_counterexample(
                                        policy, narrow, other, claim, src, scheme, host, port,
                                        method, n_app[gap[0]], gap[1], shown_query, call,
                                        upgrade, lw)

    # CONNECT: every tunnel decide_connect() passes through without interception.
    for host in hosts:
        for port in sorted({p for r in rules if "https" in r.schemes for p in r.ports}):
            dn = decide_connect(policy, narrow, host, port)
            if not dn.tunnel or dn.rule is None:
                continue
            do = decide_connect(policy, other, host, port)
            if do.tunnel and do.rule is not None:
                if cidrs_covered(dn.rule.private_cidrs, do.rule.private_cidrs):
                    continue
                why = _why_incompatible(narrow, dn.rule, other, do.rule)
            elif do.allowed:
                why = f"{other} does not pass it through: {do.reason}"
            else:
                why = f"{other} refuses it: {do.reason}"
            return ProofResult("narrower_than", claim, False, src,
                               counterexample=f"CONNECT {url_host(host)}:{port}",
                               details=(f"{narrow}: {dn.reason}", why))
    # DNS: every query type beyond A/AAAA the policy DNS answers for this identity, it answers
    # for the other (A/AAAA follow the requests above); decide_name is the resolver's own.
    types = sorted({t for r in rules for t in r.dns_types})
    for host in hosts if types else []:
        if parse_ip_literal(host) is not None:
            continue
        for qtype in types:
            dn = decide_name(policy, narrow, host, qtype)
            if not dn.allowed:
                continue
            do = decide_name(policy, other, host, qtype)
            if not do.allowed:
                return ProofResult("narrower_than", claim, False, src,
                                   counterexample=f"DNS {qtype} {host}",
                                   details=(f"{narrow}: {dn.reason}", f"{other}: {do.reason}"))
    return ProofResult("narrower_than", claim, True, src)


def _l7_counterexample(policy: Policy, narrow: str, other: str, claim: str, src: Source | None,
                       scheme: str, host: str, port: int, method: str, rule: Rule,
                       path: str, query: QueryCell = (), call: Call | None = None,
                       upgrade: str | None = None, llm: LlmWitness | None = None
                       ) -> ProofResult:
    raw = raw_path(path)
    req = RequestInfo(scheme, host, port, method, raw, query)
    qs = f"?{query_string(query)}" if query else ""
    url = f"{scheme}://{url_host(host)}:{port}{raw}{qs}"
    if parse_url(method, url) != req:
        raise ProofError(f"counter-example {method} {url} does not parse back to itself")
    req = dataclasses.replace(req, upgrade=upgrade)
    judged = None if call is NOT_A_CALL else call
    dn, nj = judged_as_llm(policy, narrow, req, judged, llm)
    do, oj = judged_as_llm(policy, other, req, judged, llm)
    if upgrade is not None:
        url += " opening a WebSocket" + (" and sending a message" if call is not None else "")
    url += shown(call) + shown_witness(llm)
    _agree(passes(dn, call) and dn.rule == rule, f"{narrow} should allow {method} {url} by "
           f"rule '{rule.name}'", dn)
    if do.allowed and not passes(do, call):
        why = (f"{other} refuses it (400 bad_request): a rule of {other} matching it judges "
               "calls (mcp:/jsonrpc:), and the body is not one")
    elif do.allowed:
        assert do.rule is not None
        gap = llm_gap(rule, nj, do.rule, oj, llm, policy.budgets)
        _agree(gap is not None or not _compatible(rule, do.rule, policy.secrets, host),
               f"{other} should not allow {method} {url} with rule '{do.rule.name}'", do)
        why = (f"{other} allows it by rule '{do.rule.name}' ({do.rule.source}), but {gap}"
               if gap is not None and _compatible(rule, do.rule, policy.secrets, host)
               else _why_incompatible(narrow, rule, other, do.rule, policy.secrets, host))
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
    "GlobNfa",
    "ProofError",
    "ProofResult",
    "cidrs_covered",
    "find_path",
    "glob_nfa",
    "glob_regex",
    "host_witnesses",
    "is_normalised_path",
    "prove",
    "prove_narrower",
    "prove_secret_hosts",
    "query_cells",
    "query_string",
    "raw_path",
]
