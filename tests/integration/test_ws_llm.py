"""One rule, every transport, for LLM calls: the Responses API's WebSocket transport, end to end.

Found on main: a rule with `llm:` (a model allow-list, an output cap) that also allowed GET let
a WebSocket upgrade through, and the `response.create` calls sent on it went to the upstream
unjudged: any model, any cap.

A real `sandgate run` with OpenBao, the stand-in Responses API (tests/support/openai_responses.py,
TLS, both transports) and aiohttp's WebSocket client. Without `websocket: true` the upgrade is
refused (403 upgrade_refused); with it the key is injected into the upgrade, each call is
judged (a model outside the list is answered with the API's WebSocket error event and never
reaches the upstream, the WebSocket stays open), the answer's deltas are scrubbed as the
client joins them, and a message that cannot be judged closes the WebSocket with 1008.

Address: 127.0.49.1 llm.ws.test; run inside `unshare -n` like every non-Docker integration test.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import OPENAI_KEY, SECRET_VALUES, Proxy, start_proxy, stop_proxy
from tests.support.openai_responses import StandInResponses
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.tunnel import proxy_auth
from tests.support.upstream import AppThread

pytestmark = pytest.mark.integration

IP, HOST = "127.0.49.1", "llm.ws.test"

RULE = f"hosts: [{HOST}], methods: [GET], private_cidrs: [{IP}/32], " \
    "inject: {headers: {authorization: 'Bearer {{ secrets.openai }}'}}"

POLICY = f"""
version: v1
secrets:
  openai: {{vault: secret/data/llm/openai, field: api_key}}
identities:
  agent:
    rules:
      - {{name: ws, paths: [/v1/responses], websocket: true, {RULE},
         llm: {{api: openai, models: ["gpt-5*"], max_tokens: 1000}}}}
      - {{name: closed, paths: [/v2/responses], {RULE}, llm: {{api: openai}}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, vault) -> Iterator[tuple[Proxy,
                                                                            StandInResponses]]:
    tmp = tmp_path_factory.mktemp("wsllm")
    pki = make_pki(tmp / "pki", [HOST])
    api = StandInResponses(command="true", leak=True)
    server = AppThread(api.app(), pki.cert, pki.key, IP).start()
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "wsllm.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr,
                                        "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve={HOST}={IP}")
    try:
        yield proxy, api
    finally:
        stop_proxy(proxy)
        server.stop()
        logs = proxy.logs() + proxy.audit_file.read_text()
        assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


def _create(model: str, **extra: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": model, "max_output_tokens": 100,
            "input": [], **extra}


async def _session(proxy: Proxy, path: str, sends: list[Any]) -> tuple[list[Any], int | None]:
    """Open a WebSocket to `path` through Sandgate, and for each message sent read what comes
    back up to its `response.completed` or `error` event. Returns the events and the close
    code (None: still open). Bounded: 20 s in all."""
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    got: list[Any] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        auth = {"Proxy-Authorization": proxy_auth("agent", proxy.token("agent"))}
        async with session.ws_connect(f"wss://{HOST}{path}", proxy=proxy.url, ssl=ctx,
                                      proxy_headers=auth) as ws:
            for msg in sends:
                await ws.send_str(msg if isinstance(msg, str) else json.dumps(msg))
                while True:
                    frame = await ws.receive(timeout=10)
                    if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                      aiohttp.WSMsgType.CLOSING):
                        return got, ws.close_code
                    assert frame.type == aiohttp.WSMsgType.TEXT, frame.type
                    doc = json.loads(frame.data)
                    got.append(doc)
                    if doc.get("type") in ("response.completed", "error"):
                        break
    return got, None


def session(proxy: Proxy, path: str, sends: list[Any]) -> tuple[list[Any], int | None]:
    return asyncio.run(_session(proxy, path, sends))


def test_the_upgrade_on_an_llm_rule_without_opt_in_is_refused(stack) -> None:
    proxy, api = stack
    before = len(api.upgrades)
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        session(proxy, "/v2/responses", [_create("gpt-5")])
    assert e.value.status == 403
    assert len(api.upgrades) == before  # nothing reached the upstream
    event = proxy.wait_audit(lambda e: e.get("event") == "request"
                             and e.get("path") == "/v2/responses")
    assert event["code"] == "upgrade_refused" and event["websocket"] is True


def test_each_call_is_judged_and_the_answer_scrubbed(stack) -> None:
    proxy, api = stack
    before, upgrades = len(api.calls), len(api.upgrades)
    output = [{"type": "function_call_output", "call_id": "c1", "output": "tool ran"}]
    got, closed = session(proxy, "/v1/responses", [
        _create("gpt-5-codex"),
        _create("o4-mini"),  # not in the rule's models: answered, never sent
        _create("gpt-5-codex", max_output_tokens=5000),  # over the cap
        _create("gpt-5-codex", input=output),  # the final answer, the key cut in two deltas
    ])
    assert closed is None
    kinds = [d["type"] for d in got]
    assert kinds.count("response.completed") == 2 and kinds.count("error") == 2, kinds
    errors = [d for d in got if d["type"] == "error"]
    assert [(d["status"], d["error"]["code"]) for d in errors] == [
        (403, "model_not_allowed"), (400, "max_tokens_over_cap")]
    # only the allowed calls reached the upstream, over one upgrade carrying the injected key
    sent = [c.body["model"] for c in api.calls[before:]]
    assert sent == ["gpt-5-codex", "gpt-5-codex"]
    (up,) = api.upgrades[upgrades:]
    assert_secret_equal(up.headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "the injected key")
    # the deltas the client joins hold the key only as Sandgate's marker
    joined = "".join(d["delta"] for d in got if d["type"] == "response.output_text.delta")
    assert "[REDACTED:openai]" in joined and "tool ran" in joined
    assert_no_secret([json.dumps(got)], SECRET_VALUES, "what the client got")
    calls = [e for e in proxy.audit() if e.get("event") == "websocket"
             and e.get("path") == "/v1/responses" and e.get("llm")]
    assert [(e["decision"], e["llm"]["model"], e["code"]) for e in calls[-4:]] == [
        ("allow", "gpt-5-codex", None), ("deny", "o4-mini", "model_not_allowed"),
        ("deny", "gpt-5-codex", "max_tokens_over_cap"), ("allow", "gpt-5-codex", None)]


def test_a_message_that_cannot_be_judged_closes(stack) -> None:
    proxy, api = stack
    before = len(api.calls)
    got, closed = session(proxy, "/v1/responses", [{"type": "session.update", "model": "o4"}])
    assert closed == 1008 and got == []
    assert len(api.calls) == before
    event = proxy.wait_audit(lambda e: e.get("event") == "websocket"
                             and e.get("code") == "bad_request")
    assert "session.update" in event["reason"]
