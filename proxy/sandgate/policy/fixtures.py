"""Policy fixtures: the `tests:` of policy files, run by `sandgate check`.

Each fixture is judged by `sandgate.decision.judge`: the proxy's request parser, decision and
(for IP literals and --resolve names) address step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandgate.decision import ADDRESS_UNCHECKED, Decision, judge
from sandgate.errors import Code
from sandgate.gateway import gateway_url
from sandgate.policy.model import Policy, PolicyTest


@dataclass(frozen=True, slots=True)
class FixtureResult:
    test: PolicyTest
    decision: Decision
    passed: bool
    message: str
    address: str | None = None  # what happened to the address (None: bad request)
    secrets: frozenset[str] = frozenset()  # injected or substituted
    passthrough: bool = False


def run_policy_tests(policy: Policy,
                     resolve: Mapping[str, str] | None = None) -> list[FixtureResult]:
    return [run_policy_test(policy, t, resolve or {}) for t in policy.tests]


def _set(names: Iterable[str]) -> str:
    s = sorted(names)
    return "none" if not s else "[" + ", ".join(s) + "]"


def run_policy_test(policy: Policy, test: PolicyTest,
                    resolve: Mapping[str, str] | None = None) -> FixtureResult:
    try:
        url = test.url
        if test.gateway:  # the gateway listener's own mapping of a gateway path
            url, _gw = gateway_url(policy.gateways, test.method, test.url)
        v = judge(policy, test.identity, test.method, url, resolve or {}, test.sandbox,
                  test.gateway, test.call)
    except ValueError as e:
        d = Decision(False, Code.BAD_REQUEST, f"bad request: {e}")
        return FixtureResult(test, d, False, str(e))
    d = v.decision

    def result(passed: bool, message: str) -> FixtureResult:
        if not passed and v.address == ADDRESS_UNCHECKED and test.code == "internal_address":
            message += ("; the address is resolved at request time: pass --resolve HOST=IP to "
                        "`sandgate check` to check it")
        return FixtureResult(test, d, passed, message, v.address, v.secrets, v.passthrough)

    got = d.outcome
    # A CONNECT fixture may say `expect: allow` of a passthrough tunnel (the CONNECT is granted;
    # `passthrough:` says how). A request that is tunnelled is never an allow: nothing judges it.
    if got != test.expect and not (test.connect and got == "tunnel" and test.expect == "allow"):
        why = d.reason if d.allowed else f"{d.code}: {d.reason}"
        return result(False, f"expected {test.expect}, got {got} ({why})")
    if test.rule is not None and d.rule_name != test.rule:
        return result(False, f"expected rule {test.rule!r}, got {d.rule_name!r} ({d.reason})")
    if test.code is not None and (d.code is None or str(d.code) != test.code):
        return result(False, f"expected code {test.code}, got {d.code} ({d.reason})")
    if test.inject is not None and v.secrets != test.inject:
        return result(False, f"expected inject {_set(test.inject)}, got {_set(v.secrets)} "
                      f"({d.reason})")
    if test.passthrough is not None and v.passthrough != test.passthrough:
        return result(False, f"expected passthrough {str(test.passthrough).lower()}, got "
                      f"{str(v.passthrough).lower()} ({d.reason})")
    return result(True, "ok")
