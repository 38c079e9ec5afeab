"""A real WebSocket server (aiohttp, TLS) that records every message and can leak its key.

`/ws`: on the text message "send-key" it answers "your key is <the x-api-key it was given>";
any other message is recorded and acknowledged with "ack <n>" (n = messages received so far),
so a client can tell which of its messages arrived without seeing their content.

`/ws-control`: control frames (no automatic pong). "ping-key", "pong-key" and "close-key" make
the server send a ping, an unsolicited pong or a close whose payload (reason) holds the key it
was given; every ping, pong and close the client sends is recorded in `control` (kind, payload)
and acknowledged with "got <kind>" (a close is not acknowledged: the session ends).
"""

from __future__ import annotations

from aiohttp import WSMsgType, web

from tests.support.upstream import AppThread


class WsServer:
    def __init__(self, host: str, port: int, cert: str, key: str) -> None:
        self.host, self.port = host, port
        self.received: list[str] = []
        self.upgrade_headers: list[dict[str, str]] = []
        self.control: list[tuple[str, bytes]] = []
        self._cert, self._key = cert, key
        self._server: AppThread | None = None

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        self.upgrade_headers.append({k.lower(): v for k, v in request.headers.items()})
        key = request.headers.get("x-api-key", "")
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            self.received.append(msg.data)
            if msg.data == "send-key":
                await ws.send_str(f"your key is {key}")
            else:
                await ws.send_str(f"ack {len(self.received)}")
        return ws

    async def _ws_control(self, request: web.Request) -> web.WebSocketResponse:
        self.upgrade_headers.append({k.lower(): v for k, v in request.headers.items()})
        key = request.headers.get("x-api-key", "").encode()
        ws = web.WebSocketResponse(autoping=False, autoclose=False)
        await ws.prepare(request)
        while True:  # not `async for`: it stops before a CLOSE message is seen
            msg = await ws.receive(timeout=15)
            if msg.type in (WSMsgType.CLOSED, WSMsgType.ERROR, WSMsgType.CLOSING):
                break
            if msg.type == WSMsgType.TEXT:
                if msg.data == "ping-key":
                    await ws.ping(b"k=" + key)
                elif msg.data == "pong-key":
                    await ws.pong(b"k=" + key)
                elif msg.data == "close-key":
                    await ws.close(code=4000, message=b"bye " + key)
                    break
            elif msg.type in (WSMsgType.PING, WSMsgType.PONG):
                kind = "ping" if msg.type == WSMsgType.PING else "pong"
                self.control.append((kind, bytes(msg.data)))
                await ws.send_str(f"got {kind}")
            elif msg.type == WSMsgType.CLOSE:
                self.control.append(("close", (msg.extra or "").encode()))
                await ws.close()
                break
        return ws

    def start(self) -> WsServer:
        app = web.Application()
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/ws-control", self._ws_control)
        self._server = AppThread(app, self._cert, self._key, self.host, self.port).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
