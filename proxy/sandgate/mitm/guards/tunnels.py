"""One tunnel record per CONNECT stream, not per client connection.

Over HTTP/1 a client connection carries at most one CONNECT, but over HTTP/2 to the proxy port
(TLS with ALPN h2) every stream may be a CONNECT of its own, each with its caller, target,
passthrough flag and deferred refusal. A record per connection let the last CONNECT overwrite
the others, so a stream's requests were held to another stream's tunnel.

The key is the upstream `Server` object of the CONNECT's stream: every layer inside the tunnel
(the TLS layers, the inner HTTP layer and its flows, the raw TCP relay, the dial) shares that
object, so each hook finds its own stream's tunnel from what it is given. mitmproxy 11.0.2 gave
all streams of one connection the same Server object, and its CONNECT handling sets that
object's address: `install` gives each CONNECT stream a fresh one first (so two streams also
no longer overwrite each other's target address). SOCKS5 has one tunnel per connection (key
None): its CONNECT is judged on a flow built for it (mitm/guards/socks5.py).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from mitmproxy import connection
from mitmproxy.proxy.layers import http as http_layer

from sandgate.mitm.guards.socks5 import is_socks5
from sandgate.stages.flow import Conn, Tunnel

_MARK = "_sandgate_tunnels"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


# Tunnels kept per client connection (HTTP/2 may open many streams over its life); past it the
# oldest record is forgotten, and a request in that tunnel is refused (no tunnel, no identity).
MAX_TUNNELS = 1024


def key(client: connection.Client, server: connection.Server | None) -> str | None:
    if is_socks5(client) or server is None:
        return None
    return server.id


def get(conn: Conn, client: connection.Client,
        server: connection.Server | None) -> Tunnel | None:
    """The tunnel the layer on `server` of this client connection is inside, if any."""
    return conn.tunnels.get(key(client, server))


def put(conn: Conn, client: connection.Client, server: connection.Server | None,
        tunnel: Tunnel) -> None:
    k = key(client, server)
    conn.tunnels.pop(k, None)
    conn.tunnels[k] = tunnel
    while len(conn.tunnels) > MAX_TUNNELS:
        del conn.tunnels[next(iter(conn.tunnels))]


def _wrap_handle_connect(original: Any) -> Any:
    def handle_connect(self: Any) -> Generator[Any, Any, None]:
        shared = self.context.server
        own = connection.Server(address=None, transport_protocol=shared.transport_protocol)
        own.via = shared.via
        self.context.server = self.flow.server_conn = own
        yield from original(self)

    return handle_connect


def install() -> None:
    stream = http_layer.HttpStream
    if getattr(stream, _MARK, False):
        return
    stream.handle_connect = _wrap_handle_connect(stream.handle_connect)  # type: ignore[method-assign]
    setattr(stream, _MARK, True)


def installed() -> bool:
    return bool(getattr(http_layer.HttpStream, _MARK, False))
