"""Spend and models (#39) end to end: the official anthropic, openai and google-genai SDKs,
holding placeholder keys, through `sandgate run` with OpenBao, against stand-in APIs that answer
with real usage fields (tests/support/llmapis.py), streaming and not."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.admin_support import ADMIN_TOKEN, Admin, delta, wait_for
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    OPENAI_KEY,
    SECRET_VALUES,
    Proxy,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.support.llmapis import CACHED, INPUT, OUTPUT, REASONING, LlmServer
from tests.support.pki import make_pki
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration

LLM_IP = "127.0.0.39"
NAMES = ["anthropic.llm.test", "openai.llm.test", "gemini.llm.test"]
TIGHT = 50  # output tokens of budget `tight`: each call asks for 20, spends OUTPUT (10)
SHARED = 100  # output tokens of budget `shared`, spent by concurrent calls asking 20 each
CAP = 20

POLICY = f"""version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
  openai: {{vault: secret/data/llm/openai, field: api_key}}
budgets:
  tight: {{output_tokens: {TIGHT}, per: 1h}}
  shared: {{output_tokens: {SHARED}, per: 1h, scope: sandbox}}
  roomy: {{output_tokens: 1000000, cost_usd: 100, per: 1h}}
  pricey: {{cost_usd: 0.0005, per: 1h}}
templates:
  apis:
    - name: anthropic
      hosts: [anthropic.llm.test]
      methods: [POST]
      paths: [/v1/messages]
      inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
      private_cidrs: [{LLM_IP}/32]
      llm: {{api: anthropic, models: ["claude-sonnet-*"], max_tokens: 64}}
    - name: openai
      hosts: [openai.llm.test]
      methods: [POST]
      paths: [/v1/chat/completions, /v1/responses]
      inject: {{headers: {{authorization: "Bearer {{{{ secrets.openai }}}}"}}}}
      private_cidrs: [{LLM_IP}/32]
      llm: {{api: openai, models: ["gpt-4o-mini*"], max_tokens: 32, on_max_tokens: lower,
             own_credentials: replace, budget: roomy}}
    - name: gemini
      hosts: [gemini.llm.test]
      methods: [POST]
      paths: ["/v1beta/models/**"]
      inject: {{headers: {{x-goog-api-key: "{{{{ secrets.openai }}}}"}}}}
      private_cidrs: [{LLM_IP}/32]
      llm: {{api: gemini, models: ["gemini-2.5-*"]}}
identities:
  agent:
    use: [apis]
  pricey:
    rules:
      - name: anthropic
        hosts: [anthropic.llm.test]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: anthropic, max_tokens: {CAP}, budget: pricey}}
  subst:
    rules:
      - name: anthropic
        hosts: [anthropic.llm.test]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        substitute: [openai]
        substitute_body: true
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: anthropic, max_tokens: 16, on_max_tokens: lower}}
  compat:
    rules:
      - name: openai-compatible
        hosts: [openai.llm.test]
        methods: [POST]
        paths: [/v1/chat/completions]
        inject: {{headers: {{authorization: "Bearer {{{{ secrets.openai }}}}"}}}}
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: openai}}
  budgeted:
    rules:
      - name: anthropic
        hosts: [anthropic.llm.test]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: anthropic, max_tokens: {CAP}, budget: tight}}
  crowd:
    rules:
      - name: openai
        hosts: [openai.llm.test]
        methods: [POST]
        paths: [/v1/chat/completions]
        inject: {{headers: {{authorization: "Bearer {{{{ secrets.openai }}}}"}}}}
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: openai, max_tokens: {CAP}, budget: shared}}
"""


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Iterator[tuple[Proxy, LlmServer]]:
    tmp = tmp_path_factory.mktemp("spend")
    pki = make_pki(tmp / "pki", NAMES)
    server = LlmServer(LLM_IP, 443, str(pki.cert), str(pki.key)).start()
    yield pki, server  # type: ignore[misc]
    server.stop()


@pytest.fixture(scope="module")
def admin(tmp_path_factory, vault, llm) -> Iterator[Admin]:
    pki, _server = llm
    tmp = tmp_path_factory.mktemp("spendproxy")
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "spend.yaml").write_text(POLICY)
    port = free_port()
    p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                                    "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN},
                    pki, *[f"--resolve={n}={LLM_IP}" for n in NAMES],
                    "--admin", f"127.0.0.1:{port}")
    a = Admin(p, f"http://127.0.0.1:{port}", policies)
    wait_for(lambda: a.get("/healthz", token=None)[0] == 200, 15, "the admin listener")
    yield a
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


@pytest.fixture(scope="module")
def proxy(admin) -> Proxy:
    return admin.proxy


@pytest.fixture
def apis(llm):
    server = llm[1]
    server.apis.calls.clear()
    return server.apis


def sdk(proxy: Proxy, identity: str, script: str, sandbox: str | None = None) -> dict:
    """Run `script` with the SDK venv; it prints one JSON line (the last line) to return."""
    need_sdk("anthropic", "openai", "google.genai")
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
    token = proxy.token(identity, sandbox=sandbox)
    env.update({
        "HTTPS_PROXY": f"http://{identity}:{token}@{proxy.host}:{proxy.port}",
        "NO_PROXY": "", "SSL_CERT_FILE": str(proxy.ca),
        "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
        "ANTHROPIC_BASE_URL": "https://anthropic.llm.test",
        "OPENAI_API_KEY": "sandgate-placeholder-openai",
        "OPENAI_BASE_URL": "https://openai.llm.test/v1",
    })
    r = subprocess.run([str(CLIENT_PY), "-c", PRELUDE + script], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK output")
    return json.loads(r.stdout.strip().splitlines()[-1])


PRELUDE = """
import json, sys
def error(e):
    resp = getattr(e, "response", None)
    return {"error": type(e).__name__, "status": getattr(e, "status_code", None),
            "message": str(e),
            "retry_after": resp.headers.get("retry-after") if resp is not None else None}
"""

ANTHROPIC = """
import anthropic
client = anthropic.Anthropic(max_retries=0)
def call(model, max_tokens, stream):
    try:
        if stream:
            with client.messages.stream(model=model, max_tokens=max_tokens,
                                        messages=[{"role": "user", "content": "hi"}]) as s:
                text = "".join(s.text_stream)
                m = s.get_final_message()
        else:
            m = client.messages.create(model=model, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "hi"}])
            text = m.content[0].text
        return {"text": text, "output": m.usage.output_tokens}
    except anthropic.APIStatusError as e:
        return error(e)
"""


def anthropic_call(proxy: Proxy, identity: str, model: str, max_tokens: int,
                   stream: bool) -> dict:
    return sdk(proxy, identity, ANTHROPIC + f"print(json.dumps(call({model!r}, {max_tokens}, "
                                            f"{stream})))")


def audits(proxy: Proxy, identity: str) -> list[dict]:
    return [e for e in proxy.audit() if e.get("identity") == identity and "llm" in e]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_call_allowed_and_its_usage_audited(admin, proxy, apis, stream):
    before = len(audits(proxy, "agent"))
    metrics = admin.metrics()
    out = anthropic_call(proxy, "agent", "claude-sonnet-4-5", 64, stream)
    assert out["text"] in ("hello from the stand-in", "hello streamed")
    assert out["output"] == OUTPUT
    assert_secret_equal(apis.calls[-1].headers.get("x-api-key"), ANTHROPIC_KEY, "x-api-key")
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent" and "llm" in e
                          and len(audits(proxy, "agent")) > before)
    assert ev["llm"]["api"] == "anthropic" and ev["llm"]["model"] == "claude-sonnet-4-5"
    assert ev["llm"]["stream"] is stream and ev["llm"]["max_tokens"] == 64
    assert ev["llm"]["usage"] == {"input_tokens": INPUT, "output_tokens": OUTPUT,
                                  "cached_tokens": CACHED, "reasoning_tokens": 0}
    # the shipped price of claude-sonnet-4*: 3 $/M in, 0.3 cached, 15 out
    assert ev["llm"]["cost_usd"] == pytest.approx(
        ((INPUT - CACHED) * 3 + CACHED * 0.3 + OUTPUT * 15) / 1e6, abs=1e-6)
    labels = {"identity": "agent", "sandbox": "none", "model": "claude-sonnet-*"}

    def counted() -> dict | None:  # the metrics listener runs after the audit line is written
        m = admin.metrics()
        return m if delta(metrics, m, "sandgate_llm_cost_usd_total", **labels) > 0 else None

    after = wait_for(counted, 5, "the call's metrics")
    for kind, n in (("input", INPUT), ("output", OUTPUT), ("cached", CACHED)):
        assert delta(metrics, after, "sandgate_llm_tokens_total", kind=kind, **labels) == n
    assert delta(metrics, after, "sandgate_llm_cost_usd_total", **labels) == pytest.approx(
        ev["llm"]["cost_usd"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_disallowed_model_refused_with_the_reason_in_the_sdk(proxy, apis, stream):
    out = anthropic_call(proxy, "agent", "claude-opus-4-1", 64, stream)
    assert out["error"] == "PermissionDeniedError" and out["status"] == 403
    assert "model_not_allowed" in out["message"] and "claude-opus-4-1" in out["message"]
    assert not apis.calls  # never forwarded


def test_a_percent_encoded_path_is_judged_as_the_call_it_is(proxy, apis):
    """`/v1/%6Dessages` is the Messages API once decoded, as the rule's path glob (and the
    upstream) read it: its model is judged, never forwarded unjudged."""
    out = sdk(proxy, "agent", """
import httpx
r = httpx.post("https://anthropic.llm.test/v1/%6Dessages",
               headers={"x-api-key": "sandgate-placeholder-anthropic",
                        "anthropic-version": "2023-06-01"},
               json={"model": "claude-opus-4-1", "max_tokens": 16,
                     "messages": [{"role": "user", "content": "hi"}]})
print(json.dumps({"status": r.status_code, "reason": r.headers.get("x-sandgate-reason")}))
""")
    assert out == {"status": 403, "reason": "model_not_allowed"}
    assert not apis.calls


def test_max_tokens_over_cap_refused_with_the_reason_in_the_sdk(proxy, apis):
    out = anthropic_call(proxy, "agent", "claude-sonnet-4-5", 65, False)
    assert out["error"] == "BadRequestError" and out["status"] == 400
    assert "max_tokens_over_cap" in out["message"] and "64" in out["message"]
    assert not apis.calls


OPENAI = """
import openai
client = openai.OpenAI(max_retries=0)
def call(model, max_tokens, stream, include_usage=False):
    try:
        kw = {"stream_options": {"include_usage": True}} if include_usage else {}
        r = client.chat.completions.create(
            model=model, max_tokens=max_tokens, stream=stream, **kw,
            messages=[{"role": "user", "content": "hi"}])
        if not stream:
            return {"text": r.choices[0].message.content, "output": r.usage.completion_tokens}
        chunks = list(r)
        return {"text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                "chunks": len(chunks),
                "usage_chunks": sum(1 for c in chunks if c.usage is not None)}
    except openai.APIStatusError as e:
        return error(e)
"""


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_stream_usage_read_without_changing_what_the_client_sees(proxy, apis,
                                                                          include_usage):
    out = sdk(proxy, "agent", OPENAI + f"print(json.dumps(call('gpt-4o-mini', 500, True, "
                                       f"{include_usage})))")
    assert out["text"] == "hello streamed"
    # Sandgate asked for the usage chunk; the client gets it only when it asked itself
    assert apis.calls[-1].body["stream_options"] == {"include_usage": True}
    assert (out["chunks"], out["usage_chunks"]) == ((3, 1) if include_usage else (2, 0))
    # over the rule's cap of 32 with `on_max_tokens: lower`: forwarded with the cap
    assert apis.calls[-1].body["max_tokens"] == 32
    assert_secret_equal(apis.calls[-1].headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "authorization")
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent"
                          and (e.get("llm") or {}).get("api") == "openai-chat")
    assert ev["llm"]["usage"] == {"input_tokens": INPUT, "output_tokens": OUTPUT,
                                  "cached_tokens": CACHED, "reasoning_tokens": REASONING}
    assert ev["llm"]["max_tokens"] == 32 and "max_tokens lowered to 32" in ev["llm"]["notes"]


def test_no_budget_on_a_compatible_server_leaves_the_stream_request_as_sent(proxy, apis):
    """Without a budget to count, Sandgate does not add `stream_options` on a host that is
    not OpenAI's (a compatible server may not know it): the usage is then not read."""
    out = sdk(proxy, "compat", OPENAI + "print(json.dumps(call('any-model', 5, True)))")
    assert out["text"] == "hello streamed" and out["usage_chunks"] == 0
    assert "stream_options" not in apis.calls[-1].body
    ev = proxy.wait_audit(lambda e: e.get("identity") == "compat" and "llm" in e)
    assert "usage" not in ev["llm"] and ev["llm"]["model"] == "any-model"


def test_a_lowered_cap_keeps_body_substitution_in_place(proxy, apis):
    """The cap is lowered by rewriting the body; a `substitute_body` rule's placeholders are
    then found again in the rewritten body, so the value lands where the placeholder was."""
    script = ANTHROPIC.replace(
        "messages=[{\"role\": \"user\", \"content\": \"hi\"}])\n            text",
        "messages=[{\"role\": \"user\", \"content\": \"hi\"}],\n"
        "                metadata={\"user_id\": \"sandgate-placeholder-openai\"})\n"
        "            text")
    assert "metadata" in script
    out = sdk(proxy, "subst", script + "print(json.dumps(call('claude-x', 500, False)))")
    assert out["output"] == OUTPUT, out
    sent = apis.calls[-1].body
    assert sent["max_tokens"] == 16
    assert_secret_equal(sent["metadata"]["user_id"], OPENAI_KEY, "the substituted body value")


def test_own_credential_refused_on_anthropic(proxy, apis):
    """The SDK holds the placeholder in x-api-key, and a key of its own in Authorization
    (ANTHROPIC_AUTH_TOKEN): refused, so no budget, allow-list or audit is side-stepped."""
    script = ANTHROPIC.replace("anthropic.Anthropic(max_retries=0)",
                               "anthropic.Anthropic(max_retries=0, auth_token='sk-ant-own-1')")
    out = sdk(proxy, "agent", script + "print(json.dumps(call('claude-sonnet-4-5', 10, False)))")
    assert out["error"] == "PermissionDeniedError" and "own_credential" in out["message"]
    assert "header authorization" in out["message"]
    assert not apis.calls
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent"
                          and e.get("code") == "own_credential")
    assert any("refused" in i for i in ev["injected"])


def test_own_credential_replaced_on_openai(proxy, apis):
    script = OPENAI.replace("openai.OpenAI(max_retries=0)", "openai.OpenAI(max_retries=0, "
                            "default_headers={'x-api-key': 'own-key-2'})")
    out = sdk(proxy, "agent", script + "print(json.dumps(call('gpt-4o-mini', 10, False)))")
    assert out["text"] == "hello from the stand-in"
    assert "x-api-key" not in apis.calls[-1].headers  # only Sandgate's credential went
    assert_secret_equal(apis.calls[-1].headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "authorization")
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent"
                          and any("removed" in i for i in e.get("injected") or ()))
    assert "header x-api-key" in " ".join(ev["injected"])


RESPONSES = """
import openai
client = openai.OpenAI(max_retries=0)
def call(model, max_output_tokens, stream):
    try:
        r = client.responses.create(model=model, input="hi", stream=stream,
                                    max_output_tokens=max_output_tokens)
        if not stream:
            return {"text": r.output_text, "output": r.usage.output_tokens}
        events = list(r)
        return {"text": "".join(getattr(e, "delta", "") for e in events
                                if e.type == "response.output_text.delta"),
                "events": [e.type for e in events]}
    except openai.APIStatusError as e:
        return error(e)
"""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_responses_usage_and_cap(proxy, apis, stream):
    out = sdk(proxy, "agent", RESPONSES + f"print(json.dumps(call('gpt-4o-mini', 1000, "
                                          f"{stream})))")
    assert out["text"] == "hello from the stand-in", out
    assert apis.calls[-1].body["max_output_tokens"] == 32  # lowered to the rule's cap
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent"
                          and (e.get("llm") or {}).get("api") == "openai-responses"
                          and e["llm"].get("stream") is stream)
    assert ev["llm"]["usage"] == {"input_tokens": INPUT, "output_tokens": OUTPUT,
                                  "cached_tokens": CACHED, "reasoning_tokens": REASONING}
    out = sdk(proxy, "agent", RESPONSES + f"print(json.dumps(call('o3', 10, {stream})))")
    assert out["status"] == 403 and "model_not_allowed" in out["message"]


def test_openai_disallowed_model(proxy, apis):
    out = sdk(proxy, "agent", OPENAI + "print(json.dumps(call('gpt-4o', 10, False)))")
    assert out["error"] == "PermissionDeniedError" and "model_not_allowed" in out["message"]
    assert not apis.calls


GEMINI = """
from google import genai
from google.genai import types, errors
client = genai.Client(api_key="sandgate-placeholder-gemini", http_options=types.HttpOptions(
    base_url="https://gemini.llm.test", api_version="v1beta"))
def call(model, stream):
    try:
        if stream:
            parts = list(client.models.generate_content_stream(model=model, contents="hi"))
            return {"text": "".join(p.text or "" for p in parts)}
        r = client.models.generate_content(model=model, contents="hi")
        return {"text": r.text, "output": r.usage_metadata.candidates_token_count}
    except errors.APIError as e:
        return {"error": type(e).__name__, "status": e.code, "message": str(e)}
"""


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gemini_usage_and_allow_list(proxy, apis, stream):
    out = sdk(proxy, "agent", GEMINI + f"print(json.dumps(call('gemini-2.5-flash', {stream})))")
    assert out["text"] == "hello", out
    ev = proxy.wait_audit(lambda e: e.get("identity") == "agent"
                          and (e.get("llm") or {}).get("api") == "gemini"
                          and e["llm"].get("stream") is stream)
    assert ev["llm"]["model"] == "gemini-2.5-flash"
    assert ev["llm"]["usage"]["input_tokens"] == INPUT
    assert ev["llm"]["usage"]["output_tokens"] == OUTPUT
    out = sdk(proxy, "agent", GEMINI + f"print(json.dumps(call('gemini-1.5-pro', {stream})))")
    assert out["status"] == 403 and "model_not_allowed" in out["message"]


def test_token_budget_allows_exactly_what_it_should(proxy, apis):
    """Each call asks for 20 output tokens (its reservation) and spends 10: a budget of 50 lets
    a call through while anything is left, so 5 calls (10, 20, 30, 40, 50 spent), then 429."""
    script = ANTHROPIC + (
        "print(json.dumps([call('claude-sonnet-4-5', 20, i % 2 == 1) for i in range(7)]))")
    out = sdk(proxy, "budgeted", script)
    assert [o.get("output") for o in out[:5]] == [OUTPUT] * 5, out
    for refused in out[5:]:
        assert refused["error"] == "RateLimitError" and refused["status"] == 429
        assert "spend_exhausted" in refused["message"] and "tight" in refused["message"]
        assert int(refused["retry_after"]) > 3000  # the 1h window's rest
    assert len(apis.calls) == 5
    ev = proxy.wait_audit(lambda e: e.get("identity") == "budgeted"
                          and e.get("code") == "spend_exhausted")
    assert ev["llm"]["budget"] == "tight"


def test_cost_budget_priced_by_the_shipped_table(proxy, apis):
    """claude-sonnet-4* at 3 $/M in (0.3 cached), 15 out: each call costs 176 µ$ (12 in, 4 of
    them cached, 10 out) and reserves its worst case; a budget of 500 µ$ admits calls while
    anything is left: 3 (0, 176, 352 spent before each), then 429. A model without a price is
    refused: the budget could not count it."""
    script = ANTHROPIC + (
        "print(json.dumps([call('claude-sonnet-4-5', 20, False) for i in range(5)]"
        " + [call('no-price-model', 20, False)]))")
    out = sdk(proxy, "pricey", script)
    assert [o.get("output") for o in out[:3]] == [OUTPUT] * 3, out
    assert all(o.get("status") == 429 and "spend_exhausted" in o["message"] for o in out[3:5])
    assert out[5]["status"] == 403 and "has no price" in out[5]["message"]
    assert len(apis.calls) == 3


CONCURRENT = OPENAI + """
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(12) as pool:
    out = list(pool.map(lambda i: call("gpt-4o-mini", 20, i % 2 == 0), range(24)))
print(json.dumps(out))
"""


def test_concurrent_calls_never_pass_the_budget_by_more_than_one_call(proxy, apis):
    """24 calls at once (12 in flight), each reserving 20 and spending 10, on a budget of 100
    per sandbox: the calls in flight never spend more than the budget plus one call's worst
    case (reservations count while in flight), and every reservation is settled: later calls
    go through until the budget is spent, exactly."""
    apis.delay = 0.2
    try:
        out = sdk(proxy, "crowd", CONCURRENT, sandbox="sb-1")
    finally:
        apis.delay = 0.0
    ok = [o for o in out if "error" not in o]
    assert ok and all(o["status"] == 429 and "spend_exhausted" in o["message"]
                      for o in out if "error" in o)
    assert OUTPUT * len(ok) <= SHARED + CAP, out
    later = sdk(proxy, "crowd", OPENAI + "print(json.dumps([call('gpt-4o-mini', 20, False) "
                                         "for _ in range(12)]))", sandbox="sb-1")
    ok += [o for o in later if "error" not in o]
    assert OUTPUT * len(ok) == SHARED, (out, later)  # admitted while anything was left
    assert "error" in later[-1] and len(apis.calls) == len(ok)
    # another sandbox has its own budget
    assert "error" not in sdk(proxy, "crowd", OPENAI + "print(json.dumps(call('m', 5, False)))",
                              sandbox="sb-2")


# --- three replicas sharing one Redis ---------------------------------------------------------

REDIS_IP = "127.0.39.1"
FLEET_BUDGET = 100


@pytest.fixture(scope="module")
def fleet_redis(tmp_path_factory) -> Iterator[Any]:
    from tests.support.redis import RedisServer

    redis = RedisServer(tmp_path_factory.mktemp("spendredis"), REDIS_IP, 6379).start()
    yield redis
    redis.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, vault, llm, fleet_redis) -> Iterator[list[Proxy]]:
    """Three `sandgate run` processes with one Redis (`--state`), one token key and CA."""
    import shutil

    pki, _server = llm
    tmp = tmp_path_factory.mktemp("spendfleet")
    redis = fleet_redis
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "spend.yaml").write_text(POLICY.replace(
        f"shared: {{output_tokens: {SHARED}", f"shared: {{output_tokens: {FLEET_BUDGET}"))
    args = [*[f"--resolve={n}={LLM_IP}" for n in NAMES], "--state", redis.url,
            "--state-prefix", "spendtest:", "--state-timeout", "2", "--no-watch"]
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}
    started: list[Proxy] = []
    try:
        for name in ("a", "b", "c"):
            (tmp / name).mkdir()
            if started:  # the same token key and CA as replica a
                shutil.copytree(started[0].confdir, tmp / name / "conf")
            started.append(start_proxy(tmp / name, policies, env, pki, *args))
        yield started
    finally:
        for p in started:
            stop_proxy(p)


FLEET = OPENAI + """
import os
from concurrent.futures import ThreadPoolExecutor
urls = json.loads(os.environ["PROXIES"])
clients = [openai.OpenAI(max_retries=0, http_client=openai.DefaultHttpxClient(proxy=u))
           for u in urls]
def on(i, stream):
    c = clients[i % len(clients)]
    try:
        r = c.chat.completions.create(model="gpt-4o-mini", max_tokens=20, stream=stream,
                                      messages=[{"role": "user", "content": "hi"}])
        if stream:
            list(r)
        return {"ok": i % len(clients)}
    except openai.APIStatusError as e:
        return error(e)
burst = int(os.environ["BURST"])
with ThreadPoolExecutor(12) as pool:
    first = list(pool.map(lambda i: on(i, i % 2 == 0), range(burst)))
then = [on(i, False) for i in range(int(os.environ["THEN"]))]
print(json.dumps([first, then]))
"""


def test_three_replicas_share_one_budget(replicas, apis):
    """Concurrent calls spread over three replicas: together they never pass the budget by more
    than one call's worst case, and once all settled the budget is spent exactly."""
    identity, sandbox = "crowd", "fleet-sb"
    token = replicas[0].token(identity, sandbox=sandbox)
    urls = [f"http://{identity}:{token}@{p.host}:{p.port}" for p in replicas]
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
    env.update({"PROXIES": json.dumps(urls), "BURST": "30", "THEN": "15", "NO_PROXY": "",
                "SSL_CERT_FILE": str(replicas[0].ca),
                "OPENAI_API_KEY": "sandgate-placeholder-openai",
                "OPENAI_BASE_URL": "https://openai.llm.test/v1"})
    apis.delay = 0.2
    try:
        r = subprocess.run([str(CLIENT_PY), "-c", PRELUDE + FLEET], capture_output=True,
                           text=True, env=env, timeout=180)
    finally:
        apis.delay = 0.0
    assert r.returncode == 0, r.stderr[-3000:]
    first, then = json.loads(r.stdout.strip().splitlines()[-1])
    ok_first = [o for o in first if "ok" in o]
    assert OUTPUT * len(ok_first) <= FLEET_BUDGET + CAP, first
    ok = ok_first + [o for o in then if "ok" in o]
    assert OUTPUT * len(ok) == FLEET_BUDGET, (first, then)
    assert len({o["ok"] for o in ok}) > 1  # more than one replica served calls
    refused = [o for o in first + then if "ok" not in o]
    assert refused and all(o["status"] == 429 and "spend_exhausted" in o["message"]
                           for o in refused)
    assert len(apis.calls) == len(ok)


def test_redis_down_budgeted_calls_fail_closed(replicas, fleet_redis, apis):
    """With the shared state gone, a budgeted call cannot be counted: refused (503
    state_unavailable, in OpenAI's error shape) and never forwarded."""
    fleet_redis.kill()
    try:
        identity = "crowd"
        token = replicas[1].token(identity, sandbox="down-sb")
        env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
        env.update({"HTTPS_PROXY": f"http://{identity}:{token}@{replicas[1].host}:"
                                   f"{replicas[1].port}",
                    "NO_PROXY": "", "SSL_CERT_FILE": str(replicas[0].ca),
                    "OPENAI_API_KEY": "sandgate-placeholder-openai",
                    "OPENAI_BASE_URL": "https://openai.llm.test/v1"})
        r = subprocess.run([str(CLIENT_PY), "-c", PRELUDE + OPENAI + "print(json.dumps("
                            "call('gpt-4o-mini', 5, False)))"], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["status"] == 503 and "state_unavailable" in out["message"]
        assert "LLM budget" in out["message"] and not apis.calls
    finally:
        fleet_redis.start()
