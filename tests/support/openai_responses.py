"""A stand-in for the OpenAI Responses API, served on its real host name by the tests, over both
of its transports: `POST /v1/responses` (server-sent events) and its WebSocket (`GET
/v1/responses` with an upgrade; one `{"type": "response.create", ...}` message per call, the
events of the response back, one text message each). It scripts one shell tool call and then a
final answer, as Codex sees them: a request that offers the `exec_command` function (and carries
no call output) gets a `function_call` of it with `{"cmd": command}`; the request that carries
its `function_call_output` gets a message with `final` and that output, streamed as
`response.output_text.delta` events (with `leak`, the key received is in it, cut between two
deltas: the join the scrubber must stop). Anything else is a JSON 404 in the API's error shape
(Codex then falls back, e.g. from its WebSocket transport). Every request and message is
recorded (the key only as the test compares it: never printed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from tests.support.anthropic_api import Call


def _event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def call_outputs(body: Any) -> list[str]:
    """The outputs of function calls in a Responses request's input."""
    items = body.get("input") if isinstance(body, dict) else None
    return [str(i.get("output")) for i in items or []
            if isinstance(i, dict) and i.get("type") == "function_call_output"]


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None


@dataclass
class StandInResponses:
    command: str
    tool: str = "exec_command"
    final: str = "Done."
    calls: list[Call] = field(default_factory=list)
    results: list[str] = field(default_factory=list)  # the call outputs the CLI sent back
    leak: bool = False  # the final answer carries the key received, cut between two deltas
    upgrades: list[Call] = field(default_factory=list)  # WebSocket handshakes (GET)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/v1/responses", self.responses)
        app.router.add_route("GET", "/v1/responses", self.websocket)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        self.calls.append(Call(request.method, request.path, request.query_string,
                               {k.lower(): v for k, v in request.headers.items()}, body))
        return body

    def events(self, body: Any, key: str | None = None) -> list[dict[str, Any]]:
        """The events of one response to `body`, as both transports send them. The final
        answer's text comes as `response.output_text.delta` events; with `leak`, the key the
        stand-in received (`key`) is in that text, cut between two deltas."""
        n = len(self.calls)
        outputs = call_outputs(body)
        tools = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        item: dict[str, Any]
        deltas: list[str] = []
        if outputs:
            self.results.extend(outputs)
            deltas = [f"{self.final} The tool said: {outputs[-1]}"]
            if self.leak and key:
                half = len(key) // 2
                deltas = [f"{deltas[0]} Key: {key[:half]}", f"{key[half:]} (end)"]
            item = {"type": "message", "id": f"msg_{n}", "role": "assistant",
                    "status": "completed", "content": [{
                        "type": "output_text", "annotations": [], "text": "".join(deltas)}]}
        elif self.tool in tools:
            item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                    "name": self.tool, "status": "completed",
                    "arguments": json.dumps({"cmd": self.command})}
        else:
            deltas = ["ok"]
            item = {"type": "message", "id": f"msg_{n}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "annotations": [], "text": "ok"}]}
        response = {"id": f"resp_{n}", "object": "response", "status": "in_progress",
                    "model": str(body.get("model", "stand-in")), "output": []}
        usage = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 17}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": response},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {**item, "status": "in_progress", **(
                 {"content": []} if item["type"] == "message" else {})}},
        ]
        events += [{"type": "response.output_text.delta", "item_id": item["id"],
                    "output_index": 0, "content_index": 0, "delta": d} for d in deltas]
        events += [
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": {
                **response, "status": "completed", "output": [item], "usage": usage}},
        ]
        return events

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        events = self.events(body, _bearer(request))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(_event(ev))
        await resp.write_eof()
        return resp

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        """The Responses API's WebSocket transport: each text message `{"type":
        "response.create", ...}` (the body a POST would send, plus its type) is answered with
        the events of one response, one text message each; `response.processed`
        acknowledgements are recorded and not answered."""
        if request.headers.get("upgrade", "").lower() != "websocket":
            return await self.other(request)
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.upgrades.append(Call(request.method, request.path, request.query_string,
                                  headers, None))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            try:
                body = json.loads(msg.data)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                await ws.close(code=1003)
                break
            self.calls.append(Call("WEBSOCKET", request.path, request.query_string,
                                   headers, body))
            if body.get("type") != "response.create":
                continue
            for ev in self.events(body, _bearer(request)):
                await ws.send_str(json.dumps(ev))
        return ws

    async def other(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        return web.json_response({"error": {"type": "invalid_request_error", "message":
                                            f"the stand-in serves no {request.method} "
                                            f"{request.path}"}}, status=404)
