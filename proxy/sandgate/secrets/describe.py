"""How a secret's value is produced, in one line, for `explain` and the reach report (a name,
a location, a grant: never a value)."""

from __future__ import annotations

from sandgate.policy.model import SecretRef


def describe(ref: SecretRef) -> str:
    if ref.oauth2 is not None:
        o = ref.oauth2
        scope = f", scope {o.scope!r}" if o.scope else ""
        return (f"oauth2 {o.grant}: access token from {o.token_url}{scope} (client record "
                f"{ref.location}), minted by Sandgate and cached until near expiry")
    if ref.dynamic is not None:
        return f"dynamic: minted per sandbox from {ref.dynamic.path} (field {ref.dynamic.field})"
    return f"kv v{ref.kv_version}: {ref.location}#{ref.field}"
