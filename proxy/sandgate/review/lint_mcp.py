"""`sandgate lint` on the constructs of issue 38: MCP tool rules, policy DNS types, templates
under `owns:`, temporary grants.

- mcp-bypass: an allow rule without `mcp:` that matches the POSTs an `mcp:` rule judges. A
  call the tool rule refuses (a tool it does not list, arguments it refuses) falls through to
  it and is allowed (sandgate.decision: a rule with `mcp:` matches only the calls it allows);
  when it comes first it decides every call. Only `deny_tools`/`deny_methods` still refuse.
- mcp-tools-any: a rule allowing every tool (`tools` absent or `"*"`, no `arguments`) beside a
  rule of the same kind (allow or ask) of the same identity for the same endpoint that lists
  tools: the list restricts nothing.
- mcp-deny-unmatched (without a recorded tools/list; with one see lint_calls): a `deny_tools`
  entry that no tool allowed on that endpoint can match and that is one or two edits from an
  allowed tool: a misspelling, so the tool it meant stays allowed. One far from every allowed
  name is taken as belt and braces (`deny_tools: [delete_repo]` beside `tools: [get_*]`).
- mcp-argument-glob: an argument glob whose literal meets its `*` on a letter or digit
  (`owner: "acme*"` also matches `acme-evil`).
- dns-type-widening: `dns: {types: [...]}` on a rule with a wildcard host (every name under
  it answers the type: the labels carry data) or for a package index (which never needs one).
- dns-public: `public: true` in a policy written for the policy DNS (a rule has `dns:`): the
  resolver answers every name for that identity, so every name is looked up upstream.
- owns-template: a template used by an identity with `owns:`, defined in a file `owns:` does
  not list: an edit of the template widens the identity without its owners' review (the
  loader checks only where `use:` is written).
- grant-no-expiry, grant-no-owner: a rule that says it is temporary (debug, temporary,
  incident...) without `expires`; one with `expires` and no `owner` to renew or remove it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandgate.policy.model import Identity, Policy, Rule
from sandgate.review.reach import find_request
from sandgate.review.typos import edits

Loc = tuple[str | int, ...]
# (code, file, loc, message, fix) -> a lint Finding
Make = Callable[[str, str, Loc, str, str], Any]

# Package indexes: their names resolve to addresses; no client of theirs needs TXT, MX, SRV...
PACKAGE_HOSTS = frozenset({
    "pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "registry.yarnpkg.com",
    "proxy.golang.org", "sum.golang.org", "crates.io", "index.crates.io", "static.crates.io",
    "rubygems.org", "repo.maven.apache.org", "repo1.maven.org", "api.nuget.org",
    "packagist.org", "repo.packagist.org", "conda.anaconda.org", "pkg.go.dev"})
TEMPORARY = re.compile(r"(?i)(?<![a-z])(temp|temporary|tmp|debug|debugging|hotfix|incident|"
                       r"investigat\w*|until|trial|one-off|adhoc|ad-hoc|experiment\w*)(?![a-z])")


def findings(policy: Policy, make: Make) -> list[Any]:
    out: list[Any] = []
    dns_policy = any(r.dns_types for i in policy.identities.values() for r in i.rules)
    for ident in policy.identities.values():
        out += _mcp(ident, make)
        out += _dns(ident, make, dns_policy)
        out += _owns_templates(policy, ident, make)
    seen: set[tuple[str, Loc]] = set()
    for ident in policy.identities.values():
        for r in ident.rules:
            if (r.source.file, r.where) not in seen:  # a template's rule once
                seen.add((r.source.file, r.where))
                out += _grant(r, make)
    return out


def _loc(r: Rule) -> Loc:
    return r.where or ("identities", r.identity, "rules")


# --- MCP tools and arguments ---------------------------------------------------------------


def _endpoint(a: Rule, b: Rule) -> str | None:
    """A POST both rules match (the requests that carry calls), as text; None if none."""
    w = find_request([a, b], lambda v: v[0] and v[1], methods=["POST"], required=(0, 1))
    return None if w is None else str(w)


def _mcp(ident: Identity, make: Make) -> list[Any]:
    out: list[Any] = []
    rules = [r for r in ident.rules if r.action == "allow" and not r.passthrough]
    tool_rules = [r for r in rules if r.call is not None and r.call.protocol == "mcp"]
    for m in tool_rules:
        assert m.call is not None
        for p in rules:
            # an ask rule without mcp: holds what the tool rules refuse: people decide
            if p.call is not None or p.ask is not None:
                continue
            where = _endpoint(p, m)
            if where is None:
                continue
            order = "comes first and decides every call" if ident.rules.index(p) < \
                ident.rules.index(m) else "takes every call it refuses"
            out.append(make(
                "mcp-bypass", p.source.file, _loc(p),
                f"rule '{p.name}' has no `mcp:` but matches the MCP requests of tool rule "
                f"'{m.name}' ({m.source}), e.g. {where}: it {order}, so a tool or arguments "
                f"'{m.name}' refuses are allowed (only deny_tools entries still refuse)",
                f"narrow rule '{p.name}' (methods, paths) so it does not match the MCP "
                f"endpoint, or give it an `mcp:` of its own"))
    for m in tool_rules:
        assert m.call is not None
        f = m.call
        if not (f.tools is None or "*" in f.tools) or f.arguments:
            continue
        for other in tool_rules:
            o = other.call
            assert o is not None
            # an ask rule's list beside an allow-everything rule is an exception carved out
            # (ask wins over allow), and the reverse is lint_ask's ask-hides-allow
            if other is m or o.tools is None or "*" in o.tools or (
                    (m.ask is None) != (other.ask is None)):
                continue
            where = _endpoint(m, other)
            if where is None:
                continue
            sub: Loc = ("mcp", "tools") if f.tools is not None else ("mcp",)
            out.append(make(
                "mcp-tools-any", m.source.file, (*_loc(m), *sub),
                f"rule '{m.name}' allows every tool on the endpoint of rule '{other.name}' "
                f"({other.source}), e.g. {where}: the tools '{other.name}' lists "
                f"({', '.join(o.tools)}) restrict nothing",
                f"list the tools rule '{m.name}' is for, or remove it"))
            break
    for m in tool_rules:
        assert m.call is not None
        out += _deny_spelling(ident, m, tool_rules, make)
        for name, pat in m.call.arguments:
            leak = _argument_leak(pat)
            if leak is not None:
                lit = pat.rstrip("*")
                out.append(make(
                    "mcp-argument-glob", m.source.file, (*_loc(m), "mcp", "arguments", name),
                    f"argument glob {name}: {pat!r} of rule '{m.name}' also matches {leak!r}: "
                    f"`*` is any text after {lit!r}, not a name boundary",
                    f"write the exact value ({name}: {lit!r}), or mark where the name ends: "
                    f"{name}: '{lit}/*' (its repositories) or '{lit}-*'"))
    return out


def _argument_leak(pat: str) -> str | None:
    """`acme*` -> "acme-evil": the literal meets the trailing `*` on a letter or digit."""
    if not pat.endswith("*") or "*" in pat[:-1] or "?" in pat:
        return None
    lit = pat[:-1]
    return lit + "-evil" if lit and lit[-1].isalnum() else None


def _deny_spelling(ident: Identity, m: Rule, tool_rules: list[Rule], make: Make) -> list[Any]:
    assert m.call is not None
    out: list[Any] = []
    peers = [r for r in tool_rules if r is m or _endpoint(r, m) is not None]
    allowed = [g for r in peers for g in (r.call.tools or ("*",))]  # type: ignore[union-attr]
    for j, d in enumerate(m.call.deny_tools):
        if any(globs_meet(d, g) for g in allowed):
            continue
        close = next((g for g in allowed if edits(d, g) <= 2), None)
        if close is None:
            continue  # belt and braces: a tool no rule allows, denied as well
        out.append(make(
            "mcp-deny-unmatched", m.source.file, (*_loc(m), "mcp", "deny_tools", j),
            f"deny_tools entry {d!r} of rule '{m.name}' matches no tool identity "
            f"'{ident.name}' allows here, but is close to {close!r}, which it allows: a "
            "misspelling refuses nothing, and the tool it meant stays allowed",
            f"spell it as the tool is named (e.g. {close!r}), or pass the server's recorded "
            "tools/list with --mcp-tools to check the names"))
    return out


def globs_meet(a: str, b: str) -> bool:
    """Is there a name both call-level globs match (`*` any run, `?` one character)?"""

    @functools.cache
    def meet(i: int, j: int) -> bool:
        if i == len(a) and j == len(b):
            return True
        if i < len(a) and a[i] == "*":
            return meet(i + 1, j) or (j < len(b) and meet(i, j + 1))
        if j < len(b) and b[j] == "*":
            return meet(i, j + 1) or (i < len(a) and meet(i + 1, j))
        if i < len(a) and j < len(b) and (a[i] == b[j] or "?" in (a[i], b[j])):
            return meet(i + 1, j + 1)
        return False

    return meet(0, 0)


# --- DNS ----------------------------------------------------------------------------------


def _dns(ident: Identity, make: Make, dns_policy: bool) -> list[Any]:
    out: list[Any] = []
    for r in ident.rules:
        if r.action != "allow":
            continue
        types = ", ".join(sorted(r.dns_types))
        wild = [p.text for p in r.hosts if p.wildcard]
        pkg = [p.text for p in r.hosts if not p.wildcard and p.suffix in PACKAGE_HOSTS]
        if r.dns_types and wild:
            out.append(make(
                "dns-type-widening", r.source.file, (*_loc(r), "dns", "types"),
                f"rule '{r.name}' has the policy DNS answer {types} for every name under "
                f"{', '.join(wild)}: the sandbox chooses the labels, so each lookup carries "
                "data out and each answer carries data in",
                f"give the types to a rule naming the exact hosts that need them "
                f"(e.g. hosts: [mail{wild[0][1:]}], dns: {{types: [{types}]}}), or remove "
                "`dns:`"))
        elif r.dns_types and pkg:
            out.append(make(
                "dns-type-widening", r.source.file, (*_loc(r), "dns", "types"),
                f"rule '{r.name}' has the policy DNS answer {types} for the package index "
                f"{', '.join(pkg)}, whose clients only look up addresses: each answered type "
                "is a channel through DNS",
                "remove `dns:` from the rule (A and AAAA are always answered)"))
        if dns_policy and r.public:
            out.append(make(
                "dns-public", r.source.file, _loc(r),
                f"`public: true` rule '{r.name}' has the policy DNS resolve every name for "
                f"identity '{ident.name}' (the policy is written for the policy DNS: a rule "
                "has `dns:`): each lookup of a made-up name reaches the upstream resolvers, "
                "and the names carry data out",
                "name the hosts the identity reads instead of `public: true`, or, if it "
                "must read the whole web, say so: `lint: {ignore: [dns-public], why: ...}`"))
    return out


# --- review: templates under owns:, temporary grants --------------------------------------


def _owns_templates(policy: Policy, ident: Identity, make: Make) -> list[Any]:
    if ident.owns is None:
        return []
    allowed = {*ident.owns, Path(ident.source.file).name}
    out: list[Any] = []
    said: set[str] = set()
    for r in ident.rules:
        if r.where[:1] != ("templates",) or len(r.where) < 2:
            continue
        tname = str(r.where[1])
        fname = Path(r.source.file).name
        if fname in allowed or tname in said:
            continue
        said.add(tname)
        out.append(make(  # at the template's first rule: `lint: ignore` can go there
            "owns-template", r.source.file, r.where,
            f"template '{tname}' (rule '{r.name}') gives rules to identity '{ident.name}', "
            "whose `owns:` "
            f"({ident.source}) does not list {fname}: an edit of the template widens "
            f"'{ident.name}' without its owners' review",
            f"move template '{tname}' into one of {', '.join(sorted(allowed))}, or add "
            f"{fname} to identities.{ident.name}.owns (and put it under the same "
            "CODEOWNERS entry)"))
    return out


def _grant(r: Rule, make: Make) -> list[Any]:
    meta = r.meta
    if r.action == "deny":
        return []
    if meta is not None and meta.expires is not None:
        if meta.owner:
            return []
        return [make(
            "grant-no-owner", r.source.file, (*_loc(r), "expires"),
            f"rule '{r.name}' expires on {meta.expires} but has no `owner`: nobody is named "
            "to renew or remove it when `sandgate check` starts failing",
            "add `owner: TEAM` (a team, a person, an alias)")]
    said = " ".join(x for x in (r.name, meta.description if meta else None,
                                meta.ticket if meta else None) if x)
    m = TEMPORARY.search(said)
    if m is None:
        return []
    return [make(
        "grant-no-expiry", r.source.file, _loc(r),
        f"rule '{r.name}' says it is temporary ({m.group(0)!r}) but has no `expires`: the "
        "grant stays until someone remembers to remove it",
        "add `expires: YYYY-MM-DD` and `owner:`; or, if the grant is permanent, say so in its "
        "name and description")]


__all__ = ["PACKAGE_HOSTS", "findings", "globs_meet"]
