"""A WebSocket client built on wsproto (a real protocol library) through a Sandgate tunnel.

It sends exactly the frames a test asks for (a ping with a payload, a close with a reason) and
returns every event that came back, control frames included. Every read has a deadline.
"""

from __future__ import annotations

import ssl
import time
from typing import Any

import wsproto
import wsproto.events as ev

from tests.support.tunnel import granted_tunnel, tls_wrap


class WsprotoClient:
    def __init__(self, proxy: Any, identity: str, host: str, path: str,
                 headers: dict[str, str] | None = None, timeout: float = 10) -> None:
        raw = granted_tunnel(proxy, identity, host, 443, timeout)
        self.sock: ssl.SSLSocket = tls_wrap(raw, str(proxy.ca), host, ["http/1.1"])
        self.ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self.sock.sendall(self.ws.send(ev.Request(host=host, target=path,
                                                  extra_headers=extra)))
        self.closed = False
        got = self.receive(until=lambda e: isinstance(e, ev.AcceptConnection | ev.RejectConnection),
                           timeout=timeout)
        if not got or not isinstance(got[-1], ev.AcceptConnection):
            raise AssertionError(f"the WebSocket handshake was not accepted: {got!r:.300}")

    def send(self, event: ev.Event) -> None:
        self.sock.sendall(self.ws.send(event))

    def receive(self, until: Any = None, timeout: float = 5) -> list[ev.Event]:
        """Events until `until(event)` holds, the connection ends, or `timeout` seconds."""
        out: list[ev.Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.closed:
            for e in self.ws.events():
                out.append(e)
                if isinstance(e, ev.CloseConnection):
                    self.closed = True
                if until is not None and until(e):
                    return out
            self.sock.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except (ssl.SSLError, OSError):
                data = b""
            if not data:
                self.ws.receive_data(None)
                for e in self.ws.events():
                    out.append(e)
                self.closed = True
                break
            self.ws.receive_data(data)
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
