"""Passthrough tunnels are relayed lean once verified (sandgate/mitm/speedups/relay.py):
bytes arrive intact both ways over a kept-alive tunnel, and a tunnel whose SNI disagrees is never
relayed."""

from __future__ import annotations

import json
import socket
import ssl

from tests.integration.conftest import Proxy
from tests.support.tunnel import granted_tunnel, recv_until_closed


def _tunnel(proxy: Proxy, identity: str, connect_host: str) -> socket.socket:
    return granted_tunnel(proxy, identity, connect_host, timeout=15)


def _read_response(tls: ssl.SSLSocket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = tls.recv(65536)
        assert chunk, buf
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = tls.recv(1 << 20)
        assert chunk
        body += chunk
    assert len(body) == length
    return head, body


def test_passthrough_tunnel_relays_large_bodies_both_ways_on_one_connection(proxy, upstream,
                                                                            pki):
    s = _tunnel(proxy, "coding-agent", "tunnel.test")
    tls = ssl.create_default_context(cafile=str(pki.ca_cert)).wrap_socket(
        s, server_hostname="tunnel.test")  # the upstream's own certificate: not intercepted
    seen = len(upstream.seen)
    upload = bytes(range(256)) * (3 * 4096)  # 3 MiB, many chunks
    tls.sendall(b"POST /upload HTTP/1.1\r\nHost: tunnel.test\r\n"
                + f"Content-Length: {len(upload)}\r\n\r\n".encode() + upload)
    head, body = _read_response(tls)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["body_len"] == len(upload)
    assert upstream.seen[seen].body == upload  # byte for byte
    tls.sendall(b"GET /big?mb=5 HTTP/1.1\r\nHost: tunnel.test\r\n\r\n")
    head, body = _read_response(tls)
    assert head.startswith(b"HTTP/1.1 200") and body == b"x" * (5 * 1024 * 1024)
    tls.sendall(b"GET /again HTTP/1.1\r\nHost: tunnel.test\r\nConnection: close\r\n\r\n")
    head, body = _read_response(tls)
    assert json.loads(body)["path"] == "/again"
    tls.close()
    events = [e for e in proxy.audit() if e["event"] == "connect" and e["host"] == "tunnel.test"]
    assert events and events[-1]["decision"] == "allow" and events[-1]["rule"] == "tunnel"


def test_passthrough_tunnel_with_disagreeing_sni_is_intercepted_not_relayed(proxy, upstream):
    # CONNECT names the passthrough host, the ClientHello another: no lean relay, no tunnel;
    # Sandgate intercepts (its own certificate) and refuses the request inside.
    s = _tunnel(proxy, "coding-agent", "tunnel.test")
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    tls = ctx.wrap_socket(s, server_hostname="upstream.test")
    before = len(upstream.seen)
    tls.sendall(b"GET /docs/x HTTP/1.1\r\nHost: upstream.test\r\nConnection: close\r\n\r\n")
    out = recv_until_closed(tls)
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    assert b"disagrees" in out
    assert len(upstream.seen) == before
