"""Policy fixtures: the `tests:` of policy files, run by `sandgate check`.

Each fixture is judged by `sandgate.decision.judge`: the proxy's request parser, decision and
(for IP literals and --resolve names) address step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sandgate.decision import ADDRESS_UNCHECKED, Decision, decide_name, judge
from sandgate.errors import Code
from sandgate.gateway import gateway_url
from sandgate.llm.llmcall import stated_call
from sandgate.policy.model import Policy, PolicyTest, Rule
from sandgate.request import parse_url
from sandgate.secrets.credential_form import is_form
from sandgate.secrets.describe import credential_forms


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


def inject_mismatch(policy: Policy, expected: frozenset[str], used: frozenset[str],
                    rule: Rule | None, host: str | None) -> str | None:
    """None when `used` (the secrets the proxy would inject or substitute) is what a fixture's
    `inject:` says, else the message. An entry is a secret name (any form of it matches) or a
    credential form, which must equal the form of a used secret that no name entry claims."""
    forms = credential_forms(policy, rule, host) if rule is not None else {}
    names = {e for e in expected if not is_form(e)}
    wanted = {e for e in expected if is_form(e)}
    rest = used - names
    if names <= used and {forms.get(n) for n in rest} == wanted and all(n in forms for n in rest):
        return None
    if not wanted:
        return f"expected inject {_set(expected)}, got {_set(used)}"
    got = [f"{n}: {forms[n]}" if n in forms else n for n in used]
    return f"expected inject {_set(expected)}, got {_set(got)}"


def run_dns_test(policy: Policy, test: PolicyTest) -> FixtureResult:
    """A `dns: NAME` fixture: the policy DNS's own decision (decide_name)."""
    assert test.qtype is not None
    d = decide_name(policy, test.identity, test.url, test.qtype)
    got = "resolve" if d.allowed else "refuse"
    if got != test.expect:
        why = d.reason if d.allowed else f"{d.code}: {d.reason}"
        return FixtureResult(test, d, False, f"expected {test.expect}, got {got} ({why})")
    if test.rule is not None and d.rule_name != test.rule:
        return FixtureResult(test, d, False,
                             f"expected rule {test.rule!r}, got {d.rule_name!r} ({d.reason})")
    return FixtureResult(test, d, True, "ok")


def run_policy_test(policy: Policy, test: PolicyTest,
                    resolve: Mapping[str, str] | None = None) -> FixtureResult:
    if test.dns:
        return run_dns_test(policy, test)
    try:
        url = test.url
        if test.gateway:  # the gateway listener's own mapping of a gateway path
            url, _gw = gateway_url(policy.gateways, test.method, test.url)
        v = judge(policy, test.identity, test.method, url, resolve or {}, test.sandbox,
                  test.gateway, test.call, "websocket" if test.websocket else None,
                  test.headers, stated_call(test.model, test.max_tokens))
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
    if test.inject is not None:
        host = None if test.connect else parse_url(test.method, url).host
        wrong = inject_mismatch(policy, test.inject, v.secrets, d.rule, host)
        if wrong is not None:
            return result(False, f"{wrong} ({d.reason})")
    if test.passthrough is not None and v.passthrough != test.passthrough:
        return result(False, f"expected passthrough {str(test.passthrough).lower()}, got "
                      f"{str(v.passthrough).lower()} ({d.reason})")
    return result(True, "ok")
