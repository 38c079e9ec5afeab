"""How a secret's value is produced, in one line, for `explain` and the reach report (a name,
a location, a grant: never a value)."""

from __future__ import annotations

from sandgate.policy.model import GitHubScope, Policy, Rule, SecretRef, SignRef
from sandgate.secrets.aws_scope import resolve
from sandgate.secrets.credential_form import aws_form, form


def gh_app_form(scope: GitHubScope | None) -> str:
    """`gh-app(repo=acme/api, contents=read)`; `gh-app()`: the installation's own grants."""
    if scope is None:
        return form("gh-app", ())
    return form("gh-app", [*(("repo", r) for r in scope.repositories or ()),
                           *(scope.permissions or ())])


def credential_forms(policy: Policy, rule: Rule, host: str | None) -> dict[str, str]:
    """The canonical form of each brokered credential `rule` gives a request to `host` (None:
    the rule's, where a scope the host decides is `?`): secret name -> form. Secrets read as
    they are stored (kv, dynamic, oauth2) have none: their name says it."""
    out: dict[str, str] = {}
    for name in sorted(rule.secrets):
        ref = policy.secrets.get(name)
        if ref is None:
            continue
        if ref.github_app is not None:
            out[name] = gh_app_form(rule.github_scope)
        sign = rule.inject.sign if rule.inject is not None else None
        if ref.aws is not None and sign is not None and sign.secret == name:
            scope = resolve(sign, ref.aws, host)
            out[name] = aws_form(scope.service or "?", scope.region or "?")
    return out


def describe(ref: SecretRef, scope: GitHubScope | None = None) -> str:
    """`scope`: the allowing rule's `github_app:` restrictions (for a github_app secret)."""
    if ref.github_app is not None:
        g = ref.github_app
        what = "" if scope is not None else " (the installation's repositories and permissions)"
        return (f"{gh_app_form(scope)}{what}: installation token of app {g.app_id}, installation "
                f"{g.installation_id}, minted per sandbox by Sandgate with the key at "
                f"{ref.location}#{ref.field}, revoked when the sandbox ends")
    if ref.aws is not None:
        named = ", ".join(f"{k}={v}" for k, v in (("service", ref.aws.service),
                                                  ("region", ref.aws.region)) if v)
        return (f"aws sigv4{f' ({named})' if named else ''}: Sandgate signs the request with "
                f"the keys at {ref.location} (the client's signing headers are removed)")
    if ref.oauth2 is not None:
        o = ref.oauth2
        asked = f", scope {o.scope!r}" if o.scope else ""
        return (f"oauth2 {o.grant}: access token from {o.token_url}{asked} (client record "
                f"{ref.location}), minted by Sandgate and cached until near expiry")
    if ref.dynamic is not None:
        return f"dynamic: minted per sandbox from {ref.dynamic.path} (field {ref.dynamic.field})"
    return f"kv v{ref.kv_version}: {ref.location}#{ref.field}"


def sign_text(policy: Policy, sign: SignRef, host: str | None) -> str:
    """`sign: aws(service=s3, region=eu-west-1) [service from the rule, region from the host]`
    for a request to `host` (None: the rule, whose hosts may differ)."""
    ref = policy.secrets.get(sign.secret)
    if ref is None or ref.aws is None:
        return f"sign: {sign.secret}"
    scope = resolve(sign, ref.aws, host)
    if host is not None and not scope.complete:
        return (f"sign: {scope.describe()} with secret {sign.secret}: host {host} gives no "
                "service/region, so the proxy refuses it (503 secret_unavailable)")
    text = scope.describe().replace("=?", "=<from the host>")
    return f"sign: {text} with secret {sign.secret}"
