"""Property: the reach diff agrees with decide(). Every request on which two random policies
decide differently is covered by a change of the right direction, every example a change shows
is decided differently, and a policy never differs from itself."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sandgate.decision import decide
from sandgate.policy.loader import PolicyError
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo, parse_url
from sandgate.review.reach_diff import reach_diff
from tests.unit.fuzz import examples
from tests.unit.test_fuzz_decide import load, policies, requests

pytestmark = pytest.mark.unit


def _load(rules: list[dict[str, Any]]) -> Policy:
    try:
        return load(rules, True)
    except PolicyError:
        assume(False)
        raise


def _allows(p: Policy, req: RequestInfo) -> bool:
    return decide(p, "agent", req).allowed


@settings(max_examples=examples(60), deadline=None)
@given(policies, policies, st.lists(requests(), min_size=1, max_size=12))
def test_reach_diff_agrees_with_decide(old_rules: list[dict[str, Any]],
                                       new_rules: list[dict[str, Any]],
                                       reqs: list[tuple[RequestInfo, str]]) -> None:
    old, new = _load(old_rules), _load(new_rules)
    assert reach_diff(old, old).changes == []
    d = reach_diff(old, new)
    agent = [c for c in d.changes if c.identity == "agent"]
    for c in agent:
        if c.kind not in ("reachable", "unreachable"):
            continue
        method, url = c.example.split(" ", 1)
        req = parse_url(method, url)
        assert _allows(new, req) == (c.kind == "reachable")
        assert _allows(old, req) == (c.kind == "unreachable")
    for req, _host in reqs:
        a, b = _allows(old, req), _allows(new, req)
        if a != b:
            kind = "reachable" if b else "unreachable"
            assert any(c.kind == kind for c in agent), (req, [c.summary() for c in agent])
