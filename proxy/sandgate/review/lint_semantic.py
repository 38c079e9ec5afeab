"""`sandgate lint`, semantic part: mistakes that change decisions while looking right.

Every check here is decided on the compiled rules with the exact search of
sandgate.review.reach (the proofs' cell and path-automaton machinery), not on the spelling of
a rule: a warning comes with a concrete request that shows it, and a check that cannot find
such a request stays silent. The classes:

* a deny that covers less than it looks (deny_gaps): the deny rule is compared with a wider
  variant of itself (`*` -> `**`, the trailing slash toggled, the allow rule's schemes and
  ports, HEAD beside GET, the apex beside `*.`-wildcards, subdomains under `public: true`); a
  request that the allow rule and the variant match but the deny rule does not is a gap.
  `;`-parameters (`/a/secret;x`, `/b/..;/admin`) are checked by building the spelling a Java
  server strips back to a denied path and matching it against both rules.
* rules that take each other's requests (overlaps): a request decided by an earlier allow rule
  that a later rule with other secrets was written for; a `query:`-constrained rule whose
  other values are allowed anyway by a later rule; a segment glob `acme*` that also matches
  `acme-evil`.
* over-broad grants (grants): metadata addresses in private_cidrs, private IP literals that
  the address step always refuses, wildcards in a secret's `hosts:`, files that widen an
  identity defined in another file (computed with the reach diff).
* proofs and fixtures that hold for the wrong reason, gateways that disagree with the rules,
  and query values that can never match as written (checks).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Sequence
from pathlib import Path

from sandgate.decision import decide_connect, judge
from sandgate.llm.llmcall import stated_call
from sandgate.netguard import classify, parse_ip_literal
from sandgate.policy.model import HostPattern, Identity, Policy, Rule
from sandgate.policy.overlap import deny_reaches, host_covers, signed_covers
from sandgate.policy.paths import DOUBLE_STAR, PathPattern
from sandgate.policy.suffixes import is_public_suffix
from sandgate.review.callproofs import common_call
from sandgate.review.finding import Finding
from sandgate.review.proofs import decider
from sandgate.review.reach import Witness, find_request, matches
from sandgate.review.typos import edits

Loc = tuple[str | int, ...]
# (code, file, loc, message, fix) -> Finding, with the line of loc in file
Make = Callable[[str, str, Loc, str, str], "Finding"]
# (code, file, line, field, message, fix) -> Finding
AtLine = Callable[[str, str, int, str, str, str], "Finding"]


def semantic_findings(policy: Policy, make: Make,
                      at_line: AtLine) -> list[Finding]:
    out: list[Finding] = []
    for ident in policy.identities.values():
        out += _deny_gaps(ident, make)
        out += _overlaps(ident, make)
        out += _grants(ident, make)
    fixture_names = {n.lower() for t in policy.tests for n in _query_names(t.url)}
    for ident in policy.identities.values():
        out += query_value_findings(ident, make, fixture_names)
    out += _widening_files(policy, make)
    out += _secret_hosts(policy, make)
    out += _proofs(policy, make)
    out += _fixtures(policy, at_line)
    out += _gateways(policy, at_line)
    return out


def _loc(r: Rule) -> Loc:
    return r.where or ("identities", r.identity, "rules")


def _pats(paths: Sequence[PathPattern] | None) -> str:
    return ", ".join(p.text for p in paths) if paths else "any path"


def _pattern(segs: Sequence[str]) -> PathPattern:
    return PathPattern(text="/" + "/".join(segs), segments=tuple(segs))


# --- a deny that covers less than it looks -----------------------------------------------------


def _path_variants(p: PathPattern) -> list[tuple[str, PathPattern]]:
    """What the author of a deny glob most likely meant as well, with the lint code: a last
    segment `*` as `**` (`/admin/*`: everything under /admin), and the path with and without
    its trailing slash (and the subtree under a trailing slash). A `*` inside the path is taken
    as written: it stands for one name (`/repos/*/*/hooks`: an owner, a repository), and
    `**` there would also deny other paths (`/repos/acme/hooks`, a repository named hooks)."""
    segs = list(p.segments)
    out: list[tuple[str, list[str]]] = []
    if segs and segs[-1] == "*":
        out.append(("deny-star-segment", [*segs[:-1], DOUBLE_STAR]))
    if segs and segs[-1] == "":
        out += [("deny-trailing-slash", segs[:-1]),
                ("deny-trailing-slash", [*segs[:-1], DOUBLE_STAR])]
    elif segs and segs[-1] != DOUBLE_STAR:
        out.append(("deny-trailing-slash", [*segs, ""]))
    return [(code, _pattern(v)) for code, v in out if v]


def _gap(allow: Rule, deny: Rule, wider: Rule) -> Witness | None:
    """A request the allow rule and the deny's wider variant match and the deny does not."""
    return find_request([allow, deny, wider], lambda v: v[0] and v[2] and not v[1],
                        required=(0, 2))


def _deny_gaps(ident: Identity, make: Make) -> list[Finding]:
    out: list[Finding] = []
    denies = [r for r in ident.rules if r.action == "deny"]
    allows = [r for r in ident.rules if r.action == "allow" and not r.passthrough]
    for d in denies:
        cut = False
        said: set[tuple[str, str]] = set()  # (field, code): one warning each, not one per allow
        for a in allows:
            if find_request([a, d], lambda v: v[0] and v[1], required=(0, 1)) is None:
                continue  # the deny never cuts this allow
            cut = True
            for f in _deny_gap_findings(d, a, make):
                if (f.field, f.code) not in said:
                    said.add((f.field, f.code))
                    out.append(f)
        coarse = [a for a in ident.rules if deny_reaches(d, a)]
        if not cut and coarse and not any(a.passthrough for a in coarse):
            a = coarse[0]
            out.append(make("deny-never-applies", d.source.file, _loc(d),
                            f"deny rule '{d.name}' never applies: allow rule '{a.name}' "
                            f"({a.source}) reaches its hosts, but no request an allow rule "
                            "lets through matches its paths and query, so deny-by-default "
                            "already refuses everything it names",
                            f"give it the paths of the allow rule it should cut (allow rule "
                            f"'{a.name}' has {_pats(a.paths)}), or remove it"))
    return out


def _other(d: Rule, a: Rule) -> str:
    return f"allow rule '{a.name}' ({a.source})"


def _deny_gap_findings(d: Rule, a: Rule, make: Make) -> list[Finding]:
    out: list[Finding] = []
    loc = _loc(d)

    def add(code: str, sub: Loc, message: str, fix: str) -> None:
        out.append(make(code, d.source.file, (*loc, *sub), message, fix))

    # paths: `*` where `**` was meant, the trailing slash
    if d.paths is not None:
        for j, p in enumerate(d.paths):
            for code, v in _path_variants(p):
                w = _gap(a, d, dataclasses.replace(d, paths=(v,)))
                if w is not None:
                    add(code, ("paths", j), f"deny rule '{d.name}' path {p.text} does not match "
                        f"{w.path}, which {_other(d, a)} lets through (e.g. {w}); a deny glob "
                        "matches exactly: `*` is one segment, a trailing slash is part of "
                        "the path",
                        f"add {v.text} to the deny rule's paths")
                    break
    # schemes and ports of the allow rule the deny does not name
    wider = dataclasses.replace(d, schemes=d.schemes | a.schemes, ports=d.ports | a.ports)
    w = _gap(a, d, wider)
    if w is not None:
        add("deny-ports",
            (), f"deny rule '{d.name}' covers schemes {', '.join(sorted(d.schemes))} and "
            f"ports {', '.join(map(str, sorted(d.ports)))} only, while {_other(d, a)} also "
            f"allows {w.scheme} on port {w.port}: e.g. {w} passes",
            f"give the deny rule `schemes: [{', '.join(sorted(d.schemes | a.schemes))}]` and "
            f"`ports: [{', '.join(map(str, sorted(d.ports | a.ports)))}]`")
    # GET and HEAD read the same resource
    if d.methods is not None:
        pair = {m for m in ("GET", "HEAD") if m in d.methods}
        if len(pair) == 1:
            missing = "HEAD" if "GET" in pair else "GET"
            w = _gap(a, d, dataclasses.replace(d, methods=d.methods | {missing}))
            if w is not None:
                add("deny-get-head",
                    ("methods",), f"deny rule '{d.name}' denies {next(iter(pair))} but not "
                    f"{missing}, which {_other(d, a)} lets through to the same resource "
                    f"(e.g. {w}): {missing} reads its headers (and existence) just the same",
                    f"add {missing} to the deny rule's methods")
    # hosts: the apex beside a `*.` wildcard; subdomains and addresses under `public: true`
    # (a wildcard over a pseudo-TLD such as `*.internal` has no apex anyone could serve)
    apexes = tuple(HostPattern(p.suffix[1:], False, p.suffix[1:])
                   for p in d.hosts
                   if p.wildcard and p.suffix and not is_public_suffix(p.suffix[1:]))
    if apexes:
        w = _gap(a, d, dataclasses.replace(d, hosts=d.hosts + apexes))
        if w is not None:
            add("deny-apex",
                ("hosts",), f"deny rule '{d.name}' wildcard does not match the apex {w.host} "
                f"(`*.` needs at least one more label), which {_other(d, a)} allows: e.g. {w}",
                f"add {w.host} to the deny rule's hosts")
    # Names served from public addresses; a wildcard over a pseudo-TLD (`*.internal`) names
    # hosts that resolve to non-public addresses, which `public: true` refuses anyway.
    names = [p for p in d.hosts if parse_ip_literal(p.suffix) is None
             and not (p.wildcard and is_public_suffix(p.suffix[1:]))]
    # Only a gap the policy can close is reported: with `evil.example` and `*.evil.example`
    # denied, the deny is as good as names get (its servers' addresses, written as IP
    # literals, pass any name-based deny: docs/policy-review.md), and the policy lint-clean.
    if a.public and names:
        subs = tuple(HostPattern(f"*.{p.suffix}", True, f".{p.suffix}") for p in names
                     if not p.wildcard)
        w = _gap(a, d, dataclasses.replace(d, hosts=d.hosts + subs)) if subs else None
        if w is not None:
            add("deny-under-public", ("hosts",), f"deny rule '{d.name}' names "
                f"{', '.join(p.text for p in names)}, but not its subdomains, which "
                f"`public: true` rule '{a.name}' ({a.source}) reaches: e.g. {w} passes",
                f"add {', '.join(f'*.{p.suffix}' for p in names if not p.wildcard)} to the "
                "deny rule's hosts (a name-based deny cannot stop the same servers reached "
                "by IP address: name the allowed hosts instead of `public: true` where that "
                "matters)")
    _matrix_findings(d, a, add)
    return out


def _with_params(path: str) -> list[str]:
    """`;`-parameter spellings of a path that Java servers (Tomcat, Jetty, Spring) strip back
    to it: `/a/secret;x`, `/a;x/secret`."""
    segs = path.strip("/").split("/")
    out = []
    for i in range(len(segs)):
        if segs[i]:
            out.append("/" + "/".join([*segs[:i], segs[i] + ";x", *segs[i + 1:]])
                       + ("/" if path.endswith("/") and len(path) > 1 else ""))
    return out


# Servers known not to strip `;` path parameters (none of them is a Java servlet container):
# `/repos/acme/x;y` is another repository there, not `/repos/acme/x`.
NOT_JAVA_HOSTS = frozenset({
    "github.com", "api.github.com", "uploads.github.com", "raw.githubusercontent.com",
    "codeload.github.com", "objects.githubusercontent.com", "api.openai.com",
    "api.anthropic.com", "pypi.org", "files.pythonhosted.org", "registry.npmjs.org"})


def _matrix_findings(d: Rule, a: Rule, add: Callable[[str, Loc, str, str], None]) -> None:
    # The trick only works on a server that drops `;`-parameters (Tomcat, Jetty, Spring): not
    # on the well-known APIs above; elsewhere the warning says when it matters.
    if d.paths is None or all(not p.wildcard and p.suffix in NOT_JAVA_HOSTS for p in d.hosts):
        return None
    # Only denies of a path (not of a `/**` subtree): a subtree deny is taken as written for
    # the spellings its own server serves; `/admin/**` draws no warning here (documented).
    ends = tuple(p for p in d.paths if p.segments[-1:] != (DOUBLE_STAR,))
    if not ends:
        return None
    both = find_request([a, dataclasses.replace(d, paths=ends)], lambda v: v[0] and v[1],
                        required=(0, 1))
    if both is None:
        return None

    def check(path: str) -> bool:
        w = dataclasses.replace(both, path=path)
        return matches(a, w) and not matches(d, w)

    cands = _with_params(both.path)
    hit = next((p for p in cands if check(p)), None)
    if hit is not None:
        add("java-path-params",
            ("paths",), f"deny rule '{d.name}' matches {both.path} but not {hit}, which "
            f"{_other(d, a)} lets through; Java servers (Tomcat, Jetty, Spring) drop "
            f"`;`-parameters and serve {hit} as {both.path}",
            "if the server is a Java servlet container, also deny every path with a `;` in a "
            "segment: paths: ['/**/*;*/**']; if it is not, say so: `lint: {ignore: "
            "[java-path-params], why: ...}` on the deny rule")
        return None
    # `/<allowed prefix>/..;/<denied path>`: the server resolves `..;` as `..`
    allowed = find_request([a], lambda v: v[0], required=(0,))
    prefixes = [""]
    if allowed is not None:
        segs = allowed.path.strip("/").split("/")
        prefixes += ["/" + "/".join(segs[:k]) for k in range(1, len(segs) + 1)]
    for pre in prefixes:
        path = f"{pre}/..;{both.path}"
        if check(path):
            add("java-path-params",
                ("paths",), f"deny rule '{d.name}' matches {both.path} but not {path}, which "
                f"{_other(d, a)} lets through; Java servers resolve `..;` as `..` and serve "
                f"it as {both.path}",
                "if the server is a Java servlet container, also deny every path with a `;` "
                "in a segment: paths: ['/**/*;*/**']; if it is not, say so: `lint: {ignore: "
                "[java-path-params], why: ...}` on the deny rule")
            return None
    return None


# --- rules that take each other's requests ------------------------------------------------------


def _overlaps(ident: Identity, make: Make) -> list[Finding]:
    out: list[Finding] = []
    rules = list(ident.rules)
    for j, b in enumerate(rules):
        if b.action != "allow" or b.passthrough:
            continue
        # an earlier rule with other secrets decides some requests `b` was written for
        if b.secrets:
            for i, a in enumerate(rules[:j]):
                if a.action != "allow" or a.passthrough or a.secrets == b.secrets:
                    continue
                call = common_call(a, b)
                if call is None:
                    continue  # mcp:/jsonrpc: with no call in common: each decides its own
                if not signed_covers(a, b):
                    continue  # `a` signs other operations or sources: each decides its own
                if find_request([a, b], lambda v: v[0] and not v[1], required=(0,)) is None:
                    continue  # `a` is the specific rule in front of a general one
                w = find_request(rules, decides_while_matching(rules, i, j), required=(i, j))
                if w is None:
                    continue
                out.append(make("overlap-secrets", b.source.file, _loc(b),
                                f"earlier allow rule '{a.name}' ({a.source}) also matches part "
                                f"of what rule '{b.name}' was written for and decides it (the "
                                f"first matching allow rule wins): e.g. {w}{call} is sent with "
                                f"{_names(a.secrets)} instead of {_names(b.secrets)}",
                                f"make the two rules disjoint (methods, paths, query), e.g. "
                                f"narrow '{a.name}' so it no longer matches {w.method} "
                                f"{w.path}, or move '{b.name}' above it"))
                break
        # a `query:` rule whose other values a later rule allows anyway
        if b.query:
            loose = dataclasses.replace(b, query=())
            ext = [*rules, loose]
            w = find_request(ext, _other_values_pass(rules, j, {n for n, _ in b.query}),
                             required=(len(rules),))
            if w is not None:
                later = rules[decider(rules, [matches(r, w) for r in rules]) or 0]
                names = ", ".join(n for n, _ in b.query)
                out.append(make("query-catch-all", b.source.file, (*_loc(b), "query"),
                                f"rule '{b.name}' allows only some values of {names}, but "
                                f"later allow rule '{later.name}' ({later.source}) allows the "
                                f"same requests with any other value: e.g. {w} passes"
                                + (f" (with {_names(later.secrets)})" if later.secrets else
                                   " (without this rule's secrets)"),
                                f"limit '{later.name}' (paths, methods) so it does not cover "
                                f"'{b.name}', or give it the same `query:`"))
        for pj, p in enumerate(b.paths or ()):
            for seg in p.segments:
                leak = _prefix_glob_leak(seg)
                if leak is not None:
                    out.append(make("prefix-glob", b.source.file, (*_loc(b), "paths", pj),
                                    f"path glob {p.text} of rule '{b.name}' matches segment "
                                    f"{leak!r} too: `{seg}` is any text "
                                    f"{'after' if seg.endswith('*') else 'before'} "
                                    f"{seg.strip('*')!r}, not a name boundary",
                                    f"write the exact segment ({seg.strip('*')}), or mark the "
                                    f"boundary: {seg.strip('*')}-*"))
                    break
    return out


def decides_while_matching(rules: Sequence[Rule], i: int,
                           j: int) -> Callable[[Sequence[bool]], bool]:
    """Predicate: rule i decides the request (decision order) and rule j matches it too."""
    def pred(v: Sequence[bool]) -> bool:
        return decider(rules, v) == i and v[j]
    return pred


def _other_values_pass(rules: Sequence[Rule], j: int,
                       names: set[str]) -> Callable[[Sequence[bool]], bool]:
    """Predicate over rules + [rule j without its query]: the loosened rule matches, rule j
    does not (another value), and a later allow rule that does not constrain those names
    decides it."""
    k = len(rules)

    def pred(v: Sequence[bool]) -> bool:
        d = decider(rules, v[:k])
        return (v[k] and not v[j] and d is not None and d > j
                and not names & {n for n, _ in rules[d].query})
    return pred


def _prefix_glob_leak(seg: str) -> str | None:
    """`acme*` -> "acme-evil", `*acme` -> "evil-acme": a glob whose literal meets its `*` on a
    letter or digit also matches other names that merely start (end) with it."""
    if seg in ("*", DOUBLE_STAR) or seg.count("*") != 1:
        return None
    lit = seg.strip("*")
    if not lit:
        return None
    if seg.endswith("*") and lit[-1].isalnum():
        return lit + "-evil"
    if seg.startswith("*") and lit[0].isalnum():
        return "evil-" + lit
    return None


def _names(secrets: frozenset[str]) -> str:
    return ("secrets " + ", ".join(sorted(secrets))) if secrets else "no secret"


# --- over-broad grants ---------------------------------------------------------------------------

# Cloud instance-metadata endpoints (AWS IMDS v4 and v6, ECS task metadata, Alibaba): a rule
# that may dial one hands the sandbox the machine's credentials.
METADATA = tuple(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200"))


def _grants(ident: Identity, make: Make) -> list[Finding]:
    out: list[Finding] = []
    for r in ident.rules:
        if r.action != "allow":
            continue
        for k, net in enumerate(r.private_cidrs):
            hit = next((m for m in METADATA if m.version == net.version and m in net), None)
            if hit is not None:
                out.append(make("metadata-cidr", r.source.file, (*_loc(r), "private_cidrs", k),
                                f"private_cidrs {net} of rule '{r.name}' contains the cloud "
                                f"metadata address {hit}: any host of the rule that resolves "
                                "there hands out the machine's credentials",
                                "list only the ranges of the internal services (e.g. "
                                "10.20.0.0/16); never 169.254.0.0/16 or fd00:ec2::/32"))
        for k, hp in enumerate(r.hosts):
            if hp.wildcard:
                continue
            ip = parse_ip_literal(hp.suffix)
            kind = classify(ip) if ip is not None else (
                "loopback" if hp.suffix == "localhost" or hp.suffix.endswith(".localhost")
                else None)
            if kind is None:
                continue
            if ip is not None and any(ip.version == n.version and ip in n
                                      for n in r.private_cidrs):
                continue
            out.append(make("private-literal", r.source.file, (*_loc(r), "hosts", k),
                            f"host {hp.text} of rule '{r.name}' is a {kind} address and the "
                            "rule's private_cidrs do not contain it: the address step refuses "
                            "it, so the rule never lets a request through",
                            f"add `private_cidrs: [{ip if ip is not None else '127.0.0.1'}"
                            f"/{(ip.max_prefixlen if ip is not None else 32)}]` to the rule "
                            "(only if the sandbox may really reach it), or remove the host"))
    return out


def _secret_hosts(policy: Policy, make: Make) -> list[Finding]:
    out: list[Finding] = []
    for name, ref in policy.secrets.items():
        for k, hp in enumerate(ref.hosts or ()):
            if hp.wildcard:
                out.append(make("secret-host-wildcard",
                                ref.source.file, ("secrets", name, "hosts", k),
                                f"secret '{name}' may be sent to any host under {hp.text}: a "
                                "rule for any subdomain (one that hosts user content or is "
                                "taken over) passes the proof",
                                "name the exact API hosts the secret is for, e.g. "
                                f"hosts: [api{hp.suffix}]"))
    return out


def _identity_sections(policy: Policy) -> dict[str, dict[str, dict[str, object]]]:
    """file -> identity name -> its raw section in that file (the policy loaded, so each file
    parses)."""
    import yaml

    out: dict[str, dict[str, dict[str, object]]] = {}
    for f in policy.files:
        try:
            doc = yaml.safe_load(Path(f).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        idents = doc.get("identities") if isinstance(doc, dict) else None
        if isinstance(idents, dict):
            out[f] = {k: v for k, v in idents.items() if isinstance(v, dict)}
    return out


def _widening_files(policy: Policy, make: Make) -> list[Finding]:
    """A file other than the one that defines an identity, adding rules (its own or through
    `use:`) that widen its reach, computed with the reach diff (the identity without that
    file's rules, against with them), or switching it to `mode: report`."""
    from sandgate.review.reach_diff import identity_changes

    sections = _identity_sections(policy)
    out: list[Finding] = []
    for ident in policy.identities.values():
        home = ident.source.file
        for file, idents in sections.items():
            sec = idents.get(ident.name)
            if file == home or sec is None:
                continue
            if sec.get("mode") == "report" and ident.mode == "report":
                out.append(make("widening-file", file, ("identities", ident.name, "mode"),
                                f"this file switches identity '{ident.name}', defined in "
                                f"{home}, to `mode: report`: every refusal by its rules is "
                                "forwarded (uninjected), so it reaches every host",
                                f"set the mode in {home}, or remove it if it was for debugging"))
            used = sec.get("use")
            tnames = {u for u in used if isinstance(u, str)} if isinstance(used, list) else set()

            def here(r: Rule, file: str = file, tnames: set[str] = tnames) -> bool:
                if r.where[:1] == ("templates",):
                    return len(r.where) > 1 and r.where[1] in tnames
                return r.source.file == file
            mine = [r for r in ident.rules if here(r)]
            if not mine:
                continue
            without = dataclasses.replace(ident, rules=tuple(r for r in ident.rules
                                                             if not here(r)))
            wider = [c for c in identity_changes(without, ident) if c.widened]
            if not wider:
                continue
            first = mine[0]
            loc = _loc(first) if first.source.file == file else ("identities", ident.name,
                                                                   "use")
            out.append(make("widening-file", file, loc,
                            f"this file widens identity '{ident.name}', defined in {home}: "
                            f"{wider[0].summary()}"
                            + (f" (and {len(wider) - 1} more)" if len(wider) > 1 else ""),
                            f"move the rule into {home} where the identity's owners review "
                            "it, or remove it if it was for debugging"))
    return out


# --- proofs, fixtures, gateways, query values ----------------------------------------------------


def _proofs(policy: Policy, make: Make) -> list[Finding]:
    out: list[Finding] = []
    for ident in policy.identities.values():
        if ident.narrower_than is not None and ident.mode == "report":
            out.append(make("report-mode-proof",
                            ident.source.file, ("identities", ident.name, "narrower_than"),
                            f"identity '{ident.name}' is in `mode: report`, so it reaches "
                            "everything (refusals are forwarded, uninjected): its proof "
                            f"'narrower than {ident.narrower_than}' holds over its rules only",
                            "switch it to `mode: enforce` before relying on the proof, or drop "
                            "narrower_than while it is in report mode"))
    return out


def _fixtures(policy: Policy,
              at_line: AtLine) -> list[Finding]:
    out: list[Finding] = []
    pats = [p for i in policy.identities.values() for r in i.rules for p in r.hosts]
    named = {p.suffix for p in pats if not p.wildcard}
    apexes = {p.suffix[1:] for p in pats if p.wildcard}
    for t in policy.tests:
        ident = policy.identities.get(t.identity)
        if ident is None or t.connect or t.dns or str(t.expect) == "tunnel":
            continue
        try:
            v = judge(policy, t.identity, t.method, t.url, {}, call=t.call,
                      upgrade="websocket" if t.websocket else None, headers=t.headers,
                      llm=stated_call(t.model, t.max_tokens))
        except ValueError:
            continue
        host, port, scheme = _host_port(t.url)
        if host is None:
            continue
        # a request inside a host:port that a passthrough rule tunnels is never seen
        c = decide_connect(policy, t.identity, host, port) if scheme == "https" else None
        if c is not None and c.allowed and c.rule is not None and c.rule.passthrough:
            out.append(at_line("fixture-tunnelled", t.source.file, t.source.line, "tests",
                               f"fixture {t.method} {t.url} is inside {host}:{port}, which "
                               f"passthrough rule '{c.rule.name}' ({c.rule.source}) tunnels "
                               "uninspected: the proxy never sees this request, so the "
                               f"fixture's expect: {t.expect} says nothing about it",
                               f"test the tunnel instead: `request: CONNECT {host}:{port}` "
                               "with `passthrough: true`"))
            continue
        if t.expect == "deny" and t.rule is None and t.code is None and not v.decision.allowed:
            denies = [r for r in ident.rules if r.action == "deny" and r.matches_host(host)]
            if denies:
                d = denies[0]
                by = (v.decision.rule_name if v.decision.rule is not None
                      and v.decision.rule.action == "deny" else None)
                why = (f"it is refused by deny rule '{by}', but passes just as well if that "
                       "rule breaks" if by else
                       f"it is refused by {v.decision.code or 'no rule'}, not by deny rule "
                       f"'{d.name}' ({d.source}) written for this host: that rule does not "
                       "match it")
                out.append(at_line("fixture-deny-unpinned", t.source.file, t.source.line, "tests",
                                   f"fixture expect: deny for {t.method} {t.url} names no "
                                   f"`rule:` or `code:`: {why}",
                                   f"pin it: `rule: {by}`" if by else
                                   f"make deny rule '{d.name}' match it (methods, paths) and "
                                   f"pin `rule: {d.name}`, or pin `code: {v.decision.code}` if "
                                   "deny-by-default is what it tests"))
                continue
        if host not in named and host not in apexes and not any(
                r.matches_host(host) for i in policy.identities.values() for r in i.rules):
            close = _close_host(host, named)
            if close is not None:
                out.append(at_line("fixture-near-host", t.source.file, t.source.line, "tests",
                                   f"fixture host {host} is named by no rule, but {close} is: "
                                   f"a typo makes expect: {t.expect} test deny-by-default "
                                   "instead of the rule",
                                   f"use {close} in the fixture's URL"))
                continue
            written = (_deny_for_path(ident, t.url) if t.expect == "deny" and t.rule is None
                       else None)
            if written is not None:
                d = written
                out.append(at_line("fixture-wrong-host", t.source.file, t.source.line, "tests",
                                   f"fixture expect: deny for {t.method} {t.url} looks written "
                                   f"for deny rule '{d.name}' ({d.source}), whose paths match "
                                   f"its path, but no rule names host {host}: it passes by "
                                   "deny-by-default whatever that rule does",
                                   f"use a host of rule '{d.name}' "
                                   f"({', '.join(p.text for p in d.hosts)}) and pin "
                                   f"`rule: {d.name}`"))
    return out


def _deny_for_path(ident: Identity, url: str) -> Rule | None:
    """A deny rule of the identity with paths, one of which matches the URL's path."""
    from sandgate.policy.paths import normalise_path
    from sandgate.request import parse_url

    try:
        path = normalise_path(parse_url("GET", url).path)
    except ValueError:
        return None
    return next((r for r in ident.rules if r.action == "deny" and r.paths is not None
                 and any(p.matches(path) for p in r.paths)), None)


def _host_port(url: str) -> tuple[str | None, int, str]:
    from sandgate.request import parse_url

    try:
        req = parse_url("GET", url)
    except ValueError:
        return None, 0, ""
    return req.host, req.port, req.scheme


def _query_names(url: str) -> list[str]:
    query = url.partition("#")[0].partition("?")[2]
    return [p.partition("=")[0] for p in query.split("&") if p]


def _close_host(host: str, named: set[str]) -> str | None:
    """A host some rule names that is one or two edits away from `host` (a typo)."""
    for n in sorted(named):
        if n != host and edits(host, n) <= 2 and min(len(host), len(n)) > 4:
            return n
    return None


def _gateways(policy: Policy,
              at_line: AtLine) -> list[Finding]:
    out: list[Finding] = []
    rules = [r for i in policy.identities.values() for r in i.rules]
    for gw in policy.gateways:
        reach = [r for r in rules if r.action == "allow" and not r.passthrough
                 and "https" in r.schemes and gw.port in r.ports and r.matches_host(gw.host)]
        if not reach:
            out.append(at_line("gateway-unreached", gw.source.file, gw.source.line, "gateways",
                               f"gateway {gw.prefix} forwards to {gw.upstream}, which no allow "
                               "rule of any identity reaches: every request under it is "
                               "refused",
                               f"add a rule with hosts: [{gw.host}] to the identities that "
                               "use the gateway, or remove the gateway"))
            continue
        injected = {h for r in reach if r.inject for h, _ in r.inject.headers}
        injected |= {"authorization" for r in reach if r.inject and r.inject.basic}
        if injected and not injected & set(gw.token_headers):
            out.append(at_line("gateway-token-header", gw.source.file, gw.source.line, "gateways",
                               f"gateway {gw.prefix} reads the caller's token from "
                               f"{', '.join(gw.token_headers)}, but the rules for {gw.host} "
                               f"inject {', '.join(sorted(injected))}: an SDK pointed at the "
                               "gateway sends its key (the Sandgate token) in the header the "
                               "API uses, where the gateway does not look",
                               f"token_header: [{', '.join(sorted(injected))}]"))
        word = gw.prefix.strip("/").split("/")[0].lower()
        others = {g.host for g in policy.gateways if g is not gw} | {
            p.suffix.lstrip(".") for r in rules for p in r.hosts if not r.public}
        if word and word not in gw.host and any(
                word in h.split(".") for h in others if not host_covers(
                    HostPattern(gw.host, False, gw.host), HostPattern(h, False, h))):
            other = next(h for h in sorted(others) if word in h.split("."))
            out.append(at_line("gateway-prefix-host", gw.source.file, gw.source.line, "gateways",
                               f"gateway prefix {gw.prefix} names '{word}', but its upstream "
                               f"is {gw.upstream}; {other} is the host of that name",
                               f"upstream: https://{other} (or rename the prefix)"))
    return out


def query_value_findings(ident: Identity, make: Make,
                         fixture_names: set[str]) -> list[Finding]:
    """`query:` constraints that no request as clients write it can meet."""
    out: list[Finding] = []
    for r in ident.rules:
        for name, _values in r.query:
            loc = (*_loc(r), "query", name)
            # A leading capital and a '+' in a value are load errors (compiler, unless
            # `exact: true`); what is left is a camelCase name next to its lower-case twin.
            if name != name.lower() and (name.lower() in fixture_names
                                         or any(n == name.lower() for x in ident.rules
                                                for n, _ in x.query)):
                out.append(make("query-name-case", r.source.file, loc,
                                f"query parameter name {name!r} of rule '{r.name}' is matched "
                                f"exactly: a request with {name.lower()}= does not match it, "
                                "and one that spells it both ways is refused",
                                f"write the name as the API spells it, usually "
                                f"{name.lower()!r}"))
    return out


__all__ = ["METADATA", "query_value_findings", "semantic_findings"]
