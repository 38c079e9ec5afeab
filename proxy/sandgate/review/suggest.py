"""`sandgate suggest`: a least-privilege policy written from recorded traffic.

From the `request` events of an audit log (sandgate.review.traffic), per identity:

- one rule per host (or collapsed wildcard), scheme, port, injected-secret set and group of
  methods that share the same paths; schemes, ports and methods exactly as recorded;
- hosts exact; `*.D` only when 3+ sibling hosts `x.D` were seen and D is neither a public
  suffix nor above one (sandgate.policy.suffixes); every host under a chosen D then joins it;
- paths: the normalised path as the proxy judges it, collapsed only where the traffic says so:
  an id-like segment (8+ hex digits with a digit, or a UUID) becomes `*`; a segment that takes
  3+ distinct values across paths otherwise equal becomes `*`; a segment the path-glob syntax
  cannot spell (`*`, `?`, `#`, `%`, `\\`) becomes `*`. `/**` only with collapse_deep (3+
  distinct paths under one first segment become `/<longest common prefix>/**`), never `/**`
  at the root;
- no secret is invented: `# injected: NAME` marks a rule whose recorded requests carried one,
  for a human to wire up; a non-public address the proxy dialled for a rule becomes that
  address alone in `private_cidrs` (it was reachable only because a rule named it);
- a `tests:` fixture (expect: allow) per distinct recorded request, and one per recorded
  CONNECT the suggested rules cover.

Only traffic that went out is granted: `allow` and `report` events (with include_refused also
the policy's own refusals, `no_rule` and `denied_by_rule`). Everything left out is listed in
`Suggestion.notes`, and written as comments at the end of the file. The output is sorted and
deterministic.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from sandgate.netguard import classify, parse_ip_literal, unmap
from sandgate.policy.compiler import NAME_RE, REGISTERED_METHODS
from sandgate.policy.paths import match_segments, normalise_path
from sandgate.policy.suffixes import overbroad_wildcard
from sandgate.request import default_port, parse_url
from sandgate.review.traffic import AuditTraffic, Recorded

GRANTED = frozenset({"allow", "report"})
REFUSED_BY_RULES = frozenset({"no_rule", "denied_by_rule"})
MIN_SIBLINGS = 3  # distinct hosts x.D before *.D
MIN_VARIANTS = 3  # distinct values of one segment, the rest equal, before `*`
MIN_DEEP = 3  # distinct paths under one first segment before `/<prefix>/**`

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_HEXID = re.compile(r"[0-9a-fA-F]{8,}")
_UNSPELLABLE = re.compile(r"[*?#%\\]")


def id_like(segment: str) -> bool:
    """A long identifier: a UUID, or 8+ hex digits of which at least one is a digit (so all-
    digit ids of 8+ digits too; words such as `deadbeef` stay)."""
    return bool(_UUID.fullmatch(segment) or (
        _HEXID.fullmatch(segment) and any(c.isdigit() for c in segment)))


# --- paths -----------------------------------------------------------------------------------

Segs = tuple[str, ...]


def _segments(normalised: str) -> Segs:
    return tuple(normalised[1:].split("/"))


def _text(segs: Segs) -> str:
    return "/" + "/".join(segs)


def collapse_paths(paths: Iterable[str], deep: bool = False) -> list[str]:
    """Normalised request paths -> sorted path globs that match every one of them."""
    shapes: set[Segs] = set()
    for p in paths:
        segs = _segments(p)
        shapes.add(tuple(
            "*" if s and (id_like(s) or _UNSPELLABLE.search(s)) else s for s in segs))
    changed = True
    while changed:
        changed = False
        for length in sorted({len(s) for s in shapes}):
            for i in range(length):
                groups: dict[Segs, set[str]] = defaultdict(set)
                for s in shapes:
                    if len(s) == length:
                        groups[s[:i] + s[i + 1:]].add(s[i])
                for rest, values in sorted(groups.items()):
                    # An empty last segment is the trailing slash, not a value.
                    vals = {v for v in values if v not in ("", "*")}
                    if len(vals) < MIN_VARIANTS:
                        continue
                    for v in vals:
                        shapes.discard((*rest[:i], v, *rest[i:]))
                    shapes.add((*rest[:i], "*", *rest[i:]))
                    changed = True
    if deep:
        by_first: dict[str, set[Segs]] = defaultdict(set)
        for s in shapes:
            if len(s) >= 2 and s[0] not in ("", "*"):
                by_first[s[0]].add(s)
        for _first, group in sorted(by_first.items()):
            if len(group) < MIN_DEEP:
                continue
            prefix = _common_prefix(group)
            for s in group:
                shapes.discard(s)
            shapes.add((*prefix, "**"))
    # A shape another one covers adds nothing (`/items/a` next to `/items/*`).
    kept = [s for s in shapes
            if not any(t != s and match_segments(t, _text(s)) for t in shapes)]
    return sorted(_text(s) for s in kept)


def _common_prefix(group: Collection[Segs]) -> Segs:
    """The longest prefix all share, at least one segment, never covering a last segment."""
    first = min(group)
    n = min(len(s) for s in group) - 1
    k = 0
    while k < n and all(s[k] == first[k] for s in group):
        k += 1
    return first[:max(k, 1)]


# --- hosts -----------------------------------------------------------------------------------


def collapse_hosts(hosts: Iterable[str]) -> dict[str, str]:
    """host -> the pattern it falls under: itself, or `*.D` when 3+ sibling hosts `x.D` were
    seen and `*.D` does not span public suffixes. Every host under a chosen D maps to the
    broadest chosen wildcard covering it; the apex D itself stays exact."""
    hs = sorted(set(hosts))
    siblings: dict[str, set[str]] = defaultdict(set)
    for h in hs:
        if parse_ip_literal(h) is not None or h.count(".") < 2:
            continue
        parent = h.split(".", 1)[1]
        siblings[parent].add(h)
    chosen = sorted((d for d, kids in siblings.items()
                     if len(kids) >= MIN_SIBLINGS and overbroad_wildcard(d) is None),
                    key=lambda d: (d.count("."), d))
    out: dict[str, str] = {}
    for h in hs:
        out[h] = h
        if parse_ip_literal(h) is not None:
            continue
        for d in chosen:  # broadest first
            if h.endswith("." + d):
                out[h] = f"*.{d}"
                break
    return out


# --- the policy ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Req:
    rec: Recorded
    scheme: str
    host: str
    port: int
    method: str
    path: str  # normalised
    url: str  # for the fixture: scheme://host[:port]/raw-path


@dataclass(slots=True)
class SuggestedRule:
    name: str
    host: str  # an exact host or *.domain
    scheme: str
    port: int
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    secrets: tuple[str, ...]  # recorded as injected: a comment, never an inject block
    private_cidrs: tuple[str, ...]
    recorded: int  # requests it covers


@dataclass(slots=True)
class Suggestion:
    rules: dict[str, list[SuggestedRule]] = field(default_factory=dict)  # identity -> rules
    tests: list[tuple[str, str]] = field(default_factory=list)  # (identity, "METHOD URL")
    notes: list[str] = field(default_factory=list)  # what was left out, and why
    used: int = 0  # recorded requests granted

    def yaml(self, source: str = "an audit log") -> str:
        return render(self, source)


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s or "rule"


def suggest(traffic: AuditTraffic, identities: Collection[str] | None = None,
            collapse_deep: bool = False, include_refused: bool = False) -> Suggestion:
    out = Suggestion()
    for u in traffic.unreplayable:
        out.notes.append(f"line {u.line}: not used: {u.reason}")
    reqs: dict[str, list[_Req]] = defaultdict(list)
    connects: dict[str, list[Recorded]] = defaultdict(list)
    for rec in traffic.recorded:
        if identities is not None and rec.identity not in identities:
            continue
        why = _refuse(rec, include_refused)
        if why is not None:
            out.notes.append(f"line {rec.line}: not granted: {rec.identity} {rec.request_line}: "
                             f"{why}")
            continue
        if rec.connect:
            connects[rec.identity].append(rec)
            continue
        if not NAME_RE.fullmatch(rec.identity):
            out.notes.append(f"line {rec.line}: not granted: identity {rec.identity!r} is not a "
                             "valid policy identity name")
            continue
        if rec.method not in REGISTERED_METHODS:
            out.notes.append(f"line {rec.line}: not granted: {rec.identity} {rec.request_line}: "
                             f"method {rec.method} is not a registered HTTP method, and a rule "
                             "cannot name it")
            continue
        try:
            info = parse_url(rec.method, rec.target)
            path = normalise_path(info.path)
        except ValueError as e:
            out.notes.append(f"line {rec.line}: not granted: {rec.request_line}: {e}")
            continue
        reqs[rec.identity].append(_Req(rec, info.scheme, info.host, info.port, info.method,
                                       path, rec.target))
    for ident in sorted(reqs):
        rules = _rules_for(reqs[ident], collapse_deep)
        out.rules[ident] = rules
        out.used += len(reqs[ident])
        seen: set[str] = set()
        for r in reqs[ident]:
            line = f"{r.method} {_fixture_url(r)}"
            if line not in seen:
                seen.add(line)
                out.tests.append((ident, line))
    for ident in sorted(connects):
        rules = out.rules.get(ident, [])
        seen = set()
        for rec in connects[ident]:
            host, _, port = rec.target.rpartition(":")
            host = host.strip("[]")
            if any(r.scheme == "https" and r.port == int(port) and _host_matches(r.host, host)
                   for r in rules):
                line = f"CONNECT {rec.target}"
                if line not in seen:
                    seen.add(line)
                    out.tests.append((ident, line))
            else:
                out.notes.append(
                    f"line {rec.line}: not granted: {ident} CONNECT {rec.target}: no request "
                    "inside the tunnel was recorded (a passthrough tunnel, or one that carried "
                    "nothing); add a rule by hand if it is needed")
    out.tests.sort()
    out.notes.sort(key=lambda n: int(n.split(":", 1)[0].removeprefix("line ")))
    return out


def _refuse(rec: Recorded, include_refused: bool) -> str | None:
    if rec.decision in GRANTED:
        return None
    if include_refused and rec.decision == "deny" and rec.code in REFUSED_BY_RULES:
        return None
    return f"recorded as {rec.decision or 'no decision'}" + (f" ({rec.code})" if rec.code else "")


def _fixture_url(r: _Req) -> str:
    return r.url if r.port != default_port(r.scheme) else r.url.replace(f":{r.port}/", "/", 1)


def _host_matches(pattern: str, host: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def _private(dialed: str | None) -> str | None:
    """A non-public address the proxy dialled, as a one-address CIDR."""
    if not dialed:
        return None
    ip_text = dialed.rpartition(":")[0]
    try:
        ip = unmap(ipaddress.ip_address(ip_text))
    except ValueError:
        return None
    if classify(ip) is None:
        return None
    return f"{ip}/{ip.max_prefixlen}"


def _rules_for(reqs: Sequence[_Req], deep: bool) -> list[SuggestedRule]:
    pattern_of = collapse_hosts(r.host for r in reqs)
    # (host pattern, scheme, port, secrets) -> method -> normalised paths
    groups: dict[tuple[str, str, int, tuple[str, ...]], dict[str, set[str]]] = defaultdict(
        lambda: defaultdict(set))
    counts: dict[tuple[str, str, int, tuple[str, ...]], dict[str, int]] = defaultdict(
        lambda: defaultdict(int))
    cidrs: dict[tuple[str, str, int, tuple[str, ...]], set[str]] = defaultdict(set)
    for r in reqs:
        key = (pattern_of[r.host], r.scheme, r.port, r.rec.secrets)
        groups[key][r.method].add(r.path)
        counts[key][r.method] += 1
        p = _private(r.rec.dialed)
        if p is not None:
            cidrs[key].add(p)
        lit = parse_ip_literal(r.host)
        if lit is not None and classify(unmap(lit)) is not None:
            ip = unmap(lit)
            cidrs[key].add(f"{ip}/{ip.max_prefixlen}")
    rules: list[SuggestedRule] = []
    names: set[str] = set()
    # Rules that carry secrets first (the first matching allow rule decides what is injected).
    for key in sorted(groups, key=lambda k: (not k[3], k)):
        host, scheme, port, secrets = key
        by_paths: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for method, seen in groups[key].items():
            by_paths[tuple(collapse_paths(seen, deep))].append(method)
        for paths, methods in sorted(by_paths.items(), key=lambda kv: sorted(kv[1])):
            ms = tuple(sorted(methods))
            base = _slug(host.replace("*.", "any.", 1))
            if scheme != "https":
                base += f"-{scheme}"
            if port != default_port(scheme):
                base += f"-{port}"
            base += "-" + "-".join(m.lower() for m in ms)
            name, n = base, 2
            while name in names:
                name, n = f"{base}-{n}", n + 1
            names.add(name)
            rules.append(SuggestedRule(name, host, scheme, port, ms, paths, secrets,
                                       tuple(sorted(cidrs[key])),
                                       sum(counts[key][m] for m in ms)))
    return rules


# --- YAML ------------------------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9/][A-Za-z0-9/_.~-]*")
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"})


def scalar(text: str) -> str:
    """A YAML scalar for text: plain when that cannot be misread, else JSON-quoted (valid
    YAML double-quoted)."""
    if (_PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS
            and not re.fullmatch(r"[0-9._-]+", text)):
        return text
    return json.dumps(text, ensure_ascii=False)


def _flow(items: Iterable[str]) -> str:
    return "[" + ", ".join(scalar(i) for i in items) + "]"


def _one_line(text: str) -> str:
    """Recorded text inside a comment: no line break or control character may end it."""
    return re.sub(r"[\x00-\x1f\x7f\u2028\u2029\x85]", "?", text)


def render(s: Suggestion, source: str) -> str:
    lines = [
        f"# Suggested by `sandgate suggest` from {source}: {s.used} recorded request(s).",
        "# Least privilege: exactly the hosts, schemes, ports, methods and paths recorded, with",
        "# the collapses `sandgate suggest` documents. Review it, wire the credentials marked",
        "# `# injected:`, then `sandgate check` it.",
        "version: v1",
    ]
    if not s.rules:
        lines.append("identities: {}")
    else:
        lines.append("identities:")
    for ident in sorted(s.rules):
        lines.append(f"  {scalar(ident)}:")
        lines.append("    rules:")
        for r in s.rules[ident]:
            lines.append(f"      - name: {scalar(r.name)}  # {r.recorded} recorded request(s)")
            if r.secrets:
                lines.append(f"        # injected: {', '.join(r.secrets)}")
            lines.append(f"        hosts: {_flow([r.host])}")
            if r.scheme != "https":
                lines.append(f"        schemes: {_flow([r.scheme])}")
            if r.port != default_port(r.scheme):
                lines.append(f"        ports: [{r.port}]")
            lines.append(f"        methods: {_flow(r.methods)}")
            lines.append(f"        paths: {_flow(r.paths)}")
            if r.private_cidrs:
                lines.append("        # non-public address(es) the proxy dialled for these")
                lines.append(f"        private_cidrs: {_flow(r.private_cidrs)}")
    if s.tests:
        lines.append("tests:")
        for ident, req in s.tests:
            lines.append(f"  - {{identity: {scalar(ident)}, request: {scalar(req)}, "
                         "expect: allow}")
    else:
        lines.append("tests: []")
    if s.notes:
        lines.append("")
        lines.append(f"# Not granted ({len(s.notes)}):")
        lines += [f"#   {_one_line(n)}" for n in s.notes]
    return "\n".join(lines) + "\n"
