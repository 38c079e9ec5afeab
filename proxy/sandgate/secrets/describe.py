"""How a secret's value is produced, in one line, for `explain` and the reach report (a name,
a location, a grant: never a value)."""

from __future__ import annotations

from sandgate.policy.model import GitHubScope, Policy, SecretRef, SignRef
from sandgate.secrets.aws_scope import resolve


def describe(ref: SecretRef, scope: GitHubScope | None = None) -> str:
    """`scope`: the allowing rule's `github_app:` restrictions (for a github_app secret)."""
    if ref.github_app is not None:
        g = ref.github_app
        what = scope.describe() if scope is not None else (
            "the installation's repositories and permissions")
        return (f"gh-app({what}): installation token of app {g.app_id}, installation "
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
