"""Stand-ins for the Anthropic, OpenAI and Gemini APIs (aiohttp, TLS on loopback) that answer as
the real ones do, streaming and not, with real usage fields: `INPUT` input tokens (CACHED of them
from the cache), and `min(OUTPUT, the call's output cap)` output tokens (REASONING of them
thinking, where the API reports it)."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

INPUT, CACHED, OUTPUT, REASONING = 12, 4, 10, 3


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class LlmApis:
    calls: list[Call] = field(default_factory=list)
    delay: float = 0.0  # seconds each answer waits (concurrent calls overlap)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.anthropic)
        app.router.add_post("/v1/chat/completions", self.openai)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1beta/models/{call}", self.gemini)
        return app

    async def _read(self, request: web.Request) -> dict[str, Any]:
        body = await request.json()
        self.calls.append(Call(request.path, {k.lower(): v for k, v in request.headers.items()},
                               body))
        if self.delay:
            await asyncio.sleep(self.delay)
        return body

    @staticmethod
    async def _sse(request: web.Request, events: list[tuple[str | None, Any]]
                   ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, data in events:
            head = f"event: {name}\n" if name else ""
            text = data if isinstance(data, str) else json.dumps(data)
            await resp.write(f"{head}data: {text}\n\n".encode())
        await resp.write_eof()
        return resp

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        out = min(OUTPUT, int(body.get("max_tokens", OUTPUT)))
        usage = {"input_tokens": INPUT - CACHED, "cache_read_input_tokens": CACHED,
                 "cache_creation_input_tokens": 0}
        msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
               "stop_reason": None, "stop_sequence": None}
        if not body.get("stream"):
            return web.json_response({**msg, "stop_reason": "end_turn", "content": [
                {"type": "text", "text": "hello from the stand-in"}],
                "usage": {**usage, "output_tokens": out}})
        return await self._sse(request, [
            ("message_start", {"type": "message_start", "message": {
                **msg, "content": [], "usage": {**usage, "output_tokens": 1}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "hello "}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "streamed"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": out}}),
            ("message_stop", {"type": "message_stop"}),
        ])

    async def openai(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        cap = body.get("max_completion_tokens", body.get("max_tokens", OUTPUT))
        out = min(OUTPUT, int(cap))
        usage = {"prompt_tokens": INPUT, "completion_tokens": out,
                 "total_tokens": INPUT + out,
                 "prompt_tokens_details": {"cached_tokens": CACHED},
                 "completion_tokens_details": {"reasoning_tokens": REASONING}}
        base = {"id": "chatcmpl-1", "created": 0, "model": body["model"]}
        if not body.get("stream"):
            return web.json_response({**base, "object": "chat.completion", "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hello from the stand-in"}}],
                "usage": usage})
        with_usage = (body.get("stream_options") or {}).get("include_usage") is True
        extra = {"usage": None} if with_usage else {}
        chunk = {**base, "object": "chat.completion.chunk"}
        events: list[tuple[str | None, Any]] = [
            (None, {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": "hello "}}],
                    **extra}),
            (None, {**chunk, "choices": [{"index": 0, "delta": {"content": "streamed"},
                                          "finish_reason": "stop"}], **extra}),
        ]
        if with_usage:
            events.append((None, {**chunk, "choices": [], "usage": usage}))
        events.append((None, "[DONE]"))
        return await self._sse(request, events)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        out = min(OUTPUT, int(body.get("max_output_tokens", OUTPUT)))
        usage = {"input_tokens": INPUT, "output_tokens": out, "total_tokens": INPUT + out,
                 "input_tokens_details": {"cached_tokens": CACHED},
                 "output_tokens_details": {"reasoning_tokens": REASONING}}
        text = {"type": "output_text", "text": "hello from the stand-in", "annotations": []}
        item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [text]}
        resp = {"id": "resp_1", "object": "response", "created_at": 0, "model": body["model"],
                "status": "completed", "output": [item], "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "usage": usage}
        if not body.get("stream"):
            return web.json_response(resp)
        started = {**resp, "status": "in_progress", "output": [], "usage": None}
        return await self._sse(request, [
            ("response.created", {"type": "response.created", "sequence_number": 0,
                                  "response": started}),
            ("response.output_text.delta", {
                "type": "response.output_text.delta", "sequence_number": 1,
                "item_id": "msg_1", "output_index": 0, "content_index": 0,
                "delta": "hello from the stand-in", "logprobs": []}),
            ("response.completed", {"type": "response.completed", "sequence_number": 2,
                                    "response": resp}),
        ])

    async def gemini(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        model, _, method = request.match_info["call"].partition(":")
        cap = (body.get("generationConfig") or {}).get("maxOutputTokens", OUTPUT)
        out = min(OUTPUT, int(cap))
        doc = {"candidates": [{"content": {"role": "model", "parts": [{"text": "hello"}]},
                               "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": INPUT, "candidatesTokenCount": out,
                                 "cachedContentTokenCount": CACHED,
                                 "totalTokenCount": INPUT + out},
               "modelVersion": model}
        if method == "generateContent":
            return web.json_response(doc)
        return await self._sse(request, [(None, doc)])


class LlmServer:
    """The stand-ins on their own event loop thread, with TLS."""

    def __init__(self, host: str, port: int, cert: str, key: str) -> None:
        self.host, self.port = host, port
        self.apis = LlmApis()
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.load_cert_chain(cert, key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> LlmServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.apis.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ctx).start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
