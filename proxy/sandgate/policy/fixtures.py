"""Policy fixtures: the `tests:` of policy files, run by `sandgate check`."""

from __future__ import annotations

from dataclasses import dataclass

from sandgate.decision import Decision, decide
from sandgate.errors import Code
from sandgate.policy.model import Policy, PolicyTest
from sandgate.request import parse_url


@dataclass(frozen=True, slots=True)
class FixtureResult:
    test: PolicyTest
    decision: Decision
    passed: bool
    message: str


def run_policy_tests(policy: Policy) -> list[FixtureResult]:
    return [run_policy_test(policy, t) for t in policy.tests]


def run_policy_test(policy: Policy, test: PolicyTest) -> FixtureResult:
    try:
        req = parse_url(test.method, test.url)
    except ValueError as e:
        d = Decision(False, Code.BAD_REQUEST, f"bad request: {e}")
        return FixtureResult(test, d, False, str(e))
    d = decide(policy, test.identity, req)
    got = "allow" if d.allowed else "deny"
    if got != test.expect:
        why = d.reason if d.allowed else f"{d.code}: {d.reason}"
        return FixtureResult(test, d, False, f"expected {test.expect}, got {got} ({why})")
    if test.rule is not None and d.rule_name != test.rule:
        return FixtureResult(test, d, False, f"expected rule {test.rule!r}, got "
                             f"{d.rule_name!r} ({d.reason})")
    return FixtureResult(test, d, True, "ok")
