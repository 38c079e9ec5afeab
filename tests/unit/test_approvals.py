"""`action: ask`: the policy form and its errors, the decision (deny > ask > allow), lint, the
pure vote and scope rules, the in-process store and service (fake clock), and the admin roles.
The Redis store, the proxy's hold and the CLI are shown end to end in
tests/integration/test_approvals.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from sandgate.admin.access import auth_middleware, load_admin_users
from sandgate.approvals import api as approvals_api
from sandgate.approvals import bound_headers as H
from sandgate.approvals.service import Approvals, AskLimits, Request
from sandgate.approvals.store import MemoryStore
from sandgate.approvals.votes import (
    Approval,
    Scope,
    VoteError,
    fingerprint,
    grant_for,
    parse_scope,
    vote,
)
from sandgate.approvals.webhook import body_for, sign, verify
from sandgate.decision import decide, decide_connect
from sandgate.errors import ApprovalRefused, Code
from sandgate.policy.fixtures import run_policy_tests as run_fixtures
from sandgate.policy.loader import PolicyError, load_policy_files
from sandgate.policy.model import Policy, Rule, Source, Webhook
from sandgate.request import parse_url
from sandgate.review.lint import lint_policy
from sandgate.rpc.jsonrpc import tool_call

pytestmark = pytest.mark.unit

BASE = """
version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
  hook: {vault: secret/data/hook, field: key}
webhooks:
  ops: {url: "https://hooks.example.com/x", format: slack, secret: hook}
identities:
  agent:
    rules:
      - name: api
        hosts: [api.example.com]
      - name: deletes
        action: ask
        hosts: [api.example.com]
        methods: [DELETE]
        inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}
        approval: {timeout: 2m, require_approvers: 2, approvers: [alice, bob],
                   remember: [request, sandbox], webhook: ops}
      - name: no-admin
        action: deny
        hosts: [api.example.com]
        paths: [/admin/**]
tests:
  - {identity: agent, request: DELETE https://api.example.com/repos/x, expect: ask,
     rule: deletes, inject: [gh]}
  - {identity: agent, request: GET https://api.example.com/repos/x, expect: allow, rule: api}
  - {identity: agent, request: DELETE https://api.example.com/admin/x, expect: deny,
     rule: no-admin}
"""


def load(tmp_path: Path, text: str) -> Policy:
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return load_policy_files([p])


def problems(tmp_path: Path, text: str) -> str:
    with pytest.raises(PolicyError) as e:
        load(tmp_path, text)
    return str(e.value)


def rule(text: str) -> str:
    return f"""
version: v1
identities:
  agent:
    rules:
{text}
"""


# --------------------------------------------------------------------------- policy

def test_ask_rule_loads_with_its_settings(tmp_path):
    p = load(tmp_path, BASE)
    r = next(r for r in p.identities["agent"].rules if r.name == "deletes")
    assert r.action == "allow" and r.verb == "ask" and r.ask is not None
    assert r.ask.timeout == 120 and r.ask.require_approvers == 2
    assert r.ask.approvers == ("alice", "bob") and r.ask.remember == ("request", "sandbox")
    assert r.ask.mode == "hold" and r.ask.webhook == "ops" and r.ask.max_remember_ttl == 86400
    assert p.webhooks["ops"].format == "slack" and p.webhooks["ops"].secret == "hook"
    assert all(res.passed for res in run_fixtures(p)), [res.message for res in run_fixtures(p)]


def test_defaults(tmp_path):
    p = load(tmp_path, rule("      - {name: a, action: ask, hosts: [x.example.com]}"))
    ask = p.identities["agent"].rules[0].ask
    assert ask is not None and ask.timeout == 120 and ask.require_approvers == 1
    assert ask.approvers is None and ask.mode == "hold" and ask.remember == ("request",)


def test_timeout_and_require_approvers_on_the_rule_itself(tmp_path):
    """The issue's spelling: `timeout` and `require_approvers` written on the ask rule."""
    p = load(tmp_path, rule("      - {name: a, action: ask, hosts: [x.example.com], "
                            "timeout: 5m, require_approvers: 2}"))
    ask = p.identities["agent"].rules[0].ask
    assert ask is not None and ask.timeout == 300 and ask.require_approvers == 2
    # beside other `approval:` keys
    p = load(tmp_path, rule("      - {name: a, action: ask, hosts: [x.example.com], "
                            "timeout: 30, approval: {mode: async, remember: [sandbox]}}"))
    ask = p.identities["agent"].rules[0].ask
    assert ask is not None and ask.timeout == 30 and ask.mode == "async"


@pytest.mark.parametrize(("text", "expected"), [
    ("      - {name: a, hosts: [x.example.com], approval: {timeout: 5}}",
     "`approval:` only applies to `action: ask` rules"),
    ("      - {name: a, action: ask, hosts: [x.example.com], passthrough: true}",
     "an ask rule cannot be passthrough"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {timeout: 1h}}",
     "over the 900s a request may wait in mode hold"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {timeout: soon}}",
     "invalid TTL 'soon'"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {timeout: 0}}",
     "`timeout` must be at least 1 second"),
    ("      - {name: a, action: ask, hosts: [x.example.com],\n"
     "         approval: {require_approvers: 3, approvers: [alice, bob, alice]}}",
     "`require_approvers: 3` cannot be met by the 2 distinct approver(s) named"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {approvers: ['a b']}}",
     "approver 'a b' is not a valid user name"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {webhook: nope}}",
     "names webhook 'nope', which is not defined"),
    ("      - {name: a, action: ask, hosts: [x.example.com], approval: {remember: [forever]}}",
     "remember"),
    ("      - {name: a, action: maybe, hosts: [x.example.com]}", "action"),
    ("      - {name: a, hosts: [x.example.com], timeout: 5m}",
     "`timeout:` only applies to `action: ask` rules"),
    ("      - {name: a, action: deny, hosts: [x.example.com], require_approvers: 2}",
     "`require_approvers:` only applies to `action: ask` rules"),
    ("      - {name: a, action: ask, hosts: [x.example.com], timeout: 5m,\n"
     "         approval: {timeout: 2m}}",
     "`timeout` is given twice: on the rule and under `approval:`"),
    ("      - {name: a, action: ask, hosts: [x.example.com], timeout: 1h}",
     "over the 900s a request may wait in mode hold"),
    ("      - {name: a, action: ask, hosts: [x.example.com], require_approvers: 3,\n"
     "         approval: {approvers: [alice, bob]}}",
     "`require_approvers: 3` cannot be met by the 2 distinct approver(s) named"),
    ("      - {name: a, action: ask, hosts: [x.example.com], require_approvers: 0}",
     "require_approvers"),
])
def test_schema_errors_are_clear(tmp_path, text, expected):
    assert expected in problems(tmp_path, rule(text))


@pytest.mark.parametrize(("hook", "expected"), [
    ('{url: "http://hooks.example.com/x"}', "must be https (http only to a loopback address)"),
    ('{url: "https://u:p@hooks.example.com/x"}', "must not carry a user name or password"),
    ('{url: "ftp://hooks.example.com/x"}', "must be an absolute https:// URL"),
    ('{url: "https://hooks.example.com/x", secret: undeclared}',
     "secret 'undeclared' is not declared"),
    ('{url: "https://hooks.example.com/x", format: teams}', "format"),
])
def test_webhook_errors(tmp_path, hook, expected):
    text = rule("      - {name: a, action: ask, hosts: [x.example.com]}") + \
        f"webhooks:\n  ops: {hook}\n"
    assert expected in problems(tmp_path, text)


def test_a_webhook_is_named_once_across_files(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text('version: v1\nwebhooks:\n  ops: {url: "https://h.example.com/1"}\n')
    b.write_text('version: v1\nwebhooks:\n  ops: {url: "https://h.example.com/2"}\n')
    with pytest.raises(PolicyError) as e:
        load_policy_files([a, b])
    assert "webhook 'ops' is also defined at" in str(e.value)


def test_loopback_http_webhook_is_allowed(tmp_path):
    text = rule("      - {name: a, action: ask, hosts: [x.example.com], "
                "approval: {webhook: local}}") + \
        'webhooks:\n  local: {url: "http://127.0.0.1:9000/hook", format: json}\n'
    assert load(tmp_path, text).webhooks["local"].url == "http://127.0.0.1:9000/hook"


# --------------------------------------------------------------------------- decision

def test_deny_wins_over_ask_and_ask_over_allow(tmp_path):
    p = load(tmp_path, BASE)

    def d(method: str, url: str) -> Any:
        return decide(p, "agent", parse_url(method, url))
    ask = d("DELETE", "https://api.example.com/repos/x")
    assert ask.allowed and ask.ask and ask.outcome == "ask" and ask.rule_name == "deletes"
    assert "held for approval" in ask.reason
    allow = d("GET", "https://api.example.com/repos/x")
    assert allow.outcome == "allow" and not allow.ask
    deny = d("DELETE", "https://api.example.com/admin/x")
    assert deny.outcome == "deny" and deny.code == Code.DENIED_BY_RULE
    # the CONNECT is intercepted (each request inside judged), never passed through
    c = decide_connect(p, "agent", "api.example.com", 443)
    assert c.allowed and not c.tunnel


def test_ask_wins_even_when_the_allow_rule_comes_first(tmp_path):
    p = load(tmp_path, rule(
        "      - {name: all, hosts: [x.example.com]}\n"
        "      - {name: pay, action: ask, hosts: [x.example.com], paths: [/pay/**]}"))
    assert decide(p, "agent", parse_url("POST", "https://x.example.com/pay/1")).ask
    assert not decide(p, "agent", parse_url("POST", "https://x.example.com/other")).ask


def test_ask_on_a_tool_call(tmp_path):
    """An ask rule with `mcp:` holds only the tool calls it names; the head is held for the
    body's call to be judged (the proxy decides again with the call: s35_call)."""
    text = rule(
        "      - {name: mcp, hosts: [mcp.example.com], mcp: {tools: ['get_*']}}\n"
        "      - {name: mcp-delete, action: ask, hosts: [mcp.example.com],\n"
        "         mcp: {tools: [delete_repo]}}") + (
        "tests:\n"
        "  - {identity: agent, request: POST https://mcp.example.com/mcp, expect: ask,\n"
        "     rule: mcp-delete, mcp: {tool: delete_repo}}\n"
        "  - {identity: agent, request: POST https://mcp.example.com/mcp, expect: allow,\n"
        "     rule: mcp, mcp: {tool: get_issue}}\n")
    p = load(tmp_path, text)
    info = parse_url("POST", "https://mcp.example.com/mcp")
    d = decide(p, "agent", info, tool_call("delete_repo"))
    assert d.ask and d.rule_name == "mcp-delete"
    assert decide(p, "agent", info, tool_call("get_issue")).outcome == "allow"
    assert decide(p, "agent", info, tool_call("drop_db")).outcome == "deny"
    assert all(r.passed for r in run_fixtures(p)), [r.message for r in run_fixtures(p)]


def test_fixture_expecting_allow_fails_on_an_ask(tmp_path):
    text = rule("      - {name: pay, action: ask, hosts: [x.example.com]}") + (
        "tests:\n  - {identity: agent, request: GET https://x.example.com/, expect: allow}\n")
    res = run_fixtures(load(tmp_path, text))
    assert not res[0].passed and "expected allow, got ask" in res[0].message


# --------------------------------------------------------------------------- lint

def test_lint_knows_ask_rules(tmp_path):
    text = rule(
        "      - {name: gets, hosts: [x.example.com], methods: [GET], paths: [/a/**]}\n"
        "      - {name: held, action: ask, hosts: [x.example.com], methods: [GET]}\n"
        "      - {name: never, action: ask, hosts: [x.example.com], paths: [/admin/**],\n"
        "         approval: {timeout: 10m}}\n"
        "      - {name: cut, action: deny, hosts: [x.example.com], paths: [/admin/**]}\n"
        "      - {name: later, action: ask, hosts: [x.example.com], methods: [GET],\n"
        "         paths: [/b/**]}\n") + \
        'webhooks:\n  idle: {url: "https://h.example.com/1"}\n'
    msgs = [f.message for f in lint_policy(load(tmp_path, text))]
    assert any("allow rule 'gets' never decides alone: ask rule 'held'" in m for m in msgs)
    assert any("ask rule 'never' never asks: deny rule 'cut'" in m for m in msgs)
    assert any("holds a request up to 600s" in m for m in msgs)
    assert any("rule 'later' never applies: earlier allow rule 'held'" in m for m in msgs)
    assert any("webhook 'idle' is not named by any ask rule" in m for m in msgs)


def test_lint_base_policy_is_clean_of_ask_findings(tmp_path):
    msgs = [f.message for f in lint_policy(load(tmp_path, BASE))]
    assert not [m for m in msgs if "ask" in m or "webhook" in m], msgs
    assert not [m for m in msgs if "secret 'hook'" in m]  # a webhook's secret is used


# --------------------------------------------------------------------------- votes, scopes

def approval(**kw: Any) -> Approval:
    base: dict[str, Any] = dict(
        id="ap_1", identity="agent", sandbox="sb-1", method="DELETE",
        url="https://api.example.com/repos/x", host="api.example.com", tool=None,
        rule="deletes", rule_source="p.yaml:9", body_sha256="0" * 64, body_size=0,
        headers_sha256="a" * 64, headers=(("content-type", "application/json"),),
        headers_injected=("authorization",), created=1000.0, expires=1120.0, mode="hold",
        require_approvers=2,
        approvers=("alice", "bob"), remember=("request", "sandbox"), max_remember_ttl=7200,
        fingerprint="f")
    base.update(kw)
    return Approval(**base)


def test_one_user_approving_twice_counts_once():
    a = vote(approval(), "alice", "approve", Scope(), None, 1001)
    assert a.state == "pending" and a.approved_by == ("alice",)
    assert vote(a, "alice", "approve", Scope(), None, 1002) is a
    b = vote(a, "bob", "approve", Scope(), "fine", 1003)
    assert b.state == "approved" and b.approved_by == ("alice", "bob") and b.decided_at == 1003


def test_one_deny_refuses_and_decided_is_final():
    a = vote(approval(), "alice", "approve", Scope(), None, 1001)
    d = vote(a, "bob", "deny", Scope(), "no", 1002)
    assert d.state == "denied"
    with pytest.raises(VoteError) as e:
        vote(d, "alice", "approve", Scope(), None, 1003)
    assert e.value.status == 409


def test_only_named_approvers_and_not_after_expiry():
    with pytest.raises(VoteError) as e:
        vote(approval(), "mallory", "approve", Scope(), None, 1001)
    assert e.value.status == 403 and e.value.code == "not_an_approver"
    with pytest.raises(VoteError) as e:
        vote(approval(), "alice", "approve", Scope(), None, 1120)
    assert e.value.status == 409


def test_the_narrowest_scope_and_shortest_ttl_win():
    a = vote(approval(remember=("request", "sandbox", "identity")), "alice", "approve",
             Scope("identity", 600), None, 1001)
    b = vote(a, "bob", "approve", Scope("sandbox", 900), None, 1002)
    assert b.scope == Scope("sandbox", 600)
    g = grant_for(b)
    assert g is not None and g.sandbox == "sb-1" and g.expires == 1602
    c = vote(vote(approval(), "alice", "approve", Scope(), None, 1), "bob", "approve",
             Scope("sandbox", 60), None, 2)
    assert c.scope == Scope("request") and grant_for(c) is None


@pytest.mark.parametrize(("raw", "code"), [
    ({"kind": "identity"}, "scope_not_allowed"),  # the rule remembers request, sandbox
    ({"kind": "sandbox", "ttl": 7201}, "ttl_too_long"),
    ({"kind": "sandbox", "ttl": 0}, "bad_request"),
    ({"kind": "sandbox", "ttl": "1h"}, "bad_request"),
    ({"kind": "request", "ttl": 5}, "bad_request"),
    ({"kind": "sandbox", "extra": 1}, "bad_request"),
    ([1], "bad_request"),
])
def test_scope_errors(raw, code):
    with pytest.raises(VoteError) as e:
        parse_scope(raw, approval().policy, has_sandbox=True)
    assert e.value.code == code and e.value.status == 400


def test_scope_defaults_and_sandbox_needs_a_sandbox():
    assert parse_scope(None, approval().policy, True) == Scope("request")
    assert parse_scope({"kind": "sandbox"}, approval().policy, True) == Scope("sandbox", 3600)
    with pytest.raises(VoteError, match="no sandbox id"):
        parse_scope({"kind": "sandbox"}, approval().policy, has_sandbox=False)


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5),
                                                       st.none()), max_size=3))
def test_parse_scope_never_fails_otherwise(raw):
    try:
        s = parse_scope(raw, approval().policy, True)
    except VoteError as e:
        assert e.status == 400
    else:
        assert s.kind in ("request", "sandbox")


def test_approval_round_trips_through_json():
    a = vote(approval(), "alice", "approve", Scope("sandbox", 60), "ok", 1001)
    assert Approval.from_dict(json.loads(json.dumps(a.as_dict()))) == a


def test_fingerprint_separates_every_part():
    base = ("agent", "sb", "POST", "https://x/", "0" * 64, "a" * 64)
    fps = {fingerprint(*base)}
    for i, v in enumerate(("agent2", None, "PUT", "https://x/?a", "1" * 64, "b" * 64)):
        parts = list(base)
        parts[i] = v  # type: ignore[call-overload]
        fps.add(fingerprint(*parts))  # type: ignore[arg-type]
    assert len(fps) == 7


# --------------------------------------------------------------------------- service

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ask_rule(tmp_path: Path, approval_yaml: str) -> tuple[Policy, Rule]:
    p = load(tmp_path, rule(f"      - {{name: r, action: ask, hosts: [x.example.com], "
                            f"approval: {approval_yaml}}}"))
    return p, p.identities["agent"].rules[0]


def req(sandbox: str | None = "sb-1", body: bytes = b"{}", url: str = "https://x.example.com/a",
        headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)
        ) -> Request:
    fields = H.bound_fields(headers)
    return Request("agent", sandbox, "POST", url, url, "x.example.com", None,
                   hashlib.sha256(body).hexdigest(), len(body), H.digest(fields, False),
                   H.shown(fields, str), ())


async def pending_one(svc: Approvals) -> Approval:
    for _ in range(100):
        items = await svc.pending()
        if items:
            return items[0]
        await asyncio.sleep(0.01)
    raise AssertionError("nothing pending")


async def test_hold_until_approved_then_remembered_for_the_sandbox(tmp_path):
    events: list[tuple[str, dict[str, Any]]] = []
    svc = Approvals(MemoryStore(), audit=lambda e, **f: events.append((e, f)))
    p, r = ask_rule(tmp_path, "{remember: [request, sandbox]}")
    held = asyncio.ensure_future(svc.ask(p, r, req(), "why"))
    a = await pending_one(svc)
    assert not held.done()
    out = await svc.decide(a.id, "alice", "approve", {"kind": "sandbox", "ttl": 60}, "ok")
    assert out.state == "approved"
    assert "alice" in await held
    assert (await svc.get(a.id)).state == "used"  # type: ignore[union-attr]
    # the same sandbox passes without asking; another one is asked
    assert "remembered" in await svc.ask(p, r, req(body=b"other"), "why")
    other = asyncio.ensure_future(svc.ask(p, r, req(sandbox="sb-2"), "why"))
    b = await pending_one(svc)
    assert b.sandbox == "sb-2"
    await svc.decide(b.id, "bob", "deny", None, None)
    with pytest.raises(ApprovalRefused) as e:
        await other
    assert e.value.code == Code.APPROVAL_DENIED and e.value.approval == b.id
    actions = [f["action"] for ev, f in events if ev == "approval"]
    assert actions == ["requested", "decided", "used", "used", "requested", "decided"]
    await svc.aclose()


async def test_timeout(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{timeout: 1}")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    assert e.value.code == Code.APPROVAL_TIMEOUT
    await svc.aclose()


async def test_a_client_that_left_withdraws(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{timeout: 60}")
    with pytest.raises(ApprovalRefused, match="withdrawn") as e:
        await svc.ask(p, r, req(), "why", gone=lambda: True)
    assert e.value.approval is not None
    a = await svc.get(e.value.approval)
    assert a is not None and a.state == "withdrawn"
    with pytest.raises(VoteError) as v:
        await svc.decide(a.id, "alice", "approve", None, None)
    assert v.value.status == 409
    await svc.aclose()


async def test_async_mode_one_grant_one_use(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{mode: async, timeout: 1h}")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    assert e.value.code == Code.APPROVAL_PENDING and e.value.retry_after == 30
    aid = e.value.approval
    assert aid is not None
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    assert e.value.approval == aid  # the same approval while pending
    await svc.decide(aid, "alice", "approve", None, None)
    assert "approved" in await svc.ask(p, r, req(), "why")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    assert e.value.code == Code.APPROVAL_PENDING and e.value.approval != aid
    await svc.aclose()


async def test_async_denial_is_told_once(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{mode: async, timeout: 1h}")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    assert e.value.approval is not None
    await svc.decide(e.value.approval, "alice", "deny", None, None)
    with pytest.raises(ApprovalRefused) as d:
        await svc.ask(p, r, req(), "why")
    assert d.value.code == Code.APPROVAL_DENIED
    with pytest.raises(ApprovalRefused) as again:
        await svc.ask(p, r, req(), "why")
    assert again.value.code == Code.APPROVAL_PENDING  # asked anew
    await svc.aclose()


async def test_pending_limits(tmp_path):
    svc = Approvals(MemoryStore(), limits=AskLimits(max_pending_per_identity=2, max_pending=3))
    p, r = ask_rule(tmp_path, "{mode: async, timeout: 1h}")
    for i in range(2):
        with pytest.raises(ApprovalRefused):
            await svc.ask(p, r, req(body=str(i).encode()), "why")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(body=b"3"), "why")
    assert e.value.code == Code.TOO_MANY_PENDING and e.value.status == 429
    other = Request("agent2", None, "POST", "u", "u", "x", None, "0" * 64, 0, "a" * 64, (), ())
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, other, "why")
    assert e.value.code == Code.APPROVAL_PENDING
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, Request("agent3", None, "GET", "u", "u", "x", None, "0" * 64, 0,
                                    "a" * 64, (), ()), "why")
    assert e.value.code == Code.APPROVALS_FULL and e.value.status == 503
    await svc.aclose()


async def test_memory_store_expires_pending_and_grants():
    clock = Clock()
    store = MemoryStore(clock)
    await store.create(approval())
    assert [a.id for a in await store.pending()] == ["ap_1"]
    clock.t = 1121
    assert await store.pending() == []
    g = grant_for(vote(vote(approval(), "alice", "approve", Scope("sandbox", 10), None, 1000),
                       "bob", "approve", Scope("sandbox", 10), None, 1000))
    assert g is not None
    await store.add_grant(g)
    assert await store.grant("deletes", "agent", "sb-1", "a" * 64, 1005) == g
    assert await store.grant("deletes", "agent", "sb-2", "a" * 64, 1005) is None
    assert await store.grant("deletes", "agent", "sb-1", "b" * 64, 1005) is None  # headers
    assert await store.grant("deletes", "agent", "sb-1", "a" * 64, 1010) is None


# --------------------------------------------------------------------------- webhook

def test_webhook_signature_and_bodies():
    key = b"test-hook-key"
    body = b'{"x":1}'
    sig = sign(key, "1700000000", body)
    assert verify(key, "1700000000", body, sig, now=1700000010)
    assert not verify(key, "1700000000", body + b" ", sig, now=1700000010)
    assert not verify(key, "1700000000", body, sig, now=1700001000)  # too old
    assert not verify(b"other", "1700000000", body, sig, now=1700000010)
    hook = Webhook("ops", "https://h.example.com", "slack", None, Source("p.yaml", 1))
    a = approval()
    slack = body_for(hook, a)
    assert a.id in slack["text"] and slack["blocks"]
    raw = body_for(Webhook("j", "https://h.example.com", "json", None, Source("p", 1)), a)
    assert raw == {"event": "approval_requested", "approval": a.as_dict()}


def test_the_docs_verification_snippet_verifies_what_sandgate_signs():
    page = (Path(__file__).parents[2] / "docs" / "approvals.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    ns: dict[str, Any] = {}
    exec(compile(code, "docs/approvals.md", "exec"), ns)
    key, body, ts = b"test-hook-key", b'{"event":"approval_requested"}', str(int(time.time()))
    assert ns["verify"](key, ts, body, sign(key, ts, body))
    assert not ns["verify"](key, ts, body + b"x", sign(key, ts, body))
    assert not ns["verify"](key, str(int(time.time()) - 3600), body,
                            sign(key, str(int(time.time()) - 3600), body))


def test_an_upstream_cannot_forge_the_approval_header():
    from mitmproxy import http

    from sandgate.scrub.scrubber import SecretSet
    from sandgate.scrub.stream import clean_head

    resp = http.Response.make(200, b"", {"X-Sandgate-Approval": "ap_forged", "X-Other": "1"})
    clean_head(resp, SecretSet({}))
    assert "x-sandgate-approval" not in resp.headers and resp.headers["x-other"] == "1"


# --------------------------------------------------------------------------- admin roles

TOKENS = {"alice": "test-alice-1", "vic": "test-vic-2"}


def users_file(tmp_path: Path, text: str | None = None) -> Path:
    f = tmp_path / "users.yaml"
    f.write_text(text if text is not None else "users:\n" + "".join(
        f"  {n}: {{role: {'viewer' if n == 'vic' else 'approver'}, token_sha256: "
        f"{hashlib.sha256(t.encode()).hexdigest()}}}\n" for n, t in TOKENS.items()))
    return f


@pytest.mark.parametrize(("text", "expected"), [
    ("users: []", "write one key `users:`"),
    ("users:\n  admin: {role: admin, token_sha256: " + "a" * 64 + "}", "`admin` is the admin"),
    ("users:\n  al: {role: root, token_sha256: " + "a" * 64 + "}", "role must be viewer"),
    ("users:\n  al: {role: viewer, token_sha256: abc}", "token_sha256 must be 64 hex"),
    ("users:\n  al: {role: viewer, token: x}", "give exactly role and token_sha256"),
    ("users:\n  al: {role: viewer, token_sha256: " + "a" * 64 + "}\n"
     "  bo: {role: viewer, token_sha256: " + "a" * 64 + "}", "the same token as user 'al'"),
    ("users: [", "not valid YAML"),
])
def test_admin_users_file_errors(tmp_path, text, expected):
    with pytest.raises(ValueError, match=expected.replace("`", ".").replace("[", ".")):
        load_admin_users(users_file(tmp_path, text))


async def test_roles_viewer_reads_approver_decides(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{mode: async, timeout: 1h}")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, req(), "why")
    aid = e.value.approval
    app = web.Application(middlewares=[auth_middleware(
        "test-admin-token", frozenset(), load_admin_users(users_file(tmp_path)))])
    approvals_api.register(app, svc)
    async with TestClient(TestServer(app)) as client:
        def h(user: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {TOKENS[user]}"}
        r1 = await client.get("/v1/approvals", headers=h("vic"))
        assert r1.status == 200 and (await r1.json())["approvals"][0]["id"] == aid
        r2 = await client.post(f"/v1/approvals/{aid}", json={"decision": "approve"},
                               headers=h("vic"))
        assert r2.status == 403 and (await r2.json())["error"] == "forbidden"
        r3 = await client.post(f"/v1/approvals/{aid}", headers=h("alice"),
                               json={"decision": "approve", "approver": "bob"})
        assert r3.status == 400  # the approver is never named in the body
        r4 = await client.post(f"/v1/approvals/{aid}", json={"decision": "approve"},
                               headers=h("alice"))
        doc = await r4.json()
        assert r4.status == 200 and doc["approved_by"] == ["alice"], doc
        r5 = await client.get("/v1/approvals", headers={"Authorization": "Bearer nope"})
        assert r5.status == 401
        r6 = await client.post(f"/v1/approvals/{aid}", json={"decision": "deny"},
                               headers={"Authorization": "Bearer test-admin-token"})
        assert r6.status == 409  # admin may decide; this one is decided already
    await svc.aclose()
