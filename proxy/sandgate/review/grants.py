"""What an allowing rule grants a request beyond letting it through: the approval gate (`ask`
or `allow`; who approves, how many, which mode, what a grant may be remembered for) and the
credentials (which secret, with which scope: GitHub App repositories and permissions, OAuth
scopes, the SigV4 service and region, where a stored secret is read).

One comparison, used by the reach diff (sandgate.review.reach_diff: the words a reviewer reads)
and the `narrower_than` proof (sandgate.review.proofs: a widened dimension refutes it), so the
two cannot disagree on what "wider" means. Pure: names, scopes and settings, never a value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandgate.policy.model import AskPolicy, GitHubScope, Policy, Rule, SecretRef
from sandgate.secrets.aws_scope import resolve
from sandgate.secrets.credential_form import aws_form
from sandgate.secrets.describe import credential_forms

Secrets = Mapping[str, SecretRef]


@dataclass(frozen=True, slots=True)
class Delta:
    """One dimension in which a grant changed: "approval: ask -> allow"."""

    dimension: str  # "approval", "credential gh", "secrets"
    words: str  # "ask -> allow", "contents read -> write"
    widened: bool  # the new grant gives something the old one did not

    def __str__(self) -> str:
        # "secrets a -> b" as the diff always wrote it; "approval: ask -> allow"
        return f"{self.dimension}{' ' if self.dimension == 'secrets' else ': '}{self.words}"


# --- the approval gate ------------------------------------------------------------------------


def _duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _list(items: Iterable[str] | None, none: str) -> str:
    return none if items is None else "[" + ", ".join(sorted(items)) + "]"


def describe_gate(ask: AskPolicy | None) -> str:
    """"allowed without approval", or "held for 2 approvers (any approver), mode hold"."""
    if ask is None:
        return "allowed without approval"
    who = f" of {', '.join(ask.approvers)}" if ask.approvers is not None else ""
    n = ask.require_approvers
    return (f"held for {n} approver{'s' if n > 1 else ''}{who}, mode {ask.mode}"
            + (f", remembered per {'/'.join(ask.remember)}"
               if ask.remember != ("request",) else ""))


def gate_deltas(old: AskPolicy | None, new: AskPolicy | None) -> list[Delta]:
    """How the approval gate changed; widened where fewer people, or fewer of them, now stand
    between the request and the upstream, or an approval lasts longer."""
    if old is None and new is None:
        return []
    if old is not None and new is None:
        return [Delta("approval", f"ask -> allow (was {describe_gate(old)})", True)]
    if old is None and new is not None:
        return [Delta("approval", f"allow -> ask ({describe_gate(new)})", False)]
    assert old is not None and new is not None
    out: list[Delta] = []
    if old.require_approvers != new.require_approvers:
        out.append(Delta("approval", f"approvers needed {old.require_approvers} -> "
                         f"{new.require_approvers}", new.require_approvers < old.require_approvers))
    if old.approvers != new.approvers:
        wider = new.approvers is None or (old.approvers is not None
                                          and not set(new.approvers) <= set(old.approvers))
        out.append(Delta("approval", f"who approves {_list(old.approvers, 'any approver')} -> "
                         f"{_list(new.approvers, 'any approver')}", wider))
    if old.mode != new.mode:
        # async: answered 202 at once, the identical request passes once approved, for up to
        # 7 days (hold: while the connection stays open, at most 15 minutes)
        out.append(Delta("approval", f"mode {old.mode} -> {new.mode}", new.mode == "async"))
    if old.remember != new.remember:
        out.append(Delta("approval", f"remember {_list(old.remember, '')} -> "
                         f"{_list(new.remember, '')}", not set(new.remember) <= set(old.remember)))
    # a ttl matters only where a decision may outlive its request (sandbox, identity)
    if old.max_remember_ttl != new.max_remember_ttl and {*old.remember, *new.remember} - {
            "request"}:
        out.append(Delta("approval", f"max_remember_ttl {_duration(old.max_remember_ttl)} -> "
                         f"{_duration(new.max_remember_ttl)}",
                         new.max_remember_ttl > old.max_remember_ttl))
    if old.timeout != new.timeout:  # how long it waits: not who decides
        out.append(Delta("approval", f"timeout {_duration(old.timeout)} -> "
                         f"{_duration(new.timeout)}", False))
    if old.webhook != new.webhook:
        out.append(Delta("approval", f"webhook {old.webhook or 'none'} -> "
                         f"{new.webhook or 'none'}", False))
    return out


# --- credentials ------------------------------------------------------------------------------

_LEVELS = {"read": 1, "write": 2, "admin": 3}


def _repos(scope: GitHubScope | None) -> tuple[str, ...] | None:
    return scope.repositories if scope is not None else None


def _perms(scope: GitHubScope | None) -> dict[str, str] | None:
    if scope is None or scope.permissions is None:
        return None  # the installation's
    return dict(scope.permissions)


_ALL = "all the installation's"


def _github_deltas(dim: str, old: GitHubScope | None, new: GitHubScope | None) -> list[Delta]:
    out: list[Delta] = []
    ro, rn = _repos(old), _repos(new)
    if ro != rn:
        wider = rn is None or (ro is not None and not set(rn) <= set(ro))
        out.append(Delta(dim, f"repositories {_list(ro, _ALL)} -> {_list(rn, _ALL)}", wider))
    po, pn = _perms(old), _perms(new)
    if po != pn:
        if po is None or pn is None:
            def show(p: dict[str, str] | None) -> str:
                return _ALL if p is None else _list((f"{k}={v}" for k, v in p.items()), "")
            out.append(Delta(dim, f"permissions {show(po)} -> {show(pn)}", pn is None))
        else:
            for name in sorted({*po, *pn}):
                a, b = po.get(name), pn.get(name)
                if a != b:
                    out.append(Delta(dim, f"{name} {a or 'none'} -> {b or 'none'}",
                                     _LEVELS.get(b or "", 0) > _LEVELS.get(a or "", 0)))
    return out


def _scopes(scope: str | None) -> frozenset[str] | None:
    return frozenset(scope.split()) if scope is not None else None


def _where(ref: SecretRef) -> str:
    if ref.dynamic is not None:
        return f"minted from {ref.dynamic.path}"
    return f"read from {ref.location}#{ref.field}"


def credential_text(secrets: Secrets, rule: Rule, host: str | None) -> str:
    """The secrets a rule binds with their scope, as explain writes them: "gh
    gh-app(repo=api, contents=read), crm OAuth scopes [contacts.read]"."""
    forms = credential_forms(Policy(identities={}, secrets=secrets), rule, host)
    parts = []
    for name in sorted(rule.secrets):
        ref = secrets.get(name)
        extra = forms.get(name)
        if extra is None and ref is not None and ref.oauth2 is not None:
            extra = f"OAuth scopes {_list(_scopes(ref.oauth2.scope), 'the client default')}"
        parts.append(f"{name} {extra}" if extra else name)
    return ", ".join(parts)


def credential_key(secrets: Secrets, rule: Rule) -> tuple[object, ...]:
    """Everything about a rule's credentials that credential_deltas compares (equal keys: no
    delta), for memoising searches."""
    refs = tuple((n, _ref_key(secrets.get(n))) for n in sorted(rule.secrets))
    sign = rule.inject.sign if rule.inject is not None else None
    return (refs, rule.github_scope if _has_github(secrets, rule) else None, sign)


def _ref_key(ref: SecretRef | None) -> tuple[object, ...] | None:
    if ref is None:
        return None
    return (ref.mount, ref.path, ref.field, ref.kv_version, ref.dynamic, ref.oauth2,
            ref.github_app, ref.aws)


def _has_github(secrets: Secrets, rule: Rule) -> bool:
    return any((ref := secrets.get(n)) is not None and ref.github_app is not None
               for n in rule.secrets)


def credential_deltas(old_secrets: Secrets, old: Rule, new_secrets: Secrets, new: Rule,
                      host: str | None) -> list[Delta]:
    """How the credentials of a request to `host` changed between the old deciding rule and the
    new one. A secret the old rule did not bind, or one of the same name now read from
    elsewhere or for another app, is a widening (its reach cannot be compared); a scope is
    compared: more repositories, a higher permission, more OAuth scopes widen, a different
    SigV4 service or region is another grant."""
    out: list[Delta] = []
    if old.secrets != new.secrets:
        added = new.secrets - old.secrets
        where = "; ".join(f"{n} {_where(r)}" for n in sorted(added)
                          if (r := new_secrets.get(n)) is not None and r.github_app is None
                          and r.aws is None)
        out.append(Delta("secrets", f"{', '.join(sorted(old.secrets)) or 'none'} -> "
                         f"{', '.join(sorted(new.secrets)) or 'none'}"
                         + (f" ({where})" if where else ""), bool(added)))
    for name in sorted(old.secrets & new.secrets):
        ro, rn = old_secrets.get(name), new_secrets.get(name)
        if ro is None or rn is None:
            continue
        dim = f"credential {name}"
        if ro.github_app != rn.github_app and ro.github_app and rn.github_app:
            out.append(Delta(dim, f"app {ro.github_app.app_id} installation "
                             f"{ro.github_app.installation_id} -> app {rn.github_app.app_id} "
                             f"installation {rn.github_app.installation_id}", True))
        if rn.github_app is not None and ro.github_app is not None:
            out += _github_deltas(dim, old.github_scope, new.github_scope)
        if ro.oauth2 is not None and rn.oauth2 is not None:
            so, sn = _scopes(ro.oauth2.scope), _scopes(rn.oauth2.scope)
            if so != sn:
                out.append(Delta(dim, f"OAuth scopes {_list(so, 'the client default')} -> "
                                 f"{_list(sn, 'the client default')}",
                                 so is None or sn is None or not sn <= so))
            if (ro.oauth2.token_url, ro.oauth2.grant) != (rn.oauth2.token_url, rn.oauth2.grant):
                out.append(Delta(dim, f"OAuth {ro.oauth2.grant} at {ro.oauth2.token_url} -> "
                                 f"{rn.oauth2.grant} at {rn.oauth2.token_url}", True))
        so_ = old.inject.sign if old.inject is not None else None
        sn_ = new.inject.sign if new.inject is not None else None
        if (ro.aws is not None and rn.aws is not None and so_ is not None and sn_ is not None
                and so_.secret == name and sn_.secret == name):
            a, b = resolve(so_, ro.aws, host), resolve(sn_, rn.aws, host)
            fa = aws_form(a.service or "?", a.region or "?")
            fb = aws_form(b.service or "?", b.region or "?")
            if fa != fb:
                out.append(Delta(dim, f"{fa} -> {fb}", True))
        kinds = (ro.github_app is None, ro.oauth2 is None, ro.aws is None)
        if kinds != (rn.github_app is None, rn.oauth2 is None, rn.aws is None) or (
                (ro.mount, ro.path, ro.field, ro.kv_version, ro.dynamic)
                != (rn.mount, rn.path, rn.field, rn.kv_version, rn.dynamic)):
            out.append(Delta(dim, f"{_where(ro)} -> {_where(rn)}", True))
    return out


def grant_deltas(old_secrets: Secrets, old: Rule, new_secrets: Secrets, new: Rule,
                 host: str | None) -> list[Delta]:
    """Every change of what the deciding rule grants a request to `host`: approval, then
    credentials."""
    return [*gate_deltas(old.ask, new.ask),
            *credential_deltas(old_secrets, old, new_secrets, new, host)]


def grant_key(secrets: Secrets, rule: Rule) -> tuple[object, ...]:
    """Equal keys: grant_deltas finds nothing between the two rules (whatever the host)."""
    return (rule.ask, credential_key(secrets, rule))


__all__ = ["Delta", "credential_deltas", "credential_key", "credential_text", "describe_gate",
           "gate_deltas", "grant_deltas", "grant_key"]
