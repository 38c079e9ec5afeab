"""A real JSON-RPC 2.0 server over WebSocket (aiohttp, TLS), on any path, that records every
message it receives and answers like a small blockchain node and MCP server at once.

Each text message is one JSON-RPC message or a batch. Requests are answered (a batch with an
array): `eth_*` methods with a fixed hex result (`eth_sendRawTransaction`: a transaction hash,
so a test can tell it was executed), `tools/list` with six tools, `tools/call` with the tool's
name (`get_me` also reflects the x-api-key the upgrade carried, to be scrubbed), `initialize`
with a server info, `eth_subscribe` with a subscription id and then a notification; anything
else with a JSON-RPC "method not found" error. Notifications and responses are only recorded.
`methods` lists every method received, in order; `frames` every message (text or bytes).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import WSMsgType, web

from tests.support.upstream import AppThread

TOOLS = ["create_issue", "delete_repo", "get_issue", "get_me", "list_issues", "search_code"]


class WsRpcServer:
    def __init__(self, host: str, port: int, cert: str, key: str) -> None:
        self.host, self.port = host, port
        self.upgrades: list[tuple[str, dict[str, str]]] = []  # (path, lower-cased headers)
        self.frames: list[str | bytes] = []
        self.methods: list[str] = []
        self._cert, self._key = cert, key
        self._server: AppThread | None = None

    def _answer(self, msg: Any, key: str) -> dict[str, Any] | None:
        if not isinstance(msg, dict) or not isinstance(msg.get("method"), str):
            return None
        method = msg["method"]
        self.methods.append(method)
        if "id" not in msg:
            return None
        result: Any
        if method == "eth_sendRawTransaction":
            result = "0x" + "ab" * 32
        elif method == "eth_subscribe":
            result = "0x1"
        elif method.startswith("eth_"):
            result = "0x10"
        elif method == "initialize":
            result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                      "serverInfo": {"name": "wsrpc-test", "version": "1"}}
        elif method == "tools/list":
            result = {"tools": [{"name": t, "inputSchema": {"type": "object"}} for t in TOOLS]}
        elif method == "tools/call":
            name = (msg.get("params") or {}).get("name")
            text = f"ran {name}" + (f"; you are key={key}" if name == "get_me" else "")
            result = {"content": [{"type": "text", "text": text}]}
        else:
            return {"jsonrpc": "2.0", "id": msg["id"],
                    "error": {"code": -32601, "message": "method not found"}}
        return {"jsonrpc": "2.0", "id": msg["id"], "result": result}

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.upgrades.append((request.path, headers))
        key = headers.get("x-api-key", "")
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        async for frame in ws:
            if frame.type == WSMsgType.BINARY:
                self.frames.append(bytes(frame.data))
                continue
            if frame.type != WSMsgType.TEXT:
                continue
            self.frames.append(frame.data)
            try:
                doc = json.loads(frame.data)
            except ValueError:
                continue
            answers = [a for a in (self._answer(m, key) for m in
                                   (doc if isinstance(doc, list) else [doc])) if a is not None]
            if answers:
                await ws.send_str(json.dumps(answers if isinstance(doc, list) else answers[0]))
            if not isinstance(doc, list) and doc.get("method") == "eth_subscribe":
                await ws.send_str(json.dumps({"jsonrpc": "2.0", "method": "eth_subscription",
                                              "params": {"subscription": "0x1",
                                                         "result": "0x11"}}))
        return ws

    def start(self) -> WsRpcServer:
        app = web.Application()
        app.router.add_get("/{path:.*}", self._ws)
        self._server = AppThread(app, self._cert, self._key, self.host, self.port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
