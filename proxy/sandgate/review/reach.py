"""Exact searches over what rules match, for lint and the reach diff.

The proofs (sandgate.review.proofs) cut the request space into finitely many cells that every
rule treats alike (scheme, a host witness per host class, port, method, query cell) and search
the paths of each cell with a product automaton. `find_request` exposes that machinery for any
question of the form "is there a request on which these rules match in this combination?",
e.g. "a path the allow rule matches, the deny rule's trailing-slash variant matches, and the
deny rule itself does not". The answer is a concrete request (re-checked by matching it against
the rules directly) or None, which is a proof that none exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandgate.policy.model import Rule
from sandgate.review.proofs import (
    applies,
    decider,
    find_path,
    fresh_method,
    glob_nfa,
    host_witnesses,
    query_cells,
    query_string,
    raw_path,
    url_host,
)

Vector = Sequence[bool]

# decide() on a membership vector: the index of the deciding allow rule, or None when a deny rule
# matches or no allow rule does (the proofs' own, so the two cannot drift apart).


@dataclass(frozen=True, slots=True)
class Witness:
    """One concrete request: what a search found."""

    scheme: str
    host: str
    port: int
    method: str
    path: str  # normalised
    query: tuple[tuple[str, str], ...]

    @property
    def url(self) -> str:
        qs = f"?{query_string(self.query)}" if self.query else ""
        return f"{self.scheme}://{url_host(self.host)}:{self.port}{raw_path(self.path)}{qs}"

    def __str__(self) -> str:
        return f"{self.method} {self.url}"


def matches(rule: Rule, w: Witness) -> bool:
    """Does `rule` match the witness (decision._l7_matches on the normalised path)?"""
    return (applies(rule, w.scheme, w.host, w.port, w.method, w.query)
            and (rule.paths is None or glob_nfa(rule.paths).matches(w.path)))


def cells(rules: Sequence[Rule], methods: Sequence[str] | None = None,
          required: Sequence[int] = ()
          ) -> list[tuple[str, str, int, str, tuple[tuple[str, str], ...]]]:
    """Every (scheme, host, port, method, query) cell the rules can tell apart; with
    `required`, only the cells where each of those rules applies (by everything but the path)."""
    need = [rules[i] for i in required]
    hosts = [h for h in host_witnesses(p for r in rules for p in r.hosts)
             if all(r.matches_host(h) for r in need)]
    schemes = sorted({s for r in rules for s in r.schemes if all(s in n.schemes for n in need)})
    ports = sorted({p for r in rules for p in r.ports if all(p in n.ports for n in need)})
    if methods is None:
        named = {m for r in rules if r.methods is not None for m in r.methods}
        methods = [*sorted(named), fresh_method(named)]
    methods = [m for m in methods if all(n.methods is None or m in n.methods for n in need)]
    if not (hosts and schemes and ports and methods) or any(n.passthrough for n in need):
        return []
    queries = query_cells(rules) or [()]
    return [(s, h, p, m, q) for s in schemes for h in hosts for p in ports for m in methods
            for q in queries]


def find_request(rules: Sequence[Rule], pred: Callable[[Vector], bool],
                 methods: Sequence[str] | None = None,
                 required: Sequence[int] = ()) -> Witness | None:
    """A request whose vector of "rule i matches it" satisfies `pred`, or None when there is
    none (exact: every cell, and every normalised path in it, is searched). `required`: rules
    that must match for `pred` to hold (only the cells where they apply are searched)."""
    memo: dict[tuple[bool, ...], str | None] = {}
    for scheme, host, port, method, query in cells(rules, methods, required):
        app = tuple(applies(r, scheme, host, port, method, query) for r in rules)
        if app not in memo:
            memo[app] = path_search(rules, app, pred)
        path = memo[app]
        if path is not None:
            w = Witness(scheme, host, port, method, path, query)
            if not pred([matches(r, w) for r in rules]):  # the search and matching disagree
                raise AssertionError(f"reach search witness {w} does not satisfy its predicate")
            return w
    return None


def path_search(rules: Sequence[Rule], app: Sequence[bool],
                pred: Callable[[Vector], bool]) -> str | None:
    """find_path over the rules that apply in a cell (the others match no path there): the
    product automaton holds only those."""
    idx = [i for i, a in enumerate(app) if a]

    def masked(vec: Vector) -> bool:
        full = [False] * len(rules)
        for i, m in zip(idx, vec, strict=True):
            full[i] = m
        return pred(full)
    return find_path([rules[i].paths for i in idx], masked)


__all__ = ["Witness", "cells", "decider", "find_request", "matches"]
