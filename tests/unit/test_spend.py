"""Spend and models: `llm:` rules judged by decide(), `budgets:` windows reserved and settled,
prices, and refusals in each provider's error shape."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.decision import judge
from sandgate.errors import Code, LimitExceeded
from sandgate.llm.llmcall import LlmCall, Usage, stated_call
from sandgate.llm.spend import (
    Amounts,
    SpendWindows,
    amounts,
    cost_micros,
    price_of,
    shipped_prices,
    worst_case,
)
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import Budget, Price, Source
from sandgate.refusal import Refusal

POLICY = """
version: v1
secrets:
  anthropic: {mount: secret, path: llm/anthropic, field: key, hosts: [api.anthropic.com]}
budgets:
  day: {output_tokens: 1000, cost_usd: 2.5, per: 1d}
prices:
  - {model: "claude-sonnet-4*", input: 1, output: 2}
identities:
  agent:
    rules:
      - name: claude
        hosts: [api.anthropic.com]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
        llm: {models: ["claude-sonnet-*"], max_tokens: 4096, budget: day}
      - name: haiku-lowered
        hosts: [api.anthropic.com]
        llm: {models: ["claude-haiku-*"], max_tokens: 100, on_max_tokens: lower}
"""


def load(tmp_path: Path, text: str = POLICY):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    return load_policy_dir(tmp_path)


def verdict(policy, model: str | None, max_tokens: int | None = None):
    return judge(policy, "agent", "POST", "https://api.anthropic.com/v1/messages", {},
                 llm=stated_call(model, max_tokens) if model else
                 LlmCall("anthropic", None, max_tokens, False)).decision


def test_models_and_caps_judged_by_decide(tmp_path):
    policy = load(tmp_path)
    ok = verdict(policy, "claude-sonnet-4-5", 4096)
    assert ok.allowed and ok.rule_name == "claude" and ok.lower_max_tokens is None
    d = verdict(policy, "claude-opus-4-1", 10)
    assert (d.allowed, d.code) == (False, Code.MODEL_NOT_ALLOWED)
    assert "claude-opus-4-1" in d.reason and "claude-sonnet-*" in (d.hint or "")
    d = verdict(policy, "claude-sonnet-4-5", 4097)
    assert (d.allowed, d.code) == (False, Code.MAX_TOKENS_OVER_CAP)
    assert "4096" in d.reason
    d = verdict(policy, "claude-sonnet-4-5", None)  # no cap asked: the model's own, refused
    assert d.code == Code.MAX_TOKENS_OVER_CAP
    d = verdict(policy, None, 10)
    assert d.code == Code.MODEL_NOT_ALLOWED and "names no model" in d.reason
    # a later rule may allow what the first does not: lowered to its cap
    d = verdict(policy, "claude-haiku-4-5", 5000)
    assert d.allowed and d.rule_name == "haiku-lowered" and d.lower_max_tokens == 100
    assert verdict(policy, "claude-haiku-4-5", 50).lower_max_tokens is None
    # the head stage decides without the call: the rule matches, the body is judged later
    head = judge(policy, "agent", "POST", "https://api.anthropic.com/v1/messages", {})
    assert head.decision.allowed and head.decision.rule_name == "claude"


def test_fixtures_and_check_know_models(tmp_path):
    from sandgate.policy.fixtures import run_policy_test

    text = POLICY + textwrap.dedent("""
    tests:
      - {identity: agent, request: POST https://api.anthropic.com/v1/messages,
         model: claude-opus-4, expect: deny, code: model_not_allowed}
      - {identity: agent, request: POST https://api.anthropic.com/v1/messages,
         model: claude-sonnet-4, max_tokens: 5000, expect: deny, code: max_tokens_over_cap}
      - {identity: agent, request: POST https://api.anthropic.com/v1/messages,
         model: claude-haiku-4-5, max_tokens: 5000, expect: allow, rule: haiku-lowered}
    """)
    policy = load(tmp_path, text)
    results = [run_policy_test(policy, t) for t in policy.tests]
    assert [r.passed for r in results] == [True, True, True], [r.message for r in results]


@pytest.mark.parametrize("extra,message", [
    ("      - {name: x, hosts: [a.example], llm: {budget: nope}}\n", "budget 'nope'"),
    ("      - {name: x, hosts: [a.example], llm: {on_max_tokens: lower}}\n",
     "needs `max_tokens`"),
    ("      - {name: x, hosts: [a.example], action: deny, llm: {models: [a]}}\n",
     "not on a deny"),
    ("      - {name: x, hosts: [a.example], llm: {max_tokens: 0}}\n", "allows no output"),
])
def test_rule_mistakes_are_load_errors(tmp_path, extra, message):
    with pytest.raises(PolicyError, match=message):
        load(tmp_path, POLICY + extra)


@pytest.mark.parametrize(("model", "rates"), [
    # (input, output, cached input) as the providers' pages list them (data/prices.yaml says
    # which page and when); Opus 4.5 and later cost a third of Opus 4 / 4.1 (on main the
    # `claude-opus-4*` glob priced them all at $15 / $75)
    ("claude-opus-4-5-20251101", (5, 25, 0.5)),
    ("claude-opus-4-1-20250805", (15, 75, 1.5)),
    ("claude-opus-4-20250514", (15, 75, 1.5)),
    ("claude-opus-4-0", (15, 75, 1.5)),
    ("claude-sonnet-4-5", (3, 15, 0.3)),
    ("claude-sonnet-5", (2, 10, 0.2)),
    ("claude-haiku-4-5", (1, 5, 0.1)),
    ("claude-3-haiku-20240307", (0.25, 1.25, 0.03)),
    ("gemini-2.5-flash-lite", (0.1, 0.4, None)),
    ("gpt-4.1-mini", (0.4, 1.6, 0.1)),
])
def test_shipped_prices_as_published(model, rates):
    p = price_of((), model)
    assert p is not None and (p.input, p.output, p.cached_input) == rates


def test_budget_mistakes_are_load_errors(tmp_path):
    with pytest.raises(PolicyError, match="limits nothing"):
        load(tmp_path, POLICY.replace("{output_tokens: 1000, cost_usd: 2.5, per: 1d}",
                                      "{per: 1d}"))
    with pytest.raises(PolicyError, match="per"):
        load(tmp_path, POLICY.replace("per: 1d", "per: soon"))


def test_prices_policy_first_then_shipped(tmp_path):
    policy = load(tmp_path)
    assert policy.prices[0].model == "claude-sonnet-4*"
    assert price_of(policy.prices, "claude-sonnet-4-5") == policy.prices[0]
    shipped = price_of((), "claude-sonnet-4-5")
    assert shipped is not None and shipped in shipped_prices()
    assert price_of((), "gpt-4o-mini-2024") != price_of((), "gpt-4o-2024")  # specific first
    assert price_of(policy.prices, "no-such-model") is None
    p = Price("m", input=3, output=15, cached_input=0.3)
    # 1M input (400k cached), 1M output: 0.6M*3 + 0.4M*0.3 + 1M*15 µ$ per token
    assert cost_micros(p, Usage(1_000_000, 1_000_000, 400_000)) == 1_800_000 + 120_000 \
        + 15_000_000
    assert cost_micros(None, Usage(5, 5)) == 0


def budget(**kw) -> Budget:
    return Budget(name="b", per=60, scope="identity", source=Source("f", 1), **kw)


def test_window_admits_while_anything_is_left_and_settles():
    w = SpendWindows()
    b = budget(output_tokens=100)
    key = "k"
    r1 = w.reserve(key, b, "agent", Amounts(0, 60), now=0)
    r2 = w.reserve(key, b, "agent", Amounts(0, 30), now=1)
    r3 = w.reserve(key, b, "agent", Amounts(0, 30), now=2)  # 90 used: something left
    with pytest.raises(LimitExceeded) as e:
        w.reserve(key, b, "agent", Amounts(0, 1), now=3)
    assert e.value.code == Code.SPEND_EXHAUSTED and e.value.retry_after == 57
    w.settle(r1, Amounts(0, 10))  # spent less than reserved: given back
    w.settle(r2, Amounts(0, 10))
    assert w.used(key) == Amounts(0, 50)
    w.reserve(key, b, "agent", Amounts(0, 1), now=4)
    w.settle(r3, Amounts(0, 0))
    w.reserve(key, b, "agent", Amounts(0, 500), now=60)  # a new window
    w.settle(r3, Amounts(0, 0))  # of the old window: changes nothing
    assert w.used(key) == Amounts(0, 500)


@given(calls=st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), max_size=40),
       limit=st.integers(1, 300))
def test_window_overrun_is_at_most_one_calls_worst_case(calls, limit):
    """Whatever the order of reserving and settling, what a window counts passes its limit by
    less than the worst case of the call admitted last."""
    w = SpendWindows()
    b = budget(output_tokens=limit)
    open_: list = []
    biggest = 0
    for i, (worst, spent) in enumerate(calls):
        try:
            open_.append((w.reserve("k", b, "a", Amounts(0, worst), now=0),
                          min(spent, worst)))
            biggest = max(biggest, worst)
        except LimitExceeded:
            pass
        if i % 3 == 2 and open_:
            res, spent_ = open_.pop(0)
            w.settle(res, Amounts(0, spent_))
        used = w.used("k")
        assert used is None or used.output_tokens < limit + biggest


def test_worst_case_and_amounts():
    c = LlmCall("anthropic", "claude-sonnet-4", 200, False, input_bytes=1234)
    assert worst_case(c, 200) == Usage(1234, 200)
    assert amounts(Usage(10, 20), Price("m", 1, 2)) == Amounts(10, 20, 50)


@pytest.mark.parametrize("dialect", ["anthropic", "openai-chat", "openai-responses", "gemini"])
@pytest.mark.parametrize("code,status", [(Code.MODEL_NOT_ALLOWED, 403),
                                         (Code.SPEND_EXHAUSTED, 429),
                                         (Code.MAX_TOKENS_OVER_CAP, 400)])
def test_refusals_in_the_providers_shape(dialect, code, status):
    r = Refusal(code, "why", identity="agent", hint="fix", retry_after=5, dialect=dialect)
    doc = json.loads(r.body())
    assert r.status == status and r.headers()["X-Sandgate-Reason"] == str(code)
    assert doc["sandgate"]["code"] == str(code)
    if dialect == "anthropic":
        assert doc["type"] == "error" and doc["error"]["type"] in (
            "permission_error", "rate_limit_error", "invalid_request_error")
    elif dialect == "gemini":
        assert doc["error"]["code"] == status and doc["error"]["status"] in (
            "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT")
    else:
        assert doc["error"]["code"] == str(code)
    assert f"sandgate: {code}: why (fix)" == doc["error"]["message"]
    plain = json.loads(Refusal(code, "why").body())
    assert plain["error"] == "sandgate_refused"



def test_metrics_count_tokens_and_cost_by_identity_sandbox_and_model(tmp_path):
    from sandgate.audit import events as A
    from sandgate.metrics import Metrics

    policy = load(tmp_path)
    m = Metrics(lambda: policy)
    usage = {"input_tokens": 12, "output_tokens": 10, "cached_tokens": 4,
             "reasoning_tokens": 0}
    for model in ("claude-sonnet-4-5", "claude-sonnet-4-5", "made-up-model-xyz"):
        m.on_audit("request", {A.IDENTITY: "agent", A.SANDBOX: "sb-1", A.RULE: "claude",
                               A.DECISION: "allow", A.LLM: {
                                   "model": model, "usage": usage, "cost_usd": 0.5}})
    m.on_audit("request", {A.IDENTITY: "agent", A.RULE: "claude", A.DECISION: "deny",
                           A.CODE: "model_not_allowed", A.LLM: {"model": "x"}})
    text = m.render().decode()
    line = ('sandgate_llm_tokens_total{identity="agent",kind="output",model="claude-sonnet-*",'
            'sandbox="sb-1"} 20.0')
    assert line in text
    assert ('sandgate_llm_tokens_total{identity="agent",kind="cached",model="unknown",'
            'sandbox="sb-1"} 4.0') in text  # a model no glob names: not its own label
    assert ('sandgate_llm_cost_usd_total{identity="agent",model="claude-sonnet-*",'
            'sandbox="sb-1"} 1.0') in text
    assert "made-up-model" not in text and 'kind="reasoning"' not in text


@pytest.mark.parametrize("mode", ["refuse", "replace"])
def test_own_credentials_refused_or_removed(tmp_path, mode):
    from mitmproxy.test import tflow

    from sandgate.errors import Refused
    from sandgate.request import parse_url
    from sandgate.stages.flow import FlowRecord
    from sandgate.stages.s37_llm import own_credentials

    policy = load(tmp_path, POLICY.replace("budget: day}", f"budget: day, own_credentials: "
                                                           f"{mode}}}"))
    rule = policy.identities["agent"].rules[0]
    url = "https://api.anthropic.com/v1/messages?key=own-3&keep=1"

    def flow(**headers: str):
        f = tflow.tflow()
        f.request.url = url
        for k, v in headers.items():
            f.request.headers[k.replace("_", "-")] = v
        rec = FlowRecord(info=parse_url("POST", url), placeholders=dict(policy.placeholders))
        return f, rec

    placeholder = next(iter(policy.placeholders))
    # the placeholder (anywhere), and the header the rule injects, are not the sandbox's own
    f, rec = flow(authorization=f"Bearer {placeholder}", x_api_key="own-but-overwritten")
    f.request.url = url.partition("?")[0]
    rec.info = parse_url("POST", f.request.url)
    own_credentials(f, rec, rule)
    assert not rec.injected
    f, rec = flow(authorization="Bearer sk-own-1", x_goog_api_key="own-2")
    if mode == "refuse":
        with pytest.raises(Refused) as e:
            own_credentials(f, rec, rule)
        assert e.value.code == Code.OWN_CREDENTIAL
        assert "header authorization, header x-goog-api-key, query key" in e.value.reason
        assert "sk-own" not in e.value.reason and "refused" in rec.injected[0]
    else:
        own_credentials(f, rec, rule)
        assert "authorization" not in f.request.headers
        assert "x-goog-api-key" not in f.request.headers
        assert list(f.request.query.items(multi=True)) == [("keep", "1")]
        assert "removed" in rec.injected[0]


def test_lint_knows_an_llm_rule_does_not_cover_the_calls_it_refuses(tmp_path):
    """The rule after one whose models or cap refuse some calls is not shadowed by it (the
    decision goes on to it); one whose llm: lets through all it does is."""
    from sandgate.policy.model import LlmRule
    from sandgate.policy.overlap import llm_covers
    from sandgate.review.lint import lint_policy

    def shadowed(text: str) -> bool:
        findings = lint_policy(load(tmp_path, text))
        return any("never applies" in f.message for f in findings)

    assert not shadowed(POLICY)  # haiku-lowered after claude (other models): it decides
    assert shadowed(POLICY.replace('llm: {models: ["claude-haiku-*"]',
                                   'llm: {models: ["claude-sonnet-4*"]').replace(
        "max_tokens: 100, on_max_tokens: lower}", "max_tokens: 100}"))
    a = LlmRule(models=("claude-*",), max_tokens=100)
    assert llm_covers(a, LlmRule(models=("claude-sonnet-*", "claude-x"), max_tokens=50))
    assert not llm_covers(a, LlmRule(models=("claude-*",), max_tokens=200))
    assert not llm_covers(a, LlmRule(models=("claude-*",), max_tokens=50,
                                     on_max_tokens="lower"))
    assert not llm_covers(a, LlmRule(models=("gpt-*",), max_tokens=50))
    assert not llm_covers(a, None) and llm_covers(None, a)
    assert llm_covers(LlmRule(budget="b"), None)
    assert not llm_covers(LlmRule(models=("c-?",)), LlmRule(models=("c-*",)))


def test_report_spend_totals_from_audit_files(tmp_path):
    import gzip

    from tests.support.cli import run_cli

    def ev(identity, model, decision="allow", out=10, cost=0.25, code=None, sandbox="s1"):
        llm = {"api": "anthropic", "model": model, "budget": "day"}
        if decision == "allow":
            llm.update(usage={"input_tokens": 12, "output_tokens": out, "cached_tokens": 4,
                              "reasoning_tokens": 0}, cost_usd=cost)
        return json.dumps({"event": "request", "identity": identity, "sandbox": sandbox,
                           "decision": decision, "code": code, "llm": llm})

    (tmp_path / "a.jsonl").write_text("\n".join([
        ev("agent", "claude-sonnet-4-5"), ev("agent", "claude-sonnet-4-5", out=5),
        ev("agent", "claude-opus-4", "deny", code="model_not_allowed"),
        json.dumps({"event": "request", "identity": "agent", "decision": "allow"}),  # no llm
        json.dumps({"event": "checkpoint"}), "not json"]) + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(ev("other", "gpt-4o-mini", sandbox="s2") + "\n")
    r = run_cli("report", "--spend", str(tmp_path / "a.jsonl"), "--spend",
                str(tmp_path / "b.jsonl.gz"), "--by", "identity,model", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows == [
        {"identity": "agent", "model": "claude-opus-4", "calls": 0, "refused": 1,
         "input_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "reasoning_tokens": 0,
         "cost_usd": 0.0, "refusals": {"model_not_allowed": 1}},
        {"identity": "agent", "model": "claude-sonnet-4-5", "calls": 2, "refused": 0,
         "input_tokens": 24, "output_tokens": 15, "cached_tokens": 8, "reasoning_tokens": 0,
         "cost_usd": 0.5, "refusals": {}},
        {"identity": "other", "model": "gpt-4o-mini", "calls": 1, "refused": 0,
         "input_tokens": 12, "output_tokens": 10, "cached_tokens": 4, "reasoning_tokens": 0,
         "cost_usd": 0.25, "refusals": {}}]
    r = run_cli("report", "--spend", str(tmp_path / "a.jsonl"), "--by", "sandbox")
    assert r.returncode == 0 and "| s1 | 2 | 1 | 24 | 15 | 8 | 0 | 0.500000 |" in r.stdout
    r = run_cli("report", "--spend", str(tmp_path / "a.jsonl"), "--by", "path")
    assert r.returncode == 2 and "--by takes" in r.stderr


def test_explain_reads_the_llm_call_from_the_body_as_the_proxy_does(tmp_path):
    from tests.support.cli import run_cli

    load(tmp_path)
    url = "https://api.anthropic.com/v1/messages"

    def explain(body: str, *extra: str):
        (tmp_path / "body.json").write_text(body)
        r = run_cli("explain", "--policies", str(tmp_path), "--identity", "agent",
                    "--body-file", str(tmp_path / "body.json"), *extra, "POST", url)
        return r.returncode, json.loads(r.stdout) if r.stdout.strip() else r.stderr

    code, out = explain('{"model": "claude-opus-4-1", "max_tokens": 10}')
    assert code == 1 and out["code"] == "model_not_allowed"
    code, out = explain('{"model": "claude-haiku-4-5", "max_tokens": 5000}')
    assert code == 0 and out["rule"] == "haiku-lowered"
    code, out = explain('{"model": "a", "model": "claude-sonnet-4-5", "max_tokens": 10}')
    assert code == 1 and out["code"] == "bad_request" and "given twice" in out["reason"]
    code, out = explain("{}", "--model", "claude-sonnet-4-5", "--max-tokens", "10")
    assert code == 0 and out["llm"] == {"model": "claude-sonnet-4-5", "max_tokens": 10,
                                        "budget": "day"}


def test_diff_and_narrower_than_know_llm(tmp_path):
    from sandgate.review.proofs import prove_narrower
    from sandgate.review.reach_diff import reach_diff

    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = load(tmp_path / "old")
    wider = POLICY.replace('models: ["claude-sonnet-*"], max_tokens: 4096, budget: day',
                           'models: ["claude-*"], max_tokens: 4096, budget: day')
    d = reach_diff(old, load(tmp_path / "new", wider))
    assert d.widened and "llm {models claude-sonnet-*" in str(d.as_dict())
    assert "-> {models claude-*" in str(d.as_dict())
    unbudgeted = POLICY.replace("max_tokens: 4096, budget: day}", "max_tokens: 4096}")
    assert reach_diff(old, load(tmp_path / "new", unbudgeted)).widened
    narrower = POLICY.replace('models: ["claude-sonnet-*"]', 'models: ["claude-sonnet-4-5"]')
    d = reach_diff(old, load(tmp_path / "new", narrower))
    assert not d.widened and d.narrowed
    # narrower_than: an identity without the other's llm: limits is refuted (exactly:
    # tests/unit/test_llmproofs.py)
    two = POLICY + textwrap.dedent("""
      free:
        narrower_than: agent
        rules:
          - name: claude
            hosts: [api.anthropic.com]
            inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
    """).replace("\n", "\n  ")
    p = load(tmp_path / "new", two.replace("\n  \n", "\n"))
    result = prove_narrower(p, "free", "agent")
    assert not result.ok and result.counterexample and "not proved" not in result.details[0]


async def test_a_reservation_waits_for_this_processs_settlements():
    """The settlement runs in a task (the response hook cannot wait); the next reservation of
    the same budget waits for it, so a client's next call finds its last one settled."""
    import asyncio

    from sandgate.llm import spend
    from sandgate.llm.llmcall import UsageReader
    from sandgate.llm.spend import LlmFlow, budget_key, settle, settled

    class SlowCounts:
        def __init__(self) -> None:
            self.windows = SpendWindows()

        async def settle(self, res, actual) -> None:
            await asyncio.sleep(0.05)  # a state call taking its time
            self.windows.settle(res, actual)

    counts = SlowCounts()
    b = budget(output_tokens=20)
    key = budget_key(b, "a")
    flow = LlmFlow("anthropic", reader=UsageReader("anthropic", "application/json", "/v1/m"))
    flow.reader.feed(b'{"usage": {"input_tokens": 1, "output_tokens": 2}}')  # type: ignore
    flow.reader.end()  # type: ignore[union-attr]
    flow.reservation = counts.windows.reserve(key, b, "a", Amounts(0, 20), now=0)
    settle(counts, flow, False)  # type: ignore[arg-type]
    assert spend._pending
    await settled(key)
    assert counts.windows.used(key) == Amounts(1, 2) and not spend._pending
    counts.windows.reserve(key, b, "a", Amounts(0, 20), now=1)  # room again



async def test_an_in_process_count_is_settled_in_place():
    """Counted in this process, a call's settlement is made when settle() is called, with no
    task started per call and nothing left for the next reservation to wait for (a task per
    call was part of what `llm:` + a budget cost: bench/spend.py, docs/performance.md)."""
    from sandgate.limits import Limiter
    from sandgate.llm import spend
    from sandgate.llm.llmcall import UsageReader
    from sandgate.llm.spend import LlmFlow, budget_key, settle, settled
    from sandgate.state.local import LocalCounts

    counts = LocalCounts(Limiter)
    b = budget(output_tokens=20)
    key = budget_key(b, "a")
    flow = LlmFlow("anthropic", reader=UsageReader("anthropic", "application/json", "/v1/m"))
    flow.reader.feed(b'{"usage": {"input_tokens": 1, "output_tokens": 2}}')  # type: ignore
    flow.reader.end()  # type: ignore[union-attr]
    flow.reservation = await counts.reserve(b, "a", Amounts(0, 20))
    assert counts.spend_windows.used(key) == Amounts(0, 20)  # the worst case, in flight
    settle(counts, flow, False)
    assert counts.spend_windows.used(key) == Amounts(1, 2)  # settled before settle() returns
    assert not spend._pending  # no task: nothing for the next reservation to wait for
    await settled(key)
    settle(counts, flow, False)  # once only
    assert counts.spend_windows.used(key) == Amounts(1, 2)
