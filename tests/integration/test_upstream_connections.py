"""Upstream connections are never shared across identities or sandboxes.

The TLS upstream records the client address of the connection each request came on (one
address per upstream connection). Within one client connection mitmproxy keeps its upstream
connection alive and reuses it for the next request to the same host; a client connection of
another identity, or of another sandbox of the same identity, never gets that upstream
connection: a desynchronised upstream connection must not hand one sandbox's response to
another. (Across client connections nothing is pooled at all today: docs/performance.md.)
"""

from __future__ import annotations

import ssl

from tests.support.tunnel import open_tunnel, proxy_auth


class Client:
    """One client connection through the proxy: CONNECT, TLS, keep-alive requests."""

    def __init__(self, proxy, identity: str, sandbox: str | None = None) -> None:
        token = proxy.token(identity, sandbox=sandbox)
        s, head = open_tunnel(proxy.host, proxy.port, "upstream.test:443",
                              proxy_auth(identity, token))
        assert b" 200 " in head.split(b"\r\n")[0], head[:200]
        ctx = ssl.create_default_context(cafile=str(proxy.ca))
        self.tls: ssl.SSLSocket = ctx.wrap_socket(s, server_hostname="upstream.test")
        self.buf = b""

    def get(self, path: str) -> int:
        self.tls.sendall(f"GET {path} HTTP/1.1\r\nHost: upstream.test\r\n\r\n".encode())
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(self.buf) < length:
            self.buf += self._recv()
        self.buf = self.buf[length:]
        return int(head.split(b" ", 2)[1])

    def _recv(self) -> bytes:
        d = self.tls.recv(65536)
        if not d:
            raise ConnectionError("closed")
        return d

    def close(self) -> None:
        try:
            self.tls.close()
        except OSError:
            pass


def _peers(upstream, paths: list[str]) -> list[object]:
    by_path = {s.path: s.peer for s in upstream.seen if s.path in paths}
    assert set(by_path) == set(paths), (sorted(by_path), paths)
    return [by_path[p] for p in paths]


def test_an_upstream_connection_is_never_shared_across_identities_or_sandboxes(
        proxy, upstream) -> None:
    clients = [("coding-agent", None, "a"), ("web-fetch", None, "b"),
               ("coding-agent", "sbx-one", "c"), ("coding-agent", "sbx-two", "d")]
    opened = []
    try:
        for identity, sandbox, tag in clients:  # all open at once: each keeps its upstream
            c = Client(proxy, identity, sandbox)
            opened.append(c)
            for i in range(3):
                assert c.get(f"/docs/conn-{tag}-{i}") == 200
        # a second round on the same client connections, interleaved
        for c, (_, _, tag) in zip(opened, clients, strict=True):
            assert c.get(f"/docs/conn-{tag}-again") == 200
    finally:
        for c in opened:
            c.close()
    per_client = []
    for _, _, tag in clients:
        peers = _peers(upstream, [f"/docs/conn-{tag}-{i}" for i in range(3)]
                       + [f"/docs/conn-{tag}-again"])
        assert None not in peers
        # within one client connection the upstream connection is kept and reused
        assert len(set(peers)) == 1, peers
        per_client.append(peers[0])
    # never across identities, nor across sandboxes of one identity
    assert len(set(per_client)) == len(clients), per_client
