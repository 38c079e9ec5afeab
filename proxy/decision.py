"""The decision: a pure function of (identity, request, policy).

The proxy, `sandgate check`, `sandgate explain` and later tools all call these and nothing else
to judge a request, so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.model import Policy, Rule
from proxy.refusal import Code
from proxy.request import RequestInfo


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    code: Code | None  # None when allowed; otherwise why not
    reason: str  # one human sentence, always set
    rule: Rule | None = None  # the rule that allowed, or the deny rule that refused
    hint: str | None = None  # how to fix the policy, for refusals

    @property
    def rule_name(self) -> str | None:
        return self.rule.name if self.rule else None


def decide(policy: Policy, identity: str, req: RequestInfo) -> Decision:
    raise NotImplementedError  # implemented in proxy/policy/decide.py; re-exported here


def decide_connect(policy: Policy, identity: str, host: str, port: int) -> Decision:
    raise NotImplementedError
