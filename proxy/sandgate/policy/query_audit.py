"""Which query values the audit keeps: those of parameters some rule's `query:` constrains.

A reviewer replaying traffic (`sandgate diff --traffic`) must see them: a change from
`service: [git-upload-pack]` to `[git-upload-pack, git-receive-pack]` is invisible when every
value is REDACTED. Never kept: a parameter any rule injects (`inject.query`), which carries a
secret once injected. Values Sandgate knows to be secret are scrubbed from the path anyway
(audit.SCRUBBED).
"""

from __future__ import annotations

from sandgate.policy.model import Policy

_last: tuple[Policy | None, frozenset[str]] = (None, frozenset())


def query_names(policy: Policy) -> frozenset[str]:
    constrained = {n for i in policy.identities.values() for r in i.rules for n, _ in r.query}
    injected = {n for i in policy.identities.values() for r in i.rules if r.inject
                for n, _ in r.inject.query}
    return frozenset(constrained - injected)


def kept_query_names(policy: Policy | None) -> frozenset[str]:
    """query_names, remembered for the last policy (the proxy's is the same object per flow
    until a reload)."""
    global _last
    if policy is None:
        return frozenset()
    if _last[0] is not policy:
        _last = (policy, query_names(policy))
    return _last[1]
