"""File-format models (sandgate.policy.schema) -> compiled types (sandgate.policy.model).

Every check that needs meaning rather than shape lives here. Problems are reported through a
callback with the location (a pydantic-style `loc` tuple inside the file) so the loader can turn
them into file:line: field messages; compilation carries on to find every problem.
Cross-file checks (duplicates, undeclared secrets, fixtures naming identities) are the loader's.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import Literal

from mitmproxy.utils import human

from sandgate.errors import Refused
from sandgate.policy import hosts as H
from sandgate.policy import overlap
from sandgate.policy import paths as P
from sandgate.policy.ask import compile_ask
from sandgate.policy.call_rules import compile_call, compile_test_call
from sandgate.policy.dnstypes import compile_dns, compile_dns_test
from sandgate.policy.lint_codes import CODES
from sandgate.policy.llm import compile_llm
from sandgate.policy.model import (
    ANY_PUBLIC_HOST,
    DEFAULT_SUBSTITUTE_HEADERS,
    AwsRef,
    DynamicRef,
    GitHubAppRef,
    GitHubScope,
    HostPattern,
    Injection,
    IPNetwork,
    OAuth2Ref,
    PolicyTest,
    QueryConstraint,
    Rule,
    RuleMeta,
    SecretRef,
    SecretSlot,
    SignRef,
    Source,
    Template,
)
from sandgate.policy.paths import PathPattern
from sandgate.policy.schema import Loc, Report, RuleSpec, SecretSpec, TestSpec
from sandgate.policy.suffixes import overbroad_wildcard
from sandgate.request import parse_header, parse_url, split_authority
from sandgate.secrets.credential_form import is_form, parse_form
from sandgate.secrets.scope import parse_path
from sandgate.text import has_control_chars

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SECRET_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_SLOT_RE = re.compile(
    r"\{\{\s*secrets\.([A-Za-z0-9_][A-Za-z0-9_-]*)(?:\.(username))?\s*\}\}")
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Headers an injection may not set: framing, routing and Sandgate's own.
_NO_INJECT = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
    "keep-alive", "proxy-authorization", "proxy-connection", "x-sandgate-reason",
})
MIN_PLACEHOLDER = 8
# The IANA HTTP Method Registry (RFC 9110 and the WebDAV family), without PRI (the HTTP/2
# preface, never a request). A name outside it would make a rule that never matches.
STANDARD_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                    "PATCH")
REGISTERED_METHODS = frozenset((
    *STANDARD_METHODS,
    "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "COPY", "LABEL", "LINK", "LOCK",
    "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE", "MOVE",
    "ORDERPATCH", "PROPFIND", "PROPPATCH", "QUERY", "REBIND", "REPORT", "SEARCH", "UNBIND",
    "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE", "UPDATEREDIRECTREF", "VERSION-CONTROL",
))
# Text that looks like a template but is not a `{{ secrets.NAME }}` slot: another template
# language's syntax, a half-closed slot, `secret.` for `secrets.`. Sent literally, it would be
# a request without the credential the author meant.
TEMPLATE_LOOKING = re.compile(
    r"\{\{|\}\}|\{%|%\}|\$\{|\$\(|<%|\{\s*secrets?\.|(?<![\w.-])secrets?\.[A-Za-z0-9_]")
_NAME_GUESS = re.compile(r"secrets?\.([A-Za-z0-9_][A-Za-z0-9_-]*)")


def is_token(s: str) -> bool:
    return bool(s) and all(c in _TCHARS for c in s)


@dataclass
class SecretUse:
    """A secret named somewhere in a file, checked against the merged declarations later."""

    name: str
    loc: Loc
    part: str | None = None  # "username": `{{ secrets.NAME.username }}`
    sign: SignRef | None = None  # part "sign": the rule's scope parts, checked with the secret's
    hosts: tuple[str, ...] = ()  # part "sign": the rule's host patterns


@dataclass
class CompiledIdentity:
    rules: list[Rule] = field(default_factory=list)
    uses: list[SecretUse] = field(default_factory=list)


def parse_template(text: str) -> Template:
    """Literal text plus `{{ secrets.NAME }}` slots; any other `{{`/`}}` is an error."""
    parts: list[str | SecretSlot] = []
    pos = 0
    for m in _SLOT_RE.finditer(text):
        lit = text[pos : m.start()]
        _check_literal(lit, text)
        if lit:
            parts.append(lit)
        parts.append(SecretSlot(m.group(1), m.group(2)))
        pos = m.end()
    lit = text[pos:]
    _check_literal(lit, text)
    if lit:
        parts.append(lit)
    return Template(tuple(parts))


def _check_literal(lit: str, whole: str) -> None:
    m = TEMPLATE_LOOKING.search(lit)
    if m:
        raise ValueError(f"template {whole!r} has template-looking text {m.group(0)!r} outside "
                         "a `{{ secrets.NAME }}` slot (it would be sent literally)")
    if has_control_chars(lit):
        raise ValueError(f"template {whole!r} contains control characters (CR, LF, NUL...)")


_TEMPLATE_FIX = ("write literal text plus `{{ secrets.NAME }}` slots only, "
                 "e.g. \"Bearer {{ secrets.openai }}\"")


def template_fix(text: str) -> str:
    """The fix for a template-looking text: the slot it probably meant."""
    m = _NAME_GUESS.search(text)
    if m:
        return (f"write the slot as `{{{{ secrets.{m.group(1)} }}}}` (two braces, `secrets.`), "
                f"e.g. \"Bearer {{{{ secrets.{m.group(1)} }}}}\"")
    return _TEMPLATE_FIX


def missing_hosts(raw: object, loc: Loc, report: Report) -> None:
    """A rule mapping with neither `hosts` nor `public: true`."""
    if isinstance(raw, dict) and "hosts" not in raw and raw.get("public") is not True:
        report((*loc, "hosts"), "required key `hosts` is missing",
               "add `hosts: [api.example.com]` (exact hosts or '*.domain' wildcards), or "
               "`public: true` for any host that resolves only to public addresses")


def compile_secret(name: str, spec: SecretSpec, src: Source, report: Report) -> SecretRef | None:
    ok = True
    if not SECRET_NAME_RE.fullmatch(name):
        report(("secrets", name), f"secret name {name!r} is not a valid name",
               "use letters, digits, '_' and '-' only, so `{{ secrets.NAME }}` can name it")
        ok = False
    mount = path = ""
    kv_version = spec.kv_version
    dynamic: DynamicRef | None = None
    if spec.dynamic is not None:
        dynamic = _compile_dynamic(name, spec, report)
        if dynamic is None:
            return None
        field_name = dynamic.field
    else:
        kv = _compile_kv_location(name, spec, report)
        if kv is None:
            return None
        mount, path, kv_version = kv
        if spec.oauth2 is not None and spec.field is None:
            spec = spec.model_copy(update={"field": "client_id"})  # the record's one must-have
        if spec.aws is not None and spec.field is None:
            spec = spec.model_copy(update={"field": "secret_access_key"})
        if spec.github_app is not None and spec.field is None:
            spec = spec.model_copy(update={"field": "private_key"})
        if spec.field is None:
            report(("secrets", name, "field"), "required key `field` is missing",
                   "name the key inside the secret's data, e.g. `field: api_key`")
            return None
        field_name = spec.field
    if not field_name.strip():
        report(("secrets", name, "dynamic", "field") if dynamic else ("secrets", name, "field"),
               "empty field", "name the key inside the secret's data")
        ok = False
    placeholder = spec.placeholder if spec.placeholder is not None else (
        f"sandgate-placeholder-{name}")
    if len(placeholder) < MIN_PLACEHOLDER:
        report(("secrets", name, "placeholder"),
               f"placeholder is shorter than {MIN_PLACEHOLDER} characters",
               "use a longer, distinctive placeholder, e.g. sandgate-placeholder-" + name)
        ok = False
    elif any(c.isspace() for c in placeholder) or has_control_chars(placeholder):
        report(("secrets", name, "placeholder"), "placeholder contains whitespace or controls",
               "use printable characters without spaces")
        ok = False
    hosts: list[HostPattern] | None = None
    if spec.hosts is not None:
        hosts = []
        for j, h in enumerate(spec.hosts):
            try:
                hosts.append(H.compile_host_pattern(h))
            except ValueError as e:
                report(("secrets", name, "hosts", j), str(e),
                       "write an exact host (api.example.com) or a leading wildcard over a "
                       "registered domain ('*.example.com', quoted in YAML)")
                ok = False
    oauth2 = _compile_oauth2(name, spec, kv_version, path, report) if spec.oauth2 else None
    ok = ok and (spec.oauth2 is None or oauth2 is not None)
    github_app = _compile_github_app(name, spec, report) if spec.github_app else None
    aws = None
    if spec.aws is not None:
        kinds = [k for k in ("dynamic", "oauth2", "github_app") if getattr(spec, k) is not None]
        if kinds:
            report(("secrets", name, "aws"), f"a secret cannot be both `aws` and `{kinds[0]}`",
                   "declare one kind per secret")
            ok = False
        ok = _aws_names(spec.aws.region, spec.aws.service, ("secrets", name, "aws"),
                        report) and ok
        aws = AwsRef(spec.aws.region, spec.aws.service)
    ok = ok and (spec.github_app is None or github_app is not None)
    budget = None
    if spec.budget is not None:
        from sandgate.policy.ratelimits import compile_budget  # imports this module

        budget = compile_budget(spec.budget, ("secrets", name, "budget"), report)
        ok = ok and budget is not None
    if not ok:
        return None
    return SecretRef(name=name, mount=mount, path=path.strip("/"), field=field_name,
                     kv_version=kv_version, placeholder=placeholder, source=src,
                     hosts=tuple(hosts) if hosts is not None else None, dynamic=dynamic,
                     budget=budget, oauth2=oauth2, github_app=github_app, aws=aws)


def _aws_names(region: str | None, service: str | None, loc: Loc, report: Report) -> bool:
    ok = True
    for key, v in (("region", region), ("service", service)):
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", v):
            report((*loc, key), f"{key} {v!r} is not a valid AWS name",
                   "e.g. region: eu-west-1, service: s3 (lower case)")
            ok = False
    return ok


def _compile_github_app(name: str, spec: SecretSpec, report: Report) -> GitHubAppRef | None:
    g = spec.github_app
    assert g is not None
    loc = ("secrets", name, "github_app")
    if spec.dynamic is not None or spec.oauth2 is not None:
        report(loc, "a secret can be only one of `github_app`, `oauth2` and `dynamic`",
               "keep the app's private key in KV (`vault:`) and declare one kind per secret")
        return None
    ok = True
    for key in ("app_id", "installation_id"):
        if getattr(g, key) <= 0:
            report((*loc, key), f"{key} must be a positive number",
                   "copy it from the app's settings page / the installation's URL")
            ok = False
    if not _https_endpoint(g.api_url, (*loc, "api_url"), report,
                           "write https://api.github.com or your server's https://HOST/api/v3"):
        ok = False
    if not ok:
        return None
    return GitHubAppRef(app_id=g.app_id, installation_id=g.installation_id,
                        api_url=g.api_url.rstrip("/"), timeout=g.timeout)


def _https_endpoint(value: str, where: Loc, report: Report, fix: str) -> bool:
    """A credential endpoint Sandgate itself dials with a key, a client secret or a refresh
    token: a valid https URL without a query (the secret must never travel in clear, and a
    query would be sent with every token request). Reports and returns False otherwise."""
    key = where[-1]
    try:
        url = parse_url("POST", value)
    except Refused as e:
        report(where, f"{key} {value!r} is not a valid URL: {e.reason}", fix)
        return False
    if url.scheme != "https" or "?" in value:
        report(where, f"{key} must be an https URL without a query: credentials are sent there",
               fix)
        return False
    return True


_REPO_RE = re.compile(r"(?:[A-Za-z0-9-]{1,39}/)?[A-Za-z0-9._-]{1,100}")
_PERMISSION_RE = re.compile(r"[a-z][a-z_]{0,63}")


def _compile_github_scope(rs: RuleSpec, loc: Loc, rep: Report) -> GitHubScope | None:
    g = rs.github_app
    assert g is not None
    repos: list[str] = []
    for j, r in enumerate(g.repositories or ()):
        if not _REPO_RE.fullmatch(r) or r.rsplit("/", 1)[-1] in (".", ".."):
            rep((*loc, "github_app", "repositories", j), f"{r!r} is not a repository name",
                "write the repository as name or owner/name, e.g. acme/api")
            continue
        repos.append(r.rsplit("/", 1)[-1])
    perms: list[tuple[str, str]] = []
    for k, v in (g.permissions or {}).items():
        if not _PERMISSION_RE.fullmatch(k):
            rep((*loc, "github_app", "permissions", k), f"{k!r} is not a permission name",
                "write GitHub's name for it, e.g. contents, pull_requests, issues")
            continue
        perms.append((k, v))
    return GitHubScope(tuple(sorted(set(repos))) if g.repositories is not None else None,
                       tuple(sorted(perms)) if g.permissions is not None else None)


def _compile_oauth2(name: str, spec: SecretSpec, kv_version: int, path: str,
                    report: Report) -> OAuth2Ref | None:
    o = spec.oauth2
    assert o is not None
    loc = ("secrets", name, "oauth2")
    ok = True
    if spec.dynamic is not None:
        report((*loc,), "a secret cannot be both `oauth2` and `dynamic`",
               "keep the client credentials in KV v2 (`vault:`) and drop `dynamic`")
        return None
    if kv_version != 2:
        report(("secrets", name, "kv_version"), "an oauth2 secret needs KV version 2",
               "store the client record in a KV v2 mount: a rotated refresh token is written "
               "back with check-and-set, which KV v1 cannot do")
        ok = False
    if "{{" in path:
        report(("secrets", name, "vault"), "an oauth2 secret's path cannot use {{ identity }} "
               "or {{ sandbox }}", "one client record per secret: declare one secret per client")
        ok = False
    if not _https_endpoint(o.token_url, (*loc, "token_url"), report,
                           "write the token endpoint's https:// URL, e.g. "
                           "https://auth.example.com/oauth/token"):
        ok = False
    if o.scope is not None and (not o.scope.strip() or has_control_chars(o.scope)):
        report((*loc, "scope"), "scope is empty or holds control characters",
               "write the scopes separated by spaces, e.g. 'read write', or drop `scope`")
        ok = False
    if not ok:
        return None
    return OAuth2Ref(token_url=o.token_url, grant=o.grant, scope=o.scope,
                     client_auth=o.client_auth, timeout=o.timeout)


_PATH_FIX = ("write literal path segments plus `{{ identity }}` or `{{ sandbox }}`, e.g. "
             "secret/data/sandboxes/{{ sandbox }}/github")


def _path(text: str, loc: Loc, report: Report) -> str | None:
    """A secret path with its `{{ identity }}`/`{{ sandbox }}` variables checked."""
    try:
        return parse_path(text)
    except ValueError as e:
        report(loc, str(e), _PATH_FIX)
        return None


def _compile_dynamic(name: str, spec: SecretSpec, report: Report) -> DynamicRef | None:
    assert spec.dynamic is not None
    given = [k for k in ("vault", "mount", "path", "field") if getattr(spec, k) is not None]
    if "kv_version" in spec.model_fields_set:
        given.append("kv_version")
    if given:
        report(("secrets", name, given[0]), f"`{given[0]}` is for KV secrets; a `dynamic` "
               "secret names its engine path and field inside `dynamic:`",
               f"remove `{given[0]}`, or write secrets.{name}.dynamic.path/field")
        return None
    d = spec.dynamic
    raw = d.path.strip().strip("/")
    if not raw:
        report(("secrets", name, "dynamic", "path"), "empty dynamic path",
               "name the engine path that mints the credential, e.g. database/creds/readonly")
        return None
    path = _path(raw, ("secrets", name, "dynamic", "path"), report)
    if path is None:
        return None
    if d.username_field is not None and not d.username_field.strip():
        report(("secrets", name, "dynamic", "username_field"), "empty username_field",
               "name the key of the user name in the engine's answer, e.g. username")
        return None
    return DynamicRef(path=path, field=d.field, username_field=d.username_field)


def _compile_kv_location(name: str, spec: SecretSpec,
                         report: Report) -> tuple[str, str, Literal[1, 2]] | None:
    """(mount, path, kv_version) of a KV secret, variables checked; None after a report."""
    kv_version = spec.kv_version
    if spec.vault is not None and (spec.mount is not None or spec.path is not None):
        report(("secrets", name, "vault"), "give either `vault` or `mount` + `path`, not both",
               "keep `vault: <mount>/data/<path>` for KV v2, or `mount`/`path` alone")
        return None
    if spec.vault is not None:
        if "kv_version" in spec.model_fields_set and spec.kv_version != 2:
            report(("secrets", name, "kv_version"),
                   "`vault:` is a KV v2 API path; kv_version must not be 1 with it",
                   f"for a KV v1 secret write `mount: ..., path: ..., kv_version: 1` "
                   f"under secrets.{name}")
            return None
        v = spec.vault.strip().strip("/")
        if "/data/" not in v:
            report(("secrets", name, "vault"),
                   f"vault path {spec.vault!r} is not a KV v2 API path (no '/data/')",
                   "write the KV v2 API path, e.g. secret/data/llm/anthropic; for a KV v1 "
                   "mount write `mount: <mount>, path: <path>, kv_version: 1` instead")
            return None
        mount, _, path = v.partition("/data/")
        kv_version = 2
        if not mount or not path.strip("/"):
            report(("secrets", name, "vault"),
                   f"vault path {spec.vault!r} needs a mount before and a path after '/data/'",
                   "e.g. secret/data/llm/anthropic")
            return None
        loc: Loc = ("secrets", name, "vault")
    elif spec.mount is not None or spec.path is not None:
        if spec.mount is None or spec.path is None:
            missing = "mount" if spec.mount is None else "path"
            report(("secrets", name), f"secret {name!r} has no `{missing}`",
                   "give both `mount` and `path` (or a KV v2 `vault:` path)")
            return None
        mount, path = spec.mount.strip().strip("/"), spec.path.strip().strip("/")
        if not mount or not path:
            report(("secrets", name, "mount" if not mount else "path"), "empty mount or path",
                   "name the KV mount and the path inside it")
            return None
        loc = ("secrets", name, "path")
    else:
        report(("secrets", name), f"secret {name!r} says neither `vault` nor `mount` + `path`, "
               "nor `dynamic`", "add `vault: secret/data/<path>` (KV v2), `mount`, `path` "
               "and kv_version, or `dynamic: {path: database/creds/<role>}`")
        return None
    if "{" in mount or "}" in mount:
        report(("secrets", name, "vault" if spec.vault is not None else "mount"),
               f"the mount {mount!r} cannot use variables; only the path inside it can",
               _PATH_FIX)
        return None
    checked = _path(path, loc, report)
    if checked is None:
        return None
    return mount, checked, kv_version


def compile_identity(
    name: str, rules: Sequence[tuple[int, RuleSpec]], file: str, line_of: Callable[[Loc], int],
    report: Report,
) -> CompiledIdentity:
    """Compile an identity's rules of one file: (index in the file's list, validated spec)
    pairs; rules that failed validation are left out by the caller and reported there. Checks
    names and rule combinations within these rules (the loader checks them again across files
    and templates: `check_rules`)."""
    out = CompiledIdentity()
    base: Loc = ("identities", name)
    check_identity_name(name, report)
    indexed = compile_rules(name, rules, file, line_of, report, out.uses,
                            lambda i: (*base, "rules", i))
    out.rules = [r for _, r in indexed]

    def at(k: int, sub: Loc, message: str, fix: str) -> None:
        report((*base, "rules", indexed[k][0], *sub), message, fix)

    check_rules(name, out.rules, at)
    return out


def check_identity_name(name: str, report: Report) -> None:
    if not NAME_RE.fullmatch(name):
        report(("identities", name), f"identity name {name!r} is not a valid name",
               "use letters, digits, '.', '_' and '-', starting with a letter or digit")


def compile_rules(
    identity: str, rules: Sequence[tuple[int, RuleSpec]], file: str,
    line_of: Callable[[Loc], int], report: Report, uses: list[SecretUse],
    loc_of: Callable[[int], Loc],
) -> list[tuple[int, Rule]]:
    """Compile rules one by one (no checks between rules): (index, rule) for those that
    compile; every problem is reported at loc_of(index)."""
    out: list[tuple[int, Rule]] = []
    for i, rs in rules:
        loc = loc_of(i)
        rule = _compile_rule(identity, rs, loc, Source(file, line_of(loc)), report, uses)
        if rule is not None:
            out.append((i, rule))
    return out


RuleReport = Callable[[int, Loc, str, str], None]  # (index in the rule list, sub-loc, msg, fix)


def check_rules(identity: str, rules: Sequence[Rule], report: RuleReport) -> None:
    """Checks between the rules of one identity, in decision order: unique names, and the rule
    combinations whose behaviour `check` would misstate (sandgate.policy.overlap)."""
    seen: dict[str, Rule] = {}
    for k, r in enumerate(rules):
        first = seen.get(r.name)
        if first is None:
            seen[r.name] = r
            continue
        where = (f"line {first.source.line}" if first.source.file == r.source.file
                 else str(first.source))
        report(k, ("name",), f"rule name {r.name!r} is used twice in identity {identity!r} "
               f"(first at {where})", "give each rule of an identity its own name (across its "
               "files and the templates it uses)")
    overlap.check_identity(identity, rules, report)


def _compile_rule(
    identity: str, rs: RuleSpec, loc: Loc, src: Source, report: Report, uses: list[SecretUse]
) -> Rule | None:
    n_before = _Counter(report)
    rep = n_before.report
    if not NAME_RE.fullmatch(rs.name):
        rep((*loc, "name"), f"rule name {rs.name!r} is not a valid name",
            "use letters, digits, '.', '_' and '-', starting with a letter or digit")

    host_patterns: list[HostPattern] = []
    if rs.public and rs.hosts is not None:
        rep((*loc, "public"), "a rule gives either `hosts` or `public: true`, not both",
            "remove `hosts` to allow any public host, or remove `public` to name the hosts")
    elif not rs.public and rs.hosts is None:
        # Reported where the rule's raw mapping is validated (missing_hosts), unless `hosts` was
        # given and is broken (reported as such); the rule is unusable either way.
        n_before.count += 1
    elif rs.public:
        host_patterns.append(ANY_PUBLIC_HOST)
    for j, h in enumerate(rs.hosts or ()):
        try:
            host_patterns.append(H.compile_host_pattern(h, deny=rs.action == "deny"))
        except ValueError as e:
            rep((*loc, "hosts", j), str(e),
                "write an exact host (api.example.com) or a leading wildcard over a registered "
                "domain ('*.example.com', quoted in YAML); no scheme, port, path or spaces")

    schemes = frozenset(rs.schemes or ["https"])

    if rs.ports is None:
        ports = frozenset(({443} if "https" in schemes else set()) |
                          ({80} if "http" in schemes else set()))
    else:
        good: set[int] = set()
        for j, p in enumerate(rs.ports):
            if not 1 <= p <= 65535:
                rep((*loc, "ports", j), f"port {p} is out of range",
                    "use a TCP port between 1 and 65535")
            else:
                good.add(p)
        ports = frozenset(good)

    methods: frozenset[str] | None = None
    if rs.methods is not None:
        ms: set[str] = set()
        for j, m in enumerate(rs.methods):
            mu = m.strip().upper()
            if not is_token(mu):
                rep((*loc, "methods", j), f"method {m!r} is not a valid HTTP method",
                    "use method names such as GET, HEAD, POST")
            elif mu not in REGISTERED_METHODS:
                close = difflib.get_close_matches(mu, STANDARD_METHODS, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                star = " (a method list has no wildcard)" if "*" in mu else ""
                rep((*loc, "methods", j),
                    f"unknown HTTP method {m!r}{star}: the rule would never match it",
                    f"{hint}use {', '.join(STANDARD_METHODS)} or a registered WebDAV method "
                    "(PROPFIND, MKCOL, COPY, MOVE, LOCK...); leave out `methods` to allow any "
                    "method")
            else:
                ms.add(mu)
        methods = frozenset(ms)

    paths: tuple[PathPattern, ...] | None = None
    if rs.paths is not None:
        ps: list[PathPattern] = []
        for j, pat in enumerate(rs.paths):
            try:
                ps.append(P.compile_path_pattern(pat))
            except ValueError as e:
                rep((*loc, "paths", j), str(e),
                    "write a path starting with '/', using '*' within a segment and '**' as a "
                    "whole segment, e.g. /v1/messages/* or /v1/**")
        paths = tuple(ps)

    inject = _compile_inject(rs, loc, rep, uses) if rs.inject is not None else None
    operations, copy_sources = _compile_signed(rs, loc, rep)

    for j, s in enumerate(rs.substitute):
        uses.append(SecretUse(s, (*loc, "substitute", j)))
    sub_headers = DEFAULT_SUBSTITUTE_HEADERS
    if rs.substitute_headers is not None:
        if not rs.substitute:
            rep((*loc, "substitute_headers"), "substitute_headers without substitute does nothing",
                "add the secrets to `substitute`, or remove substitute_headers")
        names: set[str] = set()
        for j, hname in enumerate(rs.substitute_headers):
            hl = hname.strip().lower()
            if not is_token(hl):
                rep((*loc, "substitute_headers", j), f"header name {hname!r} is not a valid HTTP "
                    "header name", "use letters, digits and '-' (e.g. x-api-key)")
                continue
            names.add(hl)
        sub_headers = frozenset(names)

    if rs.substitute_body and not rs.substitute:
        rep((*loc, "substitute_body"), "substitute_body without substitute does nothing",
            "name the secrets whose placeholders the body carries in `substitute`, or remove "
            "substitute_body")

    cidrs: list[IPNetwork] = []
    for j, c in enumerate(rs.private_cidrs):
        try:
            net = ipaddress.ip_network(c.strip(), strict=False)
        except ValueError as e:
            rep((*loc, "private_cidrs", j), f"{c!r} is not a valid CIDR: {e}",
                "write a network such as 10.1.2.0/24 or fd00::/64")
            continue
        if net.prefixlen == 0:
            rep((*loc, "private_cidrs", j), f"{c!r} covers every address",
                "name only the private range this rule needs, e.g. 10.1.2.0/24")
            continue
        cidrs.append(net)

    query, query_optional, query_absent = _compile_query(rs, loc, rep)

    max_bytes: int | None = None
    if rs.max_request_bytes is not None:
        max_bytes = parse_size(rs.max_request_bytes)
        if max_bytes is None:
            rep((*loc, "max_request_bytes"),
                f"{rs.max_request_bytes!r} is not a size of at least one byte",
                "write a number of bytes or a size such as 512k, 1m or 1g (lower case)")

    call = compile_call(rs, loc, rep, parse_size)
    dns_types = compile_dns(rs, loc, rep)
    if call is not None:  # the body is judged whole: bounded by the smaller limit
        max_bytes = min(max_bytes or call.max_body, call.max_body)

    # Combinations.
    l7 = [k for k in ("methods", "paths", "inject", "substitute_headers", "query",
                      "max_request_bytes", "mcp", "jsonrpc")
          if getattr(rs, k) is not None]
    if rs.substitute:
        l7.append("substitute")
    if rs.passthrough:
        if l7:
            rep((*loc, "passthrough"),
                f"a passthrough rule cannot also set {', '.join(l7)} (passthrough cannot see "
                "HTTP requests)",
                "drop passthrough to inspect requests, or move the HTTP-level settings to a "
                "separate, intercepted rule")
        if "http" in schemes:
            rep((*loc, "passthrough"), "passthrough only applies to https (CONNECT) tunnels",
                "remove http from schemes or drop passthrough")
        if rs.action == "deny":
            rep((*loc, "passthrough"), "passthrough is meaningless on a deny rule",
                "remove passthrough from the deny rule")
    secret_keys = [k for k in ("inject", "substitute") if (k == "inject" and rs.inject is not None)
                   or (k == "substitute" and rs.substitute)]
    if rs.public:
        if secret_keys:
            rep((*loc, secret_keys[0]), f"a `public: true` rule cannot {secret_keys[0]} "
                "credentials: they would go to every host on the internet",
                "name the hosts that need the credential in a rule of their own with `hosts:`")
        if rs.passthrough:
            rep((*loc, "passthrough"), "a `public: true` rule cannot be passthrough",
                "drop passthrough (every request is then judged), or name the hosts")
        if rs.private_cidrs:
            rep((*loc, "private_cidrs"), "a `public: true` rule cannot have private_cidrs: it "
                "reaches only hosts that resolve to public addresses",
                "move the private destinations to a rule that names their hosts")
    if rs.action == "deny" and rs.query is not None:
        rep((*loc, "query"), "a deny rule cannot match on `query`: a request that repeats or "
            "re-spells the parameter would not match it and pass",
            "allow only the values you want instead (an allow rule with `query:` matches "
            "nothing ambiguous)")
    if rs.action == "deny" and rs.max_request_bytes is not None:
        rep((*loc, "max_request_bytes"), "max_request_bytes on a deny rule limits nothing",
            "set it on the allow rule whose requests it should limit")
    if rs.action == "deny" and secret_keys:
        rep((*loc, secret_keys[0]), f"a deny rule cannot {secret_keys[0]} credentials",
            "remove it, or make this an allow rule")
    if secret_keys and not rs.public:
        for j, hp in enumerate(host_patterns):
            why = overbroad_wildcard(hp.suffix) if hp.wildcard else None
            if why is not None:
                rep((*loc, "hosts", j), f"{why}; this rule {' and '.join(secret_keys)}s "
                    "secrets, which would go to every one of them",
                    "name the exact hosts that need the credential, or a wildcard under a "
                    "domain the secret's owner controls (e.g. '*.myorg.github.io')")
    if "http" in schemes and secret_keys:
        rep((*loc, secret_keys[0]),
            f"{secret_keys[0]} on a rule whose schemes include http: credentials are only "
            "injected over TLS",
            "set `schemes: [https]` on this rule (or drop the credentials)")

    meta = _compile_meta(rs, loc, rep)
    ask = compile_ask(rs, loc, rep)
    llm = compile_llm(rs, loc, rep)  # `action: ask`: an allow rule held for approval

    if n_before.count:
        return None
    return Rule(
        name=rs.name, identity=identity, action="deny" if rs.action == "deny" else "allow",
        schemes=schemes,
        hosts=tuple(host_patterns), ports=ports, methods=methods, paths=paths, inject=inject,
        substitute=frozenset(rs.substitute), substitute_headers=sub_headers,
        private_cidrs=tuple(cidrs),
        passthrough=rs.passthrough, source=src, query=query, query_optional=query_optional,
        query_absent=query_absent,
        max_request_bytes=max_bytes, substitute_body=rs.substitute_body,
        github_scope=_compile_github_scope(rs, loc, rep) if rs.github_app else None,
        public=rs.public, where=loc, meta=meta, call=call, ask=ask, dns_types=dns_types,
        forward_trace_context=rs.forward_trace_context, operations=operations,
        copy_sources=copy_sources, llm=llm,
    )


def _compile_signed(rs: RuleSpec, loc: Loc, rep: Report
                    ) -> tuple[tuple[str, ...] | None, tuple[PathPattern, ...] | None]:
    """`operations:` and `copy_sources:`: what a signing rule judges besides the request line
    (sandgate.secrets.aws_request)."""
    signs = rs.inject is not None and rs.inject.sign is not None
    for key in ("operations", "copy_sources"):
        if getattr(rs, key) is not None and not signs:
            rep((*loc, key), f"`{key}` judges what a SigV4 signature covers, and this rule "
                "signs nothing", "add `inject: {sign: SECRET}` (an `aws:` secret), or remove "
                f"`{key}`")
    ops: tuple[str, ...] | None = None
    if rs.operations is not None:
        good: list[str] = []
        for j, op in enumerate(rs.operations):
            if not op or op != op.strip() or has_control_chars(op) or " " in op:
                rep((*loc, "operations", j), f"operation {op!r} is not an AWS operation name "
                    "or glob", "write e.g. SendMessage, DynamoDB_20120810.GetItem or "
                    "'*.GetItem' (no spaces)")
            else:
                good.append(op)
        ops = tuple(good)
    sources: tuple[PathPattern, ...] | None = None
    if rs.copy_sources is not None:
        ps: list[PathPattern] = []
        for j, pat in enumerate(rs.copy_sources):
            try:
                ps.append(P.compile_path_pattern(pat))
            except ValueError as e:
                rep((*loc, "copy_sources", j), str(e),
                    "write the source object as /bucket/key, with '*' within a segment and "
                    "'**' as a whole segment, e.g. /acme-artifacts/**")
        sources = tuple(ps)
    return ops, sources


def _compile_meta(rs: RuleSpec, loc: Loc, rep: Report) -> RuleMeta | None:
    """description, owner, ticket, expires: plain one-line text and a calendar day."""
    for key in ("description", "owner", "ticket"):
        text = getattr(rs, key)
        if text is not None and (not text.strip() or has_control_chars(text)):
            rep((*loc, key), f"`{key}` is empty or contains control characters",
                f"write one line of plain text, or remove `{key}`")
    expires = rs.expires
    if isinstance(expires, str):
        try:
            expires = date.fromisoformat(expires.strip())
        except ValueError:
            rep((*loc, "expires"), f"expires {rs.expires!r} is not a date",
                "write the day as YYYY-MM-DD, e.g. expires: 2027-03-31")
            expires = None
    ignore, why = _compile_lint(rs, loc, rep)
    if all(v is None for v in (rs.description, rs.owner, rs.ticket, expires)) and not ignore:
        return None
    return RuleMeta(rs.description, rs.owner, rs.ticket, expires, ignore, why)


def _compile_lint(rs: RuleSpec, loc: Loc, rep: Report) -> tuple[tuple[str, ...], str | None]:
    """`lint: {ignore: [CODE], why: ...}`: known codes, and a reason reviewers can read."""
    if rs.lint is None:
        return (), None
    lloc = (*loc, "lint")
    ok = True
    for j, code in enumerate(rs.lint.ignore):
        if code not in CODES:
            close = difflib.get_close_matches(code, list(CODES), n=1)
            rep((*lloc, "ignore", j), f"{code!r} is not a lint code",
                "write the code `sandgate lint` prints in brackets"
                + (f", e.g. {close[0]}" if close else "") + " (docs/policy-review.md lists "
                "them)")
            ok = False
    why = rs.lint.why
    if why is None or not why.strip() or has_control_chars(why):
        rep((*lloc, "why") if why is not None else lloc,
            f"`lint:` of rule '{rs.name}' suppresses {', '.join(rs.lint.ignore)} without a "
            "reason: `why` is required", "say why the warning does not apply to this rule, "
            "e.g. why: \"api.example.com is a Go server, `;` is not stripped\"")
        ok = False
    return (tuple(dict.fromkeys(rs.lint.ignore)), why.strip()) if ok and why else ((), None)


def _compile_query(rs: RuleSpec, loc: Loc, rep: Report
                   ) -> tuple[QueryConstraint, QueryConstraint, frozenset[str]]:
    """`query:` -> (required, optional, absent). A capitalised name or a '+' in a value is
    refused unless `exact: true`: the first matches only that spelling (and a request that
    also sends the usual lower-case one is refused), the second only a client that sends '%2B'
    (a literal '+' makes the query unreadable, so it matches no rule)."""
    required: list[tuple[str, frozenset[str]]] = []
    optional: list[tuple[str, frozenset[str]]] = []
    absent: set[str] = set()
    for qname, spec in (rs.query or {}).items():
        qloc: Loc = (*loc, "query", qname)
        if not qname or has_control_chars(qname) or any(c in qname for c in "&=#;+"):
            rep(qloc, f"query parameter name {qname!r} is not a plain name",
                "write the decoded name, without '&', '=', '#', ';', '+' or control "
                "characters, e.g. service")
            continue
        if spec == "absent":
            absent.add(qname)
            continue
        values, is_optional, exact = (spec, False, False) if isinstance(spec, list) else (
            spec.values, spec.optional, spec.exact)
        if not values:
            rep(qloc, f"query parameter {qname!r} lists no values: the rule would never match",
                f"list the values it may have, e.g. [git-upload-pack]; write `{qname}: absent` "
                "for a parameter that must be missing")
            continue
        bad = [v for v in values if has_control_chars(v)]
        if bad:
            rep(qloc, f"query value {bad[0]!r} contains control characters",
                "write the decoded value as plain text")
            continue
        # A leading capital (`Service`) is a slip; camelCase (`pageSize`) is how many APIs spell
        # names, and `sandgate lint` flags it only beside a lower-case twin.
        if not exact and qname[:1].isupper():
            rep(qloc, f"query parameter name {qname!r} has capitals: names are compared "
                f"exactly, so it matches only {qname!r}, never {qname.lower()!r}, and a request "
                "that sends both spellings is refused",
                f"write the name as the API spells it (usually `{qname.lower()}`); if the API "
                f"really spells it {qname!r}, write `{qname}: {{values: [...], exact: true}}`")
            continue
        plus = [v for v in values if "+" in v]
        if plus and not exact:
            rep(qloc, f"query value {plus[0]!r} contains '+': a request that sends '+' is "
                "unreadable (servers read it as a space or a plus) and matches no rule, so this "
                "value matches only a client that sends '%2B'",
                f"if the client form-encodes a space as '+', write the space "
                f"({plus[0].replace('+', ' ')!r}; it must then send %20); if it sends %2B, "
                f"write `{qname}: {{values: [...], exact: true}}`")
            continue
        (optional if is_optional else required).append((qname, frozenset(values)))
    return tuple(required), tuple(optional), frozenset(absent)


def parse_size(spec: int | str) -> int | None:
    """A `max_request_bytes` value: bytes (an integer, or digits), or k/m/g/t suffixed, as
    `--max-request-body` reads it (mitmproxy's parser). None when invalid or below 1."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, int):
        return spec if spec >= 1 else None
    try:
        n = human.parse_size(spec.strip())
    except ValueError:
        return None
    return n if n is not None and n >= 1 else None


class _Counter:
    def __init__(self, report: Report) -> None:
        self._report = report
        self.count = 0

    def report(self, loc: Loc, msg: str, fix: str) -> None:
        self.count += 1
        self._report(loc, msg, fix)


def _template(text: str, loc: Loc, report: Report, uses: list[SecretUse]) -> Template | None:
    try:
        t = parse_template(text)
    except ValueError as e:
        report(loc, str(e), template_fix(text))
        return None
    slots = {(p.name, p.part) for p in t.parts if isinstance(p, SecretSlot)}
    uses.extend(SecretUse(n, loc, part) for n, part in sorted(slots, key=str))
    return t


def _compile_inject(rs: RuleSpec, loc: Loc, report: Report, uses: list[SecretUse]) -> Injection:
    assert rs.inject is not None
    spec = rs.inject
    iloc: Loc = (*loc, "inject")
    headers: list[tuple[str, Template]] = []
    seen: set[str] = set()
    for hname, text in spec.headers.items():
        hl = hname.strip().lower()
        hloc: Loc = (*iloc, "headers", hname)
        if not is_token(hl):
            report(hloc, f"header name {hname!r} is not a valid HTTP header name",
                   "use letters, digits and '-' (e.g. x-api-key)")
            continue
        if hl in _NO_INJECT:
            report(hloc, f"header {hl!r} cannot be injected", "inject an auth header instead")
            continue
        if hl in seen:
            report(hloc, f"header {hl!r} is given twice (names are case-insensitive)",
                   "keep one")
            continue
        seen.add(hl)
        t = _template(text, hloc, report, uses)
        if t is not None:
            headers.append((hl, t))
    basic: tuple[Template, Template] | None = None
    if spec.basic is not None:
        if "authorization" in seen:
            report((*iloc, "basic"), "`basic` and an `authorization` header both set "
                   "Authorization", "keep one of them")
        u = _template(spec.basic.username, (*iloc, "basic", "username"), report, uses)
        p = _template(spec.basic.password, (*iloc, "basic", "password"), report, uses)
        if u is not None and p is not None:
            basic = (u, p)
    query: list[tuple[str, Template]] = []
    for qname, text in spec.query.items():
        qloc: Loc = (*iloc, "query", qname)
        if not qname or any(c in qname for c in "&=#?% ") or not qname.isprintable():
            report(qloc, f"query parameter name {qname!r} is not a plain name",
                   "use a name without '&', '=', '#', '?', '%' or spaces")
            continue
        t = _template(text, qloc, report, uses)
        if t is not None:
            query.append((qname, t))
    sign = None
    if spec.sign is not None:
        sign = (SignRef(spec.sign) if isinstance(spec.sign, str) else
                SignRef(spec.sign.secret, spec.sign.service, spec.sign.region))
        sloc: Loc = (*iloc, "sign")
        uses.append(SecretUse(sign.secret, sloc if isinstance(spec.sign, str) else
                              (*sloc, "secret"), part="sign", sign=sign,
                              hosts=tuple(rs.hosts or ())))
        if "authorization" in seen or basic is not None:
            report(sloc, "`sign` and an Authorization header both set Authorization",
                   "keep one of them")
        if not _aws_names(sign.region, sign.service, sloc, report):
            sign = None
    return Injection(headers=tuple(headers), basic=basic, query=tuple(query), sign=sign)


def compile_test(spec: TestSpec, loc: Loc, src: Source, report: Report,
                 uses: list[SecretUse] | None = None) -> PolicyTest | None:
    if spec.dns is not None:
        return compile_dns_test(spec, loc, src, report)
    if spec.request is None:
        report((*loc, "request"), "a fixture needs `request` (or `dns`)",
               "write e.g. `request: GET https://pypi.org/simple/`, or `dns: NAME` with "
               "expect: resolve or refuse")
        return None
    if spec.expect in ("resolve", "refuse") or spec.type is not None:
        report((*loc, "expect" if spec.type is None else "type"),
               "resolve, refuse and `type` are for `dns` fixtures",
               "expect allow, deny or tunnel for a request")
        return None
    parts = spec.request.split()
    if len(parts) != 2:
        report((*loc, "request"), f"request {spec.request!r} is not 'METHOD URL'",
               "write e.g. `request: GET https://pypi.org/simple/` (or `CONNECT host:port`)")
        return None
    method, url = parts
    connect = method.upper() == "CONNECT"
    ok = True
    if spec.gateway:
        if connect or not url.startswith("/"):
            report((*loc, "request"), f"a gateway fixture's request {spec.request!r} is not "
                   "'METHOD /PREFIX/PATH'", "write the path a sandbox sends to the gateway "
                   "listener, e.g. `request: POST /anthropic/v1/messages`, or remove `gateway`")
            return None
    elif connect:
        try:
            host, port = split_authority(url, "https")
        except ValueError as e:
            report((*loc, "request"), f"bad request {spec.request!r}: {e} (a tunnel is "
                   "written `CONNECT host:port`)",
                   "write a tunnel as `CONNECT host:port`, e.g. `CONNECT db.example.com:5432`")
            return None
        url = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    else:
        try:
            parse_url(method, url)
        except ValueError as e:
            report((*loc, "request"), f"bad request {spec.request!r}: {e}",
                   "write an absolute http(s) URL without credentials, e.g. "
                   "https://api.example.com/v1/x")
            return None
    inject: frozenset[str] | None = None
    if spec.inject == "none":
        inject = frozenset()
    elif spec.inject is not None:
        if not spec.inject:
            report((*loc, "inject"), "`inject: []` is ambiguous",
                   "write `inject: none` to assert that no secret is used")
            ok = False
        elif spec.expect in ("deny", "tunnel") or connect:
            what = ("a refused request" if spec.expect == "deny" else
                    "a tunnelled request" if spec.expect == "tunnel" else "a CONNECT tunnel")
            report((*loc, "inject"), f"{what} injects nothing",
                   "write `inject: none`, or remove `inject`")
            ok = False
        entries: list[str] = []
        for j, name in enumerate(spec.inject):
            if is_form(name):  # a credential form, compared with what explain prints
                try:
                    entries.append(parse_form(name))
                except ValueError as e:
                    report((*loc, "inject", j), str(e), "write a secret name, or the form "
                           "`sandgate explain` prints, e.g. gh-app(repo=acme/api, "
                           "contents=read) or aws(service=s3, region=eu-west-1)")
                    ok = False
                continue
            entries.append(name)
            if uses is not None:
                uses.append(SecretUse(name, (*loc, "inject", j)))
        inject = frozenset(entries)
    if spec.code is not None and spec.expect != "deny":
        report((*loc, "code"), "`code` (why a request is refused) is only for expect: deny",
               "remove `code`, or expect deny")
        ok = False
    if spec.expect == "tunnel" and spec.gateway:
        report((*loc, "expect"), "a gateway request is never tunnelled (no CONNECT precedes "
               "it, so passthrough rules do not apply)", "expect allow or deny")
        ok = False
    if spec.passthrough is not None and not connect:
        report((*loc, "passthrough"), "`passthrough` asserts how a CONNECT tunnel is handled",
               "write `request: CONNECT host:port` in this fixture, or remove `passthrough`")
        ok = False
    elif spec.passthrough and spec.expect == "deny":
        report((*loc, "passthrough"), "`passthrough: true` with expect: deny asserts nothing",
               "remove `passthrough`, or expect allow")
        ok = False
    if spec.websocket and method.upper() != "GET":
        report((*loc, "websocket"), "a WebSocket is opened by a GET request",
               "write e.g. `request: GET https://rpc.example.com/ws`, or remove `websocket`")
        ok = False
    call_ok, call = compile_test_call(spec, loc, report)
    headers: list[tuple[str, str]] = []
    for hname, value in (spec.headers or {}).items():
        try:
            headers.append(parse_header(hname, value))
        except ValueError as e:
            report((*loc, "headers", hname), str(e), "write a header as `name: value`, e.g. "
                   "`x-amz-copy-source: /bucket/key`")
            ok = False
    if headers and connect:
        report((*loc, "headers"), "a CONNECT tunnel carries no request headers",
               "write `request: METHOD URL` in this fixture, or remove `headers`")
        ok = False
    if spec.max_tokens is not None and spec.model is None:
        report((*loc, "max_tokens"), "`max_tokens` is the cap an LLM call asks for",
               "add `model:` (the call's model), or remove `max_tokens`")
        ok = False
    if spec.model is not None and method.upper() != "POST" and not spec.websocket:
        report((*loc, "model"), "an LLM call is a POST request (or a message on a WebSocket: "
               "`websocket: true` on a GET)",
               "write e.g. `request: POST https://api.anthropic.com/v1/messages`")
        ok = False
    if not ok or not call_ok:
        return None
    return PolicyTest(identity=spec.identity, method=method.upper(), url=url,
                      expect=spec.expect, rule=spec.rule, source=src, inject=inject,
                      code=spec.code, passthrough=spec.passthrough, sandbox=spec.sandbox,
                      gateway=spec.gateway, call=call, websocket=spec.websocket,
                      headers=tuple(headers), model=spec.model, max_tokens=spec.max_tokens)
