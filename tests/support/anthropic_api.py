"""A stand-in for the Anthropic Messages API, served on its real host name by the tests: it
streams like the real one (server-sent events, one event per write) and puts the API key it
received into the answer, cut between text deltas: an upstream that echoes the injected key is
the attack the scrubber must stop, here with the key joined only by the client.

`POST /v1/messages` with `"stream": true` answers `message_start`, `content_block_start`, a
`ping`, one `content_block_delta` (`text_delta`) per piece that `answer(key)` returns,
`content_block_stop`, `message_delta` (stop reason and usage) and `message_stop`; without
`stream` the same text as one JSON message. Anything else is a JSON 404 in the API's error
shape. Every request is recorded (the key only as the test compares it: never printed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from aiohttp import web


@dataclass
class Call:
    method: str
    path: str
    query: str
    # Not in the repr: pytest shows a failing test's arguments, and these hold the key.
    headers: dict[str, str] = field(repr=False)
    body: Any = field(repr=False)  # the JSON body, or None


def split_copies(key: str, cuts: Sequence[Sequence[int]]) -> list[str]:
    """Text deltas whose join holds one copy of `key` per entry of `cuts`, labelled `copy N:`,
    each cut by delta boundaries at that entry's positions: `(k,)` ends one delta with
    `key[:k]` and begins the next with `key[k:]` (0 and len(key) leave the key whole in one
    delta, as does `()`); `range(1, len(key))` streams it a character per delta."""
    deltas: list[str] = []
    pending = "Here are the copies.\n"
    for i, ks in enumerate(cuts):
        bounds = [0, *sorted(set(ks)), len(key)]
        pieces = [key[a:b] for a, b in pairwise(bounds)] + ([""] if not ks else [])
        deltas.append(f"{pending}copy {i}: {pieces[0]}")
        deltas.extend(pieces[1:-1])
        pending = f"{pieces[-1]}\n"
    deltas.append(f"{pending}That is all.")
    return deltas


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


@dataclass
class StandInMessages:
    answer: Callable[[str], Sequence[str]]  # the x-api-key received -> the text deltas
    calls: list[Call] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/v1/messages", self.messages)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app

    async def _record(self, request: web.Request) -> Call:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        call = Call(request.method, request.path, request.query_string,
                    {k.lower(): v for k, v in request.headers.items()}, body)
        self.calls.append(call)
        return call

    async def messages(self, request: web.Request) -> web.StreamResponse:
        call = await self._record(request)
        body = call.body if isinstance(call.body, dict) else {}
        model = str(body.get("model", "claude-stand-in"))
        deltas = list(self.answer(call.headers.get("x-api-key", "")))
        message = {"id": f"msg_standin_{len(self.calls)}", "type": "message",
                   "role": "assistant", "model": model}
        usage = {"input_tokens": 12, "output_tokens": len(deltas)}
        if not body.get("stream"):
            return web.json_response({
                **message, "content": [{"type": "text", "text": "".join(deltas)}],
                "stop_reason": "end_turn", "stop_sequence": None, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events = [
            _event("message_start", {"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 12, "output_tokens": 1}}}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
            _event("ping", {"type": "ping"}),
            *(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": d}})
              for d in deltas),
            _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _event("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                     "usage": {"output_tokens": len(deltas)}}),
            _event("message_stop", {"type": "message_stop"}),
        ]
        for ev in events:
            # One write per event, a little apart, as the real API streams: the deltas reach
            # Sandgate in separate reads, so no single chunk holds a whole copy of the key.
            await resp.write(ev)
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    async def other(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return web.json_response({"type": "error", "error": {
            "type": "not_found_error", "message": f"the stand-in serves no {request.path}"}},
            status=404)


def tool_results(body: Any) -> list[str]:
    """The text of the tool results in a Messages request's last message (none: [])."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return []
    content = messages[-1].get("content")
    out = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            inner = block.get("content")
            if isinstance(inner, list):
                inner = "".join(b.get("text", "") for b in inner if isinstance(b, dict))
            out.append(str(inner))
    return out


@dataclass
class StandInToolTurn:
    """A Messages API that scripts one shell tool call, then a final answer: a request that
    offers the `tool` tool (and carries no tool result) gets a streamed `tool_use` of it with
    `{"command": command}`; the request that carries its result gets `final` and the result
    text; any other request (a CLI's side calls: titles, quota checks) a short text."""

    tool: str | tuple[str, ...]  # the shell tool's name (the first a request offers)
    command: str
    final: str = "Done."
    calls: list[Call] = field(default_factory=list)
    results: list[str] = field(default_factory=list)  # the tool results the CLI sent back

    @property
    def _names(self) -> tuple[str, ...]:
        return (self.tool,) if isinstance(self.tool, str) else self.tool

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/v1/messages", self.messages)
        app.router.add_route("*", "/{tail:.*}", StandInMessages(lambda _: []).other)
        return app

    async def messages(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        self.calls.append(Call(request.method, request.path, request.query_string,
                               {k.lower(): v for k, v in request.headers.items()}, body))
        results = tool_results(body)
        tools = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        message = {"id": f"msg_standin_{len(self.calls)}", "type": "message",
                   "role": "assistant", "model": str(body.get("model", "claude-stand-in")),
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 12, "output_tokens": 1}}
        if results:
            self.results.extend(results)
            block: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": f"{self.final} The tool said: {results[0]}"}
            stop = "end_turn"
        elif offered := [t for t in tools if t in self._names]:
            block = {"type": "tool_use", "id": f"toolu_standin_{len(self.calls)}",
                     "name": offered[0], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(
                {"command": self.command, "description": "Call the model API"})}
            stop = "tool_use"
        else:
            block, delta, stop = {"type": "text", "text": ""}, {"type": "text_delta",
                                                                  "text": "ok"}, "end_turn"
        if not body.get("stream"):
            return web.json_response({**message, "content": [{"type": "text", "text": "ok"}],
                                      "stop_reason": "end_turn"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in (
            _event("message_start", {"type": "message_start", "message": message}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": block}),
            _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": delta}),
            _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 5}}),
            _event("message_stop", {"type": "message_stop"}),
        ):
            await resp.write(ev)
        await resp.write_eof()
        return resp
