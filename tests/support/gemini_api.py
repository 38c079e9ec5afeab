"""A stand-in for the Gemini API (`POST /v1beta/models/MODEL:generateContent` and
`:streamGenerateContent?alt=sse`), served on its real host name by the tests, that scripts one
shell tool call and then a final answer, as Gemini CLI sees them: a request that offers the
`run_shell_command` function (and carries no function response) gets a `functionCall` of it
with `{"command": command}`; the request that carries its `functionResponse` gets `final` and
that response. Any other request (the CLI's side calls) gets a short text, or `{}` as JSON when
it asks for JSON. Every request is recorded (the key only as the test compares it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.anthropic_api import Call


def function_responses(body: Any) -> list[str]:
    """The function responses in the last content of a generateContent request."""
    contents = body.get("contents") if isinstance(body, dict) else None
    if not isinstance(contents, list) or not contents or not isinstance(contents[-1], dict):
        return []
    return [json.dumps(p["functionResponse"].get("response"))
            for p in contents[-1].get("parts") or []
            if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict)]


def offered(body: Any) -> list[str]:
    names = []
    for tool in body.get("tools") or [] if isinstance(body, dict) else []:
        for decl in tool.get("functionDeclarations") or [] if isinstance(tool, dict) else []:
            if isinstance(decl, dict):
                names.append(str(decl.get("name")))
    return names


@dataclass
class StandInGemini:
    command: str
    tool: str = "run_shell_command"
    final: str = "Done."
    calls: list[Call] = field(default_factory=list)
    results: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("POST", "/v1beta/models/{model}", self.generate)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        self.calls.append(Call(request.method, request.path, request.query_string,
                               {k.lower(): v for k, v in request.headers.items()}, body))
        responses = function_responses(body)
        part: dict[str, Any]
        if responses:
            self.results.extend(responses)
            part = {"text": f"{self.final} The tool said: {responses[-1]}"}
        elif self.tool in offered(body):
            part = {"functionCall": {"name": self.tool, "args": {"command": self.command}}}
        elif (body.get("generationConfig") or {}).get("responseMimeType") == "application/json":
            part = {"text": "{}"}
        else:
            part = {"text": "ok"}
        chunk = {"candidates": [{"content": {"role": "model", "parts": [part]},
                                 "finishReason": "STOP", "index": 0}],
                 "usageMetadata": {"promptTokenCount": 12, "candidatesTokenCount": 5,
                                   "totalTokenCount": 17},
                 "modelVersion": request.match_info["model"].split(":")[0]}
        if not request.path.endswith(":streamGenerateContent"):
            return web.json_response(chunk)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps(chunk)}\r\n\r\n".encode())
        await resp.write_eof()
        return resp

    async def other(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls.append(Call(request.method, request.path, request.query_string,
                               {k.lower(): v for k, v in request.headers.items()}, None))
        return web.json_response({"error": {"code": 404, "status": "NOT_FOUND", "message":
                                            f"the stand-in serves no {request.path}"}},
                                 status=404)
