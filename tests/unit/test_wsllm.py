"""One rule, every transport, for LLM calls: the Responses API's WebSocket transport on a rule
with `llm:` (decide()'s upgrade_refused, the loader, fixtures, explain) and the calls sent on
it (sandgate.stages.wsllm). End to end with the real Codex CLI:
tests/integration/test_agent_split_clis.py::test_codex_websocket_transport."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.decision import decide
from sandgate.errors import Code
from sandgate.llm.llmcall import CallUnreadable, read_call, read_ws_message
from sandgate.mitm.guards import wscontrol
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo
from sandgate.stages.wsllm import WsLlm, error_event, judge_client
from tests.support.wsgate import Gate, audited, hook, make_gate, ws_flow
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(100), deadline=None, database=None)

POLICY = """
version: v1
secrets:
  openai: {vault: secret/data/openai, field: api_key}
  other: {vault: secret/data/other, field: api_key}
identities:
  agent:
    rules:
      - {name: ws, hosts: [api.openai.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {models: ["gpt-5*"], max_tokens: 1000},
         inject: {headers: {authorization: "Bearer {{ secrets.openai }}"}}}
      - {name: lowered, hosts: [llm.example.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {api: openai, max_tokens: 100, on_max_tokens: lower},
         inject: {headers: {authorization: "Bearer {{ secrets.openai }}"}}}
      - {name: post-only-llm, hosts: [api.openai.com], methods: [GET, POST],
         paths: [/v1/chat/completions], llm: {models: ["gpt-5*"]},
         inject: {headers: {authorization: "Bearer {{ secrets.openai }}"}}}
      - {name: plain, hosts: [plain.example.com], methods: [GET]}
  two-keys:
    rules:
      - {name: ws, hosts: [api.openai.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {models: ["gpt-5*"]},
         inject: {headers: {authorization: "Bearer {{ secrets.openai }}"}}}
      - {name: other, hosts: [api.openai.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {models: ["o4*"]},
         inject: {headers: {authorization: "Bearer {{ secrets.other }}"}}}
  asker:
    rules:
      - {name: ws, hosts: [api.openai.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {models: ["gpt-5*"]}}
      - {name: hold, action: ask, hosts: [api.openai.com], methods: [GET],
         paths: [/v1/responses]}
  watcher:
    mode: report
    rules:
      - {name: ws, hosts: [api.openai.com], methods: [GET], paths: [/v1/responses],
         websocket: true, llm: {models: ["gpt-5*"]}}
"""


def _info(host: str, path: str = "/v1/responses", upgrade: str | None = "websocket",
          method: str = "GET") -> RequestInfo:
    return RequestInfo("https", host, 443, method, path, upgrade=upgrade)


WS = _info("api.openai.com")


def _policy(text: str = POLICY) -> Policy:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "p.yaml").write_text(text)
        return load_policy_dir(Path(d))


@pytest.fixture(scope="module")
def policy() -> Policy:
    return _policy()


def _ws(policy: Policy, identity: str = "agent", info: RequestInfo = WS,
        limit: int = 100_000) -> WsLlm:
    head = decide(policy, identity, info)
    assert head.allowed or identity == "watcher", head.reason
    return WsLlm(head, identity == "watcher", policy, identity, info, limit)


def _create(model: str | None = "gpt-5-codex", **extra: Any) -> bytes:
    body: dict[str, Any] = {"type": "response.create", **extra}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


# ---------------------------------------------------------------- the upgrade: decide()


def test_an_upgrade_on_an_llm_rule_needs_websocket_true(policy: Policy) -> None:
    """Without `websocket: true`, a rule with `llm:` refuses the upgrade: its calls would go
    on a WebSocket whose messages no rule judged (model allow-list and cap bypassed)."""
    d = decide(policy, "agent", _info("api.openai.com", "/v1/chat/completions"))
    assert not d.allowed and d.code == Code.UPGRADE_REFUSED and d.rule is not None
    assert d.rule.name == "post-only-llm" and "websocket: true" in (d.hint or "")
    # the same GET without an upgrade, and the WebSocket on the rule that opts in: allowed
    assert decide(policy, "agent", _info("api.openai.com", "/v1/chat/completions",
                                         upgrade=None)).allowed
    assert decide(policy, "agent", WS).allowed
    # any other protocol is refused even there; a rule with no llm: relays as before
    assert decide(policy, "agent", dataclasses.replace(WS, upgrade="h2c")).code == \
        Code.UPGRADE_REFUSED
    assert decide(policy, "agent", _info("plain.example.com", "/x")).allowed


@pytest.mark.parametrize(("rule", "fragment"), [
    ("{name: r, hosts: [a.example.com], methods: [POST], websocket: true, llm: {}}",
     "a WebSocket is opened by a GET"),
    ("{name: r, hosts: [a.example.com], action: ask, websocket: true, llm: {}}",
     "cannot take `websocket: true`"),
    ("{name: r, hosts: [a.example.com], websocket: true, llm: {budget: day}}",
     "not counted against budgets"),
])
def test_the_websocket_key_on_an_llm_rule_is_checked(tmp_path: Path, rule: str,
                                                      fragment: str) -> None:
    (tmp_path / "p.yaml").write_text(
        "version: v1\nbudgets:\n  day: {output_tokens: 10, per: 1d}\n"
        f"identities:\n  a:\n    rules:\n      - {rule}\n")
    with pytest.raises(PolicyError) as e:
        load_policy_dir(tmp_path)
    assert fragment in str(e.value)


def test_fixtures_and_explain_judge_a_call_on_the_websocket(tmp_path: Path) -> None:
    from sandgate.decision import judge
    from sandgate.llm.llmcall import stated_call
    from sandgate.policy.fixtures import run_policy_tests

    (tmp_path / "p.yaml").write_text(POLICY + """
tests:
  - {identity: agent, request: GET https://api.openai.com/v1/responses, websocket: true,
     model: gpt-5-codex, max_tokens: 500, expect: allow, rule: ws}
  - {identity: agent, request: GET https://api.openai.com/v1/responses, websocket: true,
     model: o4-mini, expect: deny, code: model_not_allowed}
  - {identity: agent, request: GET https://api.openai.com/v1/chat/completions,
     websocket: true, expect: deny, code: upgrade_refused}
""")
    policy = load_policy_dir(tmp_path)
    results = run_policy_tests(policy)
    assert [r.passed for r in results] == [True] * 3, [r.message for r in results]
    v = judge(policy, "agent", "GET", "https://api.openai.com/v1/responses", {},
              upgrade="websocket", llm=stated_call("o4-mini"))
    assert v.decision.code == Code.MODEL_NOT_ALLOWED
    from sandgate.explain.answer import explain_request

    out, allowed = explain_request(policy, "agent", "GET",
                                   "https://api.openai.com/v1/responses", websocket=True)
    assert allowed and "each response.create" in out["llm"]["websocket"]
    out, allowed = explain_request(policy, "agent", "GET",
                                   "https://api.openai.com/v1/chat/completions", websocket=True)
    assert not allowed and out["code"] == "upgrade_refused"


# ---------------------------------------------------------------- the calls: judge_client


def test_an_allowed_call_goes_on_and_a_refused_one_does_not(policy: Policy) -> None:
    ws = _ws(policy)
    ok = judge_client(ws, _create(max_output_tokens=500), True, False)
    assert ok.forward and ok.content is None and ok.call is not None
    assert ok.call.model == "gpt-5-codex" and ok.decision is not None
    assert ok.decision.rule is not None and ok.decision.rule.name == "ws"
    bad = judge_client(ws, _create("o4-mini"), True, False)
    assert not bad.forward and bad.refused is not None
    assert bad.refused.code == Code.MODEL_NOT_ALLOWED
    over = judge_client(ws, _create(max_output_tokens=5000), True, False)
    assert not over.forward and over.refused is not None
    assert over.refused.code == Code.MAX_TOKENS_OVER_CAP


def test_on_max_tokens_lower_rewrites_the_message(policy: Policy) -> None:
    ws = _ws(policy, info=_info("llm.example.com"))
    v = judge_client(ws, _create("anything", max_output_tokens=5000, input="hi"), True, False)
    assert v.forward and v.content is not None and v.call is not None
    doc = json.loads(v.content)
    assert doc["max_output_tokens"] == 100 and doc["type"] == "response.create"
    assert doc["input"] == "hi" and v.call.max_tokens == 100


@pytest.mark.parametrize(("content", "text", "fragmented", "code"), [
    (_create(), False, False, Code.BAD_REQUEST),  # binary
    (_create(), True, True, Code.BAD_REQUEST),  # in several frames
    (b"not json", True, False, Code.BAD_REQUEST),
    (b"[1, 2]", True, False, Code.BAD_REQUEST),
    (b'{"model": "gpt-5"}', True, False, Code.BAD_REQUEST),  # no type
    (b'{"type": "response.create", "model": "gpt-5", "model": "o4"}', True, False,
     Code.BAD_REQUEST),  # a key twice: the upstream may read the other one
    (b'{"type": "session.update", "model": "o4"}', True, False, Code.BAD_REQUEST),
    (_create(input="x" * 200), True, False, Code.TOO_LARGE),
])
def test_what_cannot_be_judged_closes(policy: Policy, content: bytes, text: bool,
                                      fragmented: bool, code: Code) -> None:
    v = judge_client(_ws(policy, limit=150), content, text, fragmented)
    assert not v.forward and v.close is not None and v.close.code == code


def test_report_mode_refuses_a_model_as_a_post_is_refused(policy: Policy) -> None:
    """A model outside the list is not a `report`able refusal (sandgate.decision.REPORTABLE):
    refused in report mode too, as the POST is (stages/s37_llm)."""
    v = judge_client(_ws(policy, "watcher"), _create("o4-mini"), True, False)
    assert not v.forward and not v.reported and v.refused is not None
    assert judge_client(_ws(policy, "watcher"), _create("gpt-5"), True, False).forward


def test_a_call_an_ask_rule_holds_is_refused(policy: Policy) -> None:
    """A call on a WebSocket cannot be held for approval: refused, never sent unheld."""
    ws = WsLlm(decide(policy, "asker", WS), False, policy, "asker", WS, 100_000)
    v = judge_client(ws, _create("gpt-5"), True, False)
    assert not v.forward and v.refused is not None
    assert v.refused.code == Code.DENIED_BY_RULE and "held" in v.refused.reason


def test_a_call_another_rule_allows_is_not_sent_with_the_upgrades_credentials(
        policy: Policy) -> None:
    ws = _ws(policy, "two-keys")
    assert judge_client(ws, _create("gpt-5"), True, False).forward
    v = judge_client(ws, _create("o4-mini"), True, False)
    assert not v.forward and v.refused is not None and v.refused.code == Code.NO_RULE
    assert "other credentials" in v.refused.reason


_MODELS = st.sampled_from(["gpt-5", "gpt-5-codex", "o4-mini", "GPT-5", "", "gpt-5\n"])
_TYPES = st.sampled_from(["response.create", "response.cancel", "error", ""])
_CAPS = st.one_of(st.none(), st.integers(-5, 5000), st.booleans(), st.text(max_size=3))


@SETTINGS
@given(kind=_TYPES, model=st.one_of(st.none(), _MODELS, st.integers()), cap=_CAPS,
       stream=st.one_of(st.none(), st.booleans(), st.text(max_size=2)))
def test_a_call_goes_on_exactly_when_decide_allows_its_body(
        policy: Policy, kind: str, model: Any, cap: Any, stream: Any) -> None:
    """The one decision: a message goes on exactly when it is a `response.create` whose body
    the POST path's reader reads (read_call) and decide() allows on the upgrade's request;
    anything else closes the WebSocket or is answered with the refusal."""
    body: dict[str, Any] = {"type": kind}
    for k, v in (("model", model), ("max_output_tokens", cap), ("stream", stream)):
        if v is not None:
            body[k] = v
    content = json.dumps(body).encode()
    v = judge_client(_ws(policy), content, True, False)
    try:
        call = read_call("openai-responses", "/v1/responses", content)
    except CallUnreadable:
        call = None
    as_post = decide(policy, "agent", WS, None, None, call) if call is not None else None
    if kind != "response.create" or call is None:
        assert not v.forward and v.close is not None
        return
    assert as_post is not None
    assert v.forward == as_post.allowed
    if not v.forward:
        assert v.refused is not None and v.refused.code == as_post.code


def test_read_ws_message() -> None:
    assert read_ws_message(b'{"type": "response.processed", "response_id": "r"}') == (
        "response.processed", None)
    kind, call = read_ws_message(_create("gpt-5", max_output_tokens=7, stream=True))
    assert kind == "response.create" and call is not None
    assert (call.api, call.model, call.max_tokens, call.stream) == (
        "openai-responses", "gpt-5", 7, True)
    for bad in (b"{}", b'{"type": 1}', b"null", b'{"type": "a", "type": "b"}'):
        with pytest.raises(CallUnreadable):
            read_ws_message(bad)


def test_the_error_event_is_the_apis_websocket_error() -> None:
    doc = json.loads(error_event(403, {"error": {"code": "model_not_allowed"}}))
    assert doc == {"type": "error", "status": 403, "error": {"code": "model_not_allowed"}}


# ---------------------------------------------------------------- the hook (s70_scrub)


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gate:
    from sandgate.stages import wsllm

    return make_gate(tmp_path, monkeypatch, _policy(), wsllm)


def _flow(gate: Gate) -> Any:
    return ws_flow(gate, WS)


def test_the_hook_forwards_refuses_answers_and_audits(gate: Gate) -> None:
    flow = _flow(gate)
    ok = hook(gate, flow, _create(max_output_tokens=10))
    assert not ok.dropped and gate.injected == []
    bad = hook(gate, flow, _create("o4-mini"))
    assert bad.dropped
    (answer,) = gate.injected
    doc = json.loads(answer)
    assert doc["type"] == "error" and doc["status"] == 403
    assert doc["error"]["code"] == "model_not_allowed"
    assert doc["sandgate"]["code"] == "model_not_allowed"
    events = audited(gate)
    assert [(e["decision"], e["rule"], e["llm"]["model"]) for e in events] == [
        ("allow", "ws", "gpt-5-codex"), ("deny", "ws", "o4-mini")]
    assert events[1]["code"] == "model_not_allowed" and events[0]["websocket"] is True
    # the server's answer passes (scrubbed); the WebSocket goes on
    assert not hook(gate, flow, b'{"type": "response.completed"}', from_client=False).dropped
    assert not hook(gate, flow, _create(max_output_tokens=5)).dropped


def test_the_hook_closes_on_what_it_cannot_judge(gate: Gate) -> None:
    flow = _flow(gate)
    msg = hook(gate, flow, b'{"type": "session.update"}')
    assert msg.dropped and flow.metadata[wscontrol.CLOSE_KEY][0] == 1008
    assert audited(gate)[-1]["code"] == "bad_request"
    assert hook(gate, flow, _create()).dropped  # nothing after it goes


def test_the_hook_fails_closed(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandgate.stages import wsllm

    def boom(*args: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(wsllm, "judge_client", boom)
    flow = _flow(gate)
    msg = hook(gate, flow, _create())
    assert msg.dropped and flow.metadata[wscontrol.CLOSE_KEY][0] == 1008


def test_a_call_that_cannot_be_audited_is_not_forwarded(
        gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail closed: once the audit log cannot be written, an allowed response.create is
    dropped and the WebSocket closed, not sent unaudited."""
    from sandgate.mitm.guards import wscontrol
    from tests.support.wsgate import break_audit

    flow = _flow(gate)
    assert not hook(gate, flow, _create(max_output_tokens=10)).dropped
    break_audit(gate, monkeypatch)
    msg = hook(gate, flow, _create(max_output_tokens=10))
    assert msg.dropped
    assert flow.metadata[wscontrol.CLOSE_KEY][0] == 1008
    assert hook(gate, flow, _create(max_output_tokens=10)).dropped
