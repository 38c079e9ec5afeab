"""A key split across streamed events never reaches what the client joins (issue 34).

A real `sandgate run` with OpenBao injects the key; a real TLS upstream (aiohttp) streams it
back cut between events, the way an LLM API streams a model's text: Anthropic Messages SSE,
OpenAI chat SSE, Gemini's JSON array, NDJSON, and OpenAI-Realtime-style WebSocket text deltas.
No single event holds the key, so a per-event scrub lets both halves pass; the clients here
(curl, the official anthropic SDK, a wsproto client) join the deltas as every agent does.

Found on main: the joined text held the real key. Address: 127.0.34.2 (llm.sj.test,
ws.sj.test); run inside `unshare -n` like every non-Docker integration test.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import wsproto.events as ev
from aiohttp import WSMsgType, web

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    SECRET_VALUES,
    Proxy,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.pki import make_pki
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.upstream import AppThread
from tests.support.wsclient import WsprotoClient

pytestmark = pytest.mark.integration

IP = "127.0.34.2"
HOST, WS_HOST = "llm.sj.test", "ws.sj.test"
MARKER = "[REDACTED:anthropic]"

POLICY = f"""
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
identities:
  agent:
    rules:
      - name: llm
        hosts: [{HOST}, {WS_HOST}]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{IP}/32]
"""


def _pieces(key: str) -> list[str]:
    """The model's text, the key cut in three: no piece holds it, or 8 of its bytes."""
    return ["Here is the key you asked for: " + key[:5], key[5:12], key[12:20],
            key[20:] + ". Keep it safe."]


def _sse(obj: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj)}\n\n".encode()


def anthropic_events(key: str) -> list[bytes]:
    events = [
        _sse({"type": "message_start", "message": {
            "id": "msg_sj", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}}, "message_start"),
        _sse({"type": "content_block_start", "index": 0,
              "content_block": {"type": "text", "text": ""}}, "content_block_start"),
    ]
    events += [_sse({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": p}}, "content_block_delta")
               for p in _pieces(key)]
    events += [
        _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                 "stop_sequence": None},
              "usage": {"output_tokens": 9}}, "message_delta"),
        _sse({"type": "message_stop"}, "message_stop"),
    ]
    return events


def chat_events(key: str) -> list[bytes]:
    return [_sse({"id": "c", "object": "chat.completion.chunk", "model": "gpt-test",
                  "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]})
            for p in _pieces(key)] + [b"data: [DONE]\n\n"]


def gemini_events(key: str) -> list[bytes]:
    docs = [json.dumps({"candidates": [{"content": {"role": "model", "parts": [{"text": p}]},
                                        "index": 0}]}).encode() for p in _pieces(key)]
    return [b"[" + docs[0]] + [b",\r\n" + d for d in docs[1:]] + [b"]"]


def ndjson_events(key: str) -> list[bytes]:
    return [json.dumps({"message": {"role": "assistant", "content": p}}).encode() + b"\n"
            for p in _pieces(key)]


STREAMS: dict[str, tuple[str, Callable[[str], list[bytes]]]] = {
    "/v1/messages": ("text/event-stream", anthropic_events),
    "/v1/chat/completions": ("text/event-stream", chat_events),
    "/v1beta/models/m:streamGenerateContent": ("application/json", gemini_events),
    "/api/chat": ("application/x-ndjson", ndjson_events),
}


class StreamingUpstream:
    """Streams each event in its own write, a pause between, the key from x-api-key."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.release = threading.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/realtime", self.realtime)
        app.router.add_get("/first-event", self.first_event)
        app.router.add_route("*", "/{tail:.*}", self.stream)
        return app

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        key = request.headers.get("x-api-key", "")
        self.keys.append(key)
        ctype, make = STREAMS[request.path]
        events = make(key)
        if request.query.get("whole"):  # known length: Sandgate scrubs the body at once
            return web.Response(body=b"".join(events), content_type=ctype)
        resp = web.StreamResponse(headers={"Content-Type": ctype})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
            await asyncio.sleep(0.03)
        await resp.write_eof()
        return resp

    async def first_event(self, request: web.Request) -> web.StreamResponse:
        """One event with no candidate, then nothing until the test has seen it."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_sse({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": "first words"}}))
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 20)
        await resp.write(_sse({"type": "message_stop"}))
        await resp.write_eof()
        return resp

    async def realtime(self, request: web.Request) -> web.WebSocketResponse:
        key = request.headers.get("x-api-key", "")
        self.keys.append(key)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.TEXT and msg.data == "go":
                for p in _pieces(key):
                    await ws.send_str(json.dumps({
                        "type": "response.text.delta", "item_id": "item_1", "output_index": 0,
                        "content_index": 0, "delta": p}))
                    await asyncio.sleep(0.03)
                await ws.send_str(json.dumps({"type": "response.text.done", "item_id": "item_1",
                                              "output_index": 0, "content_index": 0}))
        return ws


@pytest.fixture(scope="module")
def sj(tmp_path_factory: pytest.TempPathFactory, vault) -> Iterator[tuple[Proxy,
                                                                           StreamingUpstream]]:
    tmp = tmp_path_factory.mktemp("sj")
    pki = make_pki(tmp / "pki", [HOST, WS_HOST])
    upstream = StreamingUpstream()
    server = AppThread(upstream.app(), pki.cert, pki.key, IP).start()
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "sj.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr,
                                        "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve={HOST}={IP}", f"--resolve={WS_HOST}={IP}")
    try:
        yield proxy, upstream
    finally:
        upstream.release.set()
        stop_proxy(proxy)
        server.stop()
        logs = proxy.logs() + proxy.audit_file.read_text()
        assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


def _sse_data(body: str) -> list[str]:
    out = []
    for event in body.replace("\r\n", "\n").split("\n\n"):
        data = [ln[5:].removeprefix(" ") for ln in event.split("\n") if ln.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def _join(path: str, body: str) -> str:
    """What the client assembles from the events, as each provider's SDK does."""
    if path == "/v1/messages":
        docs = [json.loads(d) for d in _sse_data(body)]
        return "".join(d["delta"]["text"] for d in docs if d["type"] == "content_block_delta")
    if path == "/v1/chat/completions":
        return "".join(json.loads(d)["choices"][0]["delta"]["content"]
                       for d in _sse_data(body) if d != "[DONE]")
    if path.endswith(":streamGenerateContent"):
        return "".join(c["candidates"][0]["content"]["parts"][0]["text"]
                       for c in json.loads(body))
    return "".join(json.loads(ln)["message"]["content"] for ln in body.splitlines() if ln)


@pytest.mark.parametrize("query", ["", "?whole=1"], ids=["streamed", "known-length"])
@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_key_split_across_events_is_redacted_in_the_joined_text(sj, path: str,
                                                                   query: str) -> None:
    proxy, upstream = sj
    r = curl(proxy, "agent", f"https://{HOST}{path}{query}", "-N", "-X", "POST",
             "-H", "x-api-key: sandgate-placeholder", "-d", "{}")
    body, status = split_status(r.stdout)
    assert status == 200, r.stderr[-500:]
    assert_secret_equal(upstream.keys[-1], ANTHROPIC_KEY, "the key the upstream got")
    joined = _join(path, body)
    assert_no_secret([joined, body, r.stderr], SECRET_VALUES, "what the client joined")
    assert joined == f"Here is the key you asked for: {ANTHROPIC_KEY[:5]}{MARKER}. Keep it safe."


ANTHROPIC_STREAM = f"""
import anthropic
client = anthropic.Anthropic(base_url="https://{HOST}")
with client.messages.stream(model="claude-test", max_tokens=64,
                            messages=[{{"role": "user", "content": "my key?"}}]) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
"""


def test_the_anthropic_sdk_streams_the_redacted_text(sj) -> None:
    need_sdk("anthropic")
    proxy, upstream = sj
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
    env.update({"HTTPS_PROXY": proxy.proxy_url("agent"), "NO_PROXY": "",
                "SSL_CERT_FILE": str(proxy.ca),
                "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    r = subprocess.run([str(CLIENT_PY), "-c", ANTHROPIC_STREAM], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_secret_equal(upstream.keys[-1], ANTHROPIC_KEY, "the key the upstream got")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK's output")
    assert MARKER in r.stdout


def test_an_event_with_no_candidate_is_not_held(sj) -> None:
    """The first event arrives while the upstream still waits for this test: nothing holds
    it until the next one (no timing assertion: the upstream waits up to 20 s)."""
    proxy, upstream = sj
    upstream.release.clear()
    cmd = ["curl", "-sS", "-N", "--max-time", "60", "--proxy", proxy.url, "--proxy-user",
           f"agent:{proxy.token('agent')}", "--cacert", str(proxy.ca),
           f"https://{HOST}/first-event"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        seen = b""
        while b"\n\n" not in seen:
            chunk = proc.stdout.read1(4096)
            if not chunk:
                break
            seen += chunk
        assert b"first words" in seen and not upstream.release.is_set()
    finally:
        upstream.release.set()
        proc.communicate(timeout=60)


def test_websocket_text_deltas_are_joined_and_redacted(sj) -> None:
    proxy, upstream = sj
    client = WsprotoClient(proxy, "agent", WS_HOST, "/realtime")
    try:
        client.send(ev.TextMessage(data="go"))
        got = client.receive(until=lambda e: isinstance(e, ev.TextMessage)
                             and "response.text.done" in e.data, timeout=20)
    finally:
        client.close()
    assert_secret_equal(upstream.keys[-1], ANTHROPIC_KEY, "the key the upstream got")
    docs: list[dict[str, Any]] = [json.loads(e.data) for e in got
                                  if isinstance(e, ev.TextMessage)]
    assert [d["type"] for d in docs][-1] == "response.text.done"  # in order, the end last
    joined = "".join(d["delta"] for d in docs if d["type"] == "response.text.delta")
    assert_no_secret([joined, *(json.dumps(d) for d in docs)], SECRET_VALUES, "WebSocket")
    assert joined == f"Here is the key you asked for: {ANTHROPIC_KEY[:5]}{MARKER}. Keep it safe."
