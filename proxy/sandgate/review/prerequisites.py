"""Brokered credentials' prerequisites: can the identity reach the token endpoint?

Sandgate mints OAuth 2.0 access tokens (`oauth2:`) and GitHub App installation tokens
(`github_app:`) itself, at request time, and dials the token endpoint *as the calling identity*
(stages/s50_inject.py `token_dial`): the token request is judged by `decide` as a POST to the
endpoint by that identity's rules. A rule that injects such a secret for an identity whose rules
do not allow that POST loads, proves and passes its fixtures, and then answers every request
503 secret_unavailable. `sandgate check` reports each such (rule, secret) as an error and
`explain` says it for the rule it explains; the judgement is the proxy's own `decide`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandgate.decision import Decision, decide
from sandgate.policy.model import Policy, Rule, SecretRef
from sandgate.request import parse_url


def token_endpoint(ref: SecretRef) -> str | None:
    """The URL Sandgate POSTs to for this secret's value (None: not a brokered secret)."""
    if ref.oauth2 is not None:
        return ref.oauth2.token_url
    if ref.github_app is not None:
        g = ref.github_app
        return f"{g.api_url}/app/installations/{g.installation_id}/access_tokens"
    return None


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A rule injecting a brokered secret whose token endpoint its identity may not POST to."""

    identity: str
    rule: Rule
    secret: str
    url: str
    decision: Decision  # what the identity's rules say about POST url

    @property
    def message(self) -> str:
        why = (f"rule '{self.decision.rule_name}' denies it" if self.decision.rule_name
               else "no rule allows it")
        return (f"rule '{self.rule.name}' of identity '{self.identity}' injects secret "
                f"'{self.secret}', a token Sandgate requests from POST {self.url} as "
                f"'{self.identity}'; {why} ({self.decision.code}), so every request the rule "
                "allows is refused 503 secret_unavailable")

    @property
    def fix(self) -> str:
        info = parse_url("POST", self.url)
        port = "" if info.port == 443 else f", ports: [{info.port}]"
        return (f"give identity '{self.identity}' a rule allowing the token request, e.g. "
                f"{{name: {self.secret}-token, hosts: [{info.host}]{port}, methods: [POST], "
                f"paths: [\"{info.path}\"]}} (with private_cidrs if the endpoint is internal)"
                + (f", or narrow deny rule '{self.decision.rule_name}'"
                   if self.decision.rule_name else ""))

    def __str__(self) -> str:
        return f"{self.rule.source}: {self.message}. Fix: {self.fix}"


def rule_unreachable(policy: Policy, identity: str, rule: Rule) -> list[Unreachable]:
    """The brokered secrets `rule` injects whose token endpoint `identity` cannot reach."""
    out: list[Unreachable] = []
    if rule.action != "allow":
        return out
    for name in sorted(rule.secrets):
        ref = policy.secrets.get(name)
        url = token_endpoint(ref) if ref is not None else None
        if url is None:
            continue
        d = decide(policy, identity, parse_url("POST", url))
        if not d.allowed:
            out.append(Unreachable(identity, rule, name, url, d))
    return out


def unreachable(policy: Policy) -> list[Unreachable]:
    """Every (identity, rule, brokered secret) whose token endpoint the identity cannot reach,
    in policy order."""
    return [u for identity, ident in policy.identities.items() for rule in ident.rules
            for u in rule_unreachable(policy, identity, rule)]
