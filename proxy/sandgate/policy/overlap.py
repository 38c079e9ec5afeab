"""Rule geometry: which rules can match the same request, which rule hides another.

Every answer here is sound: "covers" is said only when every request one rule matches is
matched by the other (so a load error built on it is never a false alarm); "overlap" is said
when some request (or CONNECT) can match both. Used by the loader's soundness checks and by
`sandgate lint`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from sandgate.policy.llmproofs import caps_cover, models_cover
from sandgate.policy.model import HostPattern, LlmRule, Rule
from sandgate.policy.paths import DOUBLE_STAR, PathPattern, match_segments

Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]


def host_covers(a: HostPattern, b: HostPattern) -> bool:
    """Every host `b` matches, `a` matches too."""
    if not a.wildcard:
        return not b.wildcard and a.suffix == b.suffix
    if not b.wildcard:
        return a.matches(b.suffix)
    return b.suffix.endswith(a.suffix)


def hosts_overlap(a: HostPattern, b: HostPattern) -> bool:
    """Some host matches both (exact/exact equal, wildcard covering exact, nested wildcards)."""
    return host_covers(a, b) or host_covers(b, a)


def first_host_overlap(r1: Rule, r2: Rule) -> tuple[HostPattern, HostPattern] | None:
    for a in r1.hosts:
        for b in r2.hosts:
            if hosts_overlap(a, b):
                return a, b
    return None


def _seg_covers(e: str, s: str) -> bool:
    if e == s:
        return True
    if "*" not in e:
        return False
    if e == "*":
        return s != "" and s != DOUBLE_STAR  # any non-empty single segment
    # a partial glob covers a literal it matches; glob against glob only when equal
    return "*" not in s and match_segments((e,), "/" + s)


def path_covers(e: PathPattern, s: PathPattern) -> bool:
    """Every path `s` matches, `e` matches too (sound, not complete)."""
    es, ss = e.segments, s.segments

    @functools.cache
    def cov(i: int, j: int) -> bool:
        if i == len(es):
            return j == len(ss)
        if es[i] == DOUBLE_STAR:
            return cov(i + 1, j) or (j < len(ss) and cov(i, j + 1))
        if j == len(ss) or ss[j] == DOUBLE_STAR:
            return False
        return _seg_covers(es[i], ss[j]) and cov(i + 1, j + 1)

    return cov(0, 0)


def signed_covers(earlier: Rule, later: Rule) -> bool:
    """Of what a SigV4 signature covers (sandgate.secrets.aws_request), does `earlier` accept
    everything `later` accepts? A signing rule refuses what no rule signs (presigned
    parameters, unknown x-amz-* headers), so it never covers a rule that does not sign; its
    `operations:` and `copy_sources:` must cover the later rule's (sound, not complete)."""
    if earlier.inject is None or earlier.inject.sign is None:
        return True
    if later.inject is None or later.inject.sign is None:
        return False
    if earlier.operations is not None and (
            later.operations is None or not set(later.operations) <= set(earlier.operations)):
        return False
    if later.copy_sources is None:
        return True
    return earlier.copy_sources is not None and all(
        any(path_covers(e, s) for e in earlier.copy_sources) for s in later.copy_sources)


def llm_covers(earlier: LlmRule | None, later: LlmRule | None) -> bool:
    """Does `earlier`'s `llm:` let through every LLM call `later`'s does? Model globs are
    compared exactly (sandgate.policy.llmproofs); a refused cap is covered by a refused cap at
    least as large (a lowering rule lets every cap through)."""
    refuses_caps = earlier is not None and earlier.max_tokens is not None and (
        earlier.on_max_tokens == "refuse")
    if earlier is None or (earlier.models is None and not refuses_caps):
        return True
    if later is None or later.api != earlier.api:
        return False  # calls it does not recognise: judged by neither
    return models_cover(earlier.models, later.models) and caps_cover(earlier, later)


def covers(earlier: Rule, later: Rule) -> bool:
    """Does `earlier` match every inspected request that `later` matches?"""
    if earlier.passthrough or later.passthrough:
        return False
    if not signed_covers(earlier, later):
        return False
    if not (later.schemes <= earlier.schemes and later.ports <= earlier.ports):
        return False
    if earlier.call is not None and earlier.call != later.call:
        return False  # it matches only the JSON-RPC calls its mcp:/jsonrpc: allows
    if later.call is not None and (later.call.deny_methods or later.call.deny_tools):
        return False  # its deny entries refuse calls whichever rule decides
    if not llm_covers(earlier.llm, later.llm):
        return False  # it matches only the LLM calls its llm: lets through
    if earlier.methods is not None and (later.methods is None
                                        or not later.methods <= earlier.methods):
        return False
    if not all(any(host_covers(a, b) for a in earlier.hosts) for b in later.hosts):
        return False
    # earlier's query constraints must each hold wherever later's hold
    later_q = dict(later.query)
    for name, values in earlier.query:
        if name not in later_q or not later_q[name] <= values:
            return False
    # optional: wherever later matches, the parameter is missing or one of earlier's values
    later_opt = dict(later.query_optional)
    for name, values in earlier.query_optional:
        if name in later.query_absent:
            continue
        got = later_q.get(name, later_opt.get(name))
        if got is None or not got <= values:
            return False
    if not earlier.query_absent <= later.query_absent:
        return False
    if earlier.paths is None:
        return True
    if later.paths is None:
        return False
    return all(any(path_covers(e, s) for e in earlier.paths) for s in later.paths)


def shadowing_rule(rules: Sequence[Rule], index: int) -> Rule | None:
    """The earlier allow rule that takes every request rules[index] would allow, if any.

    The first matching allow rule wins, so such a rule hides rules[index] completely. Ask rules
    (`action: ask`) win over allow rules wherever they are, so they are compared only with each
    other here (sandgate.review.lint_ask says what an ask rule hides)."""
    later = rules[index]
    if later.action != "allow":
        return None
    for r in rules[:index]:
        if r.action == "allow" and (r.ask is None) == (later.ask is None) and covers(r, later):
            return r
    return None


def _line(r: Rule, here: Rule) -> str:
    """Where rule `r` is, as seen from the message about rule `here`."""
    return f"line {r.source.line}" if r.source.file == here.source.file else str(r.source)


def check_identity(identity: str, rules: Sequence[Rule],
                   report: Callable[[int, Loc, str, str], None]) -> None:
    """Load errors for rule combinations whose behaviour `check` would misstate. `rules` are
    the identity's rules in decision order; report(index, sub-location, message, fix)."""
    for i, a in enumerate(rules):
        if a.action != "allow" or not a.passthrough:
            continue
        for b in rules:
            if b.action != "allow" or b.passthrough or "https" not in b.schemes:
                continue
            ports = a.ports & b.ports
            hosts = first_host_overlap(a, b)
            if not ports or hosts is None:
                continue
            report(i, ("passthrough",),
                   f"passthrough rule '{a.name}' and intercepted allow rule '{b.name}' "
                   f"({_line(b, a)}) both reach {hosts[0].text} / {hosts[1].text} on port "
                   f"{min(ports)}: the proxy tunnels the CONNECT without interception, so the "
                   f"limits of rule '{b.name}' (methods, paths, query, injection) never apply "
                   "there, while `check` and `explain` judge requests by them",
                   f"give the passthrough rule hosts or ports that no intercepted allow rule of "
                   f"identity '{identity}' reaches, or drop `passthrough` and limit it with "
                   "methods/paths")
    for k, r in enumerate(rules):
        if not r.secrets:
            continue
        hider = shadowing_rule(rules, k)
        if hider is None:
            continue
        report(k, (),
               f"rule '{r.name}' never applies: earlier allow rule '{hider.name}' "
               f"({_line(hider, r)}) matches every request it matches (the first matching "
               f"allow rule wins), so its secrets {', '.join(sorted(r.secrets))} are never "
               "injected",
               f"move rule '{r.name}' above rule '{hider.name}', or narrow '{hider.name}' "
               "(hosts, methods, paths, query) so it no longer covers it")


def deny_reaches(deny: Rule, allow: Rule) -> bool:
    """Can `deny` refuse something `allow` would let through (a request, or the tunnel)?"""
    if allow.action != "allow" or not deny.ports & allow.ports:
        return False
    if not deny.schemes & allow.schemes:
        return False
    if first_host_overlap(deny, allow) is None:
        return False
    if allow.passthrough:  # the deny rule refuses (or forces interception of) the tunnel
        return True
    return allow.methods is None or deny.methods is None or bool(deny.methods & allow.methods)
