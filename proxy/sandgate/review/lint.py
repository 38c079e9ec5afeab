"""`sandgate lint`: warnings for policies that load but may not do what their authors mean.

Load errors are the loader's (a policy with one does not run); lint finds what is legal but
suspicious: grants over many owners, credentials sent for any method or path, rules that never
apply, secrets nobody uses, template syntax that is sent literally, identities no fixture tests,
files in the policy directory that are not read. Each warning names file, line, field and a fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

from sandgate.policy.compiler import TEMPLATE_LOOKING, template_fix
from sandgate.policy.loader import (
    POLICY_SUFFIXES,
    PolicyError,
    discover_policy_files,
    field_path,
    line_of,
    load_policy_dir,
)
from sandgate.policy.model import Identity, Policy, Rule
from sandgate.policy.overlap import deny_reaches, shadowing_rule
from sandgate.policy.paths import DOUBLE_STAR
from sandgate.policy.suffixes import overbroad_wildcard
from sandgate.review.finding import Finding
from sandgate.review.hygiene import expiries
from sandgate.review.lint_ask import ask_findings
from sandgate.review.lint_calls import Listings, read_listings, tool_findings
from sandgate.review.lint_mcp import findings as mcp_dns_review_findings
from sandgate.review.lint_semantic import semantic_findings

Loc = tuple[str | int, ...]



def lint_dir(path: str | Path, mcp_tools: Sequence[str] | None = None) -> list[Finding]:
    """Load a policy directory and lint it. Raises PolicyError when it does not load, and
    ValueError for an unreadable --mcp-tools file (sandgate.review.lint_calls)."""
    listings = read_listings(mcp_tools)
    policy = load_policy_dir(path)
    _read, skipped = discover_policy_files(path)
    return lint_policy(policy, skipped, listings)


def lint_policy(policy: Policy, skipped: Sequence[tuple[str, str]] = (),
                listings: Listings | None = None) -> list[Finding]:
    trees = _Trees(policy.files)
    out: list[Finding] = []
    out += _skipped_files(skipped)
    out += tool_findings(policy, listings or {}, trees.finding)
    tested = {t.identity for t in policy.tests}
    used: set[str] = set()
    for ident in policy.identities.values():
        base: Loc = ("identities", ident.name)
        for k, rule in enumerate(ident.rules):
            used |= rule.secrets
            out += _rule_findings(trees, ident, k, rule, rule.where or (*base, "rules", k))
        if ident.name not in tested:
            out.append(trees.finding("no-fixture",
                ident.source.file, base,
                f"identity '{ident.name}' has no fixture: no `tests:` entry names it",
                f"add fixtures for what it may and may not do, e.g. `- {{identity: "
                f"{ident.name}, request: GET https://..., expect: allow}}` and an expect: deny "
                "next to it"))
    used |= {h.secret for h in policy.webhooks.values() if h.secret is not None}
    for name, ref in policy.secrets.items():
        if name not in used:
            out.append(trees.finding("unused-secret",
                ref.source.file, ("secrets", name),
                f"secret '{name}' is declared but never referenced by any rule",
                f"use it in a rule's inject (`{{{{ secrets.{name} }}}}`) or substitute, or "
                "remove it"))
    used_templates = {r.where[1] for i in policy.identities.values() for r in i.rules
                      if r.where[:1] == ("templates",)}
    for tname, tsrc in policy.templates.items():
        if tname not in used_templates:
            out.append(trees.finding("unused-template",
                tsrc.file, ("templates", tname),
                f"template '{tname}' is never used: no identity names it in `use:`",
                f"add `use: [{tname}]` to the identities that need its rules, or remove it"))
    out += _template_looking(trees)
    out += [trees.finding("expires-soon",
                          e.rule.source.file, (*e.rule.where, "expires"), e.message, e.fix)
            for e in expiries(policy) if not e.expired]  # expired: `check` fails
    out += semantic_findings(
        policy, trees.finding,
        lambda code, file, line, fld, msg, fix: Finding(file, line, fld, msg, fix, code=code))
    out += ask_findings(policy, trees.finding)  # action: ask, webhooks
    out += mcp_dns_review_findings(policy, trees.finding)  # tool rules, DNS, owns:, expiry
    # A template's rule is checked once per identity using it; say it once.
    out = _suppress(policy, trees, list(dict.fromkeys(out)))
    order = {f: i for i, f in enumerate(policy.files)}
    out.sort(key=lambda f: (order.get(f.file, len(order)), f.line, f.field))
    return out


class _Trees:
    """The YAML node trees of the files a loaded policy came from, for lines of fields."""

    def __init__(self, files: Iterable[str]) -> None:
        self.roots: dict[str, yaml.Node] = {}
        for f in files:
            try:
                node = yaml.compose(Path(f).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
            except (OSError, yaml.YAMLError):  # changed since it was loaded
                continue
            if node is not None:
                self.roots[f] = node

    def line(self, file: str, loc: Loc) -> int:
        root = self.roots.get(file)
        return line_of(root, loc) if root is not None else 1

    def finding(self, code: str, file: str, loc: Loc, message: str, fix: str) -> Finding:
        return Finding(file, self.line(file, loc), field_path(loc), message, fix, code=code)


def _suppress(policy: Policy, trees: _Trees, found: list[Finding]) -> list[Finding]:
    """Drop the findings a rule's `lint: {ignore: [CODE], why: ...}` accepts: those located on
    the rule (its line or one of its fields) with one of the codes. An ignore entry that
    suppresses nothing is itself reported, so a stale suppression does not linger."""
    rules = {(r.source.file, r.where): r for i in policy.identities.values() for r in i.rules
             if r.meta is not None and r.meta.lint_ignore and r.where}
    used: set[tuple[str, tuple[str | int, ...], str]] = set()
    kept: list[Finding] = []
    for f in found:
        hit = next((key for key in rules if key[0] == f.file and f.code in
                    rules[key].meta.lint_ignore  # type: ignore[union-attr]
                    and _within(f.field, field_path(key[1]))), None)
        if hit is None:
            kept.append(f)
        else:
            used.add((*hit, f.code))
    for (file, where), r in rules.items():
        assert r.meta is not None
        for j, code in enumerate(r.meta.lint_ignore):
            if (file, where, code) not in used:
                kept.append(trees.finding(
                    "lint-ignore-unused", file, (*where, "lint", "ignore", j),
                    f"rule '{r.name}' suppresses lint warning {code}, which lint does not "
                    "raise on it (any more)", f"remove {code} from the rule's `lint: ignore`"))
    return kept


def _within(fld: str, prefix: str) -> bool:
    return fld == prefix or fld.startswith(prefix + ".") or fld.startswith(prefix + "[")


# A subfolder holding this file (non-empty: why) is a policy directory of its own, checked on
# its own (policies/agents: templates), so its files are not reported as skipped.
SEPARATE_POLICY = ".separate-policy"


def _separate(d: Path) -> bool:
    try:
        return bool((d / SEPARATE_POLICY).read_text(errors="replace").strip())
    except OSError:
        return False


def _skipped_files(skipped: Sequence[tuple[str, str]]) -> list[Finding]:
    out: list[Finding] = []
    for f, reason in skipped:
        p = Path(f)
        looks = any(s in p.name.lower() for s in POLICY_SUFFIXES)
        if p.is_dir():
            looks = not _separate(p) and any(c.suffix.lower() in POLICY_SUFFIXES
                                             for c in p.rglob("*"))
        if looks:
            out.append(Finding(
                f, 1, "", f"skipped: {reason}; nothing in it is part of the policy",
                "move the file directly into the policy directory with a name ending in .yaml "
                "or .yml, or delete it if it is a backup", code="skipped-file"))
    return out


def _rule_findings(trees: _Trees, ident: Identity, k: int, rule: Rule,
                   loc: Loc) -> list[Finding]:
    file = rule.source.file
    out: list[Finding] = []

    def add(code: str, sub: Loc, message: str, fix: str) -> None:
        out.append(trees.finding(code, file, (*loc, *sub), message, fix))

    for j, hp in enumerate(rule.hosts):
        # the public-suffix advice is about what a rule grants: a deny rule may cut any breadth
        why = (overbroad_wildcard(hp.suffix)
               if hp.wildcard and not rule.public and rule.action == "allow" else None)
        if why is not None:  # on a rule with secrets this is a load error
            add("public-suffix-wildcard",
                ("hosts", j), f"{why}; rule '{rule.name}' reaches all of them",
                "name the exact hosts, or a wildcard under a domain one owner controls "
                "(e.g. '*.myorg.github.io')")
    if rule.secrets and rule.action == "allow":
        if rule.methods is None:
            add("secret-any-method",
                (), f"rule '{rule.name}' sends secrets {', '.join(sorted(rule.secrets))} for "
                "any method", "list the methods the API call needs, e.g. methods: [POST]")
        for j, p in enumerate(rule.paths or ()):
            if p.segments == (DOUBLE_STAR,):
                add("secret-any-path", ("paths", j), f"rule '{rule.name}' sends secrets "
                    f"{', '.join(sorted(rule.secrets))} for any path ('/**')",
                    "list the API's paths, e.g. /v1/messages or /repos/myorg/**")
    if rule.action == "allow" and not rule.secrets:  # with secrets it is a load error
        hider = shadowing_rule(ident.rules, k)
        if hider is not None:
            add("shadowed-rule",
                (), f"rule '{rule.name}' never applies: earlier allow rule '{hider.name}' "
                f"({_where(hider, rule)}) matches every request it matches (the first "
                "matching allow rule wins)",
                f"remove rule '{rule.name}', or move it above '{hider.name}' if it is meant "
                "to decide (it will when it injects)")
    if rule.action == "allow" and not rule.public:
        pub = next((p for p in ident.rules[:k] if p.public and p.action == "allow"
                    and _may_overlap(p, rule)), None)
        if pub is not None and shadowing_rule(ident.rules, k) is None:
            add("after-public",
                (), f"rule '{rule.name}' comes after `public: true` rule '{pub.name}' "
                f"({_where(pub, rule)}), which matches every host: requests both match are "
                f"decided by '{pub.name}' (first matching allow wins), so they get its limits, "
                "none of this rule's secrets, and a refusal for non-public addresses",
                f"move rule '{pub.name}' below the rules that name hosts (a `public: true` "
                "rule is meant to come last)")
    if rule.action == "deny" and not any(deny_reaches(rule, a) for a in ident.rules):
        add("deny-never-applies",
            (), f"deny rule '{rule.name}' never applies: no allow rule of identity "
            f"'{ident.name}' matches its hosts on its schemes, ports and methods (ports "
            "default to 443 for https and 80 for http), so deny-by-default already refuses "
            "everything it names",
            "give it the hosts, schemes and ports of the allow rule it should cut (e.g. "
            "`ports: [8443]` when that rule has them), or remove it")
    return out


def _may_overlap(a: Rule, b: Rule) -> bool:
    """Can some inspected request match both (schemes, ports, methods; hosts assumed)?"""
    return (not a.passthrough and not b.passthrough and bool(a.schemes & b.schemes)
            and bool(a.ports & b.ports)
            and (a.methods is None or b.methods is None or bool(a.methods & b.methods)))


def _template_looking(trees: _Trees) -> list[Finding]:
    out: list[Finding] = []
    for file, root in trees.roots.items():
        for loc, node in _scalars(root, ()):
            if _in_inject(loc) or _secret_path(loc):
                continue  # templates and path variables are checked (typos refused) at load
            m = TEMPLATE_LOOKING.search(str(node.value))
            if m:
                out.append(Finding(
                    file, node.start_mark.line + 1, field_path(loc),
                    f"template-looking text {m.group(0)!r} outside a template: only inject "
                    "values are templates; here it is plain text",
                    template_fix(str(node.value)) if "secret" in str(node.value)
                    else "write plain text here; secrets go only in a rule's inject "
                    "templates (`{{ secrets.NAME }}`)", code="template-text"))
    return out


def _scalars(node: yaml.Node, loc: Loc) -> Iterable[tuple[Loc, yaml.ScalarNode]]:
    if isinstance(node, yaml.ScalarNode):
        yield loc, node
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else "?"
            if isinstance(k, yaml.ScalarNode):
                yield (*loc, key), k
            yield from _scalars(v, (*loc, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            yield from _scalars(v, (*loc, i))


def _secret_path(loc: Loc) -> bool:
    """A secret's path (`vault`, `path`, `dynamic.path`): `{{ identity }}` and `{{ sandbox }}`
    are its documented variables, parsed at load (anything else there is a load error)."""
    return len(loc) >= 3 and loc[0] == "secrets" and (
        loc[2:] in (("vault",), ("path",), ("dynamic", "path")))


def _in_inject(loc: Loc) -> bool:
    return ((len(loc) > 5 and loc[0] == "identities" and loc[2] == "rules"
             and loc[4] == "inject")
            or (len(loc) > 4 and loc[0] == "templates" and loc[3] == "inject"))


def _where(r: Rule, here: Rule) -> str:
    """Where rule `r` is, as seen from a finding about rule `here`."""
    return f"line {r.source.line}" if r.source.file == here.source.file else str(r.source)


def findings_from_error(e: PolicyError) -> list[Finding]:
    return [Finding(p.file, p.line, p.field, p.message, p.fix, "error") for p in e.problems]


def github_annotation(level: str, file: str, line: int, message: str) -> str:
    """One GitHub Actions workflow command, escaped as the runner expects."""
    def prop(s: str) -> str:
        return (s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
                .replace(":", "%3A").replace(",", "%2C"))

    msg = message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    where = f"file={prop(file)}" + (f",line={line}" if line > 0 else "")
    return f"::{level} {where}::{msg}"


def format_findings(findings: Sequence[Finding], fmt: str) -> str:
    if fmt == "json":
        import json

        return json.dumps([f.as_dict() for f in findings], indent=2)
    if fmt == "github":
        return "\n".join(github_annotation(f.severity, f.file, f.line, f.text)
                         for f in findings)
    return "\n".join(str(f) for f in findings)


__all__ = ["Finding", "findings_from_error", "format_findings", "github_annotation",
           "lint_dir", "lint_policy"]
