"""Upstream connections are never shared across identities or sandboxes.

The TLS upstream records the client address of the connection each request came on (one
address per upstream connection). Within one client connection mitmproxy keeps its upstream
connection alive and reuses it for the next request to the same host; across client
connections an idle one is parked and the same caller's next client connection to the same
checked address and name reuses it (mitm/speedups/upstreampool.py). A client connection of another
identity, or of another sandbox of the same identity, never gets that upstream connection: a
desynchronised upstream connection must not hand one sandbox's response to another.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import pytest

from tests.integration.admin_support import (
    Admin,
    copy_policies,
    own_upstream_fixture,  # noqa: F401 - the fixture `own_upstream`
    start_admin_proxy,
    wait_for,
)
from tests.integration.conftest import curl, split_status, stop_proxy
from tests.support.rawupstream import H2TrailerServer
from tests.support.tunnel import open_tunnel, proxy_auth

_TOKENS: dict[tuple[int, str, str | None], str] = {}


def _token(proxy, identity: str, sandbox: str | None = None) -> str:
    """One token per proxy, identity and sandbox: issuing one runs a subprocess (a second or
    more on a loaded machine, which would age a parked connection between two steps)."""
    key = (proxy.port, identity, sandbox)
    if key not in _TOKENS:
        _TOKENS[key] = proxy.token(identity, sandbox=sandbox)
    return _TOKENS[key]


class Client:
    """One client connection through the proxy: CONNECT, TLS, keep-alive requests."""

    def __init__(self, proxy, identity: str, sandbox: str | None = None) -> None:
        token = _token(proxy, identity, sandbox)
        s, head = open_tunnel(proxy.host, proxy.port, "upstream.test:443",
                              proxy_auth(identity, token))
        assert b" 200 " in head.split(b"\r\n")[0], head[:200]
        ctx = ssl.create_default_context(cafile=str(proxy.ca))
        self.tls: ssl.SSLSocket = ctx.wrap_socket(s, server_hostname="upstream.test")
        self.buf = b""
        self.body = b""

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
        self.body, self.buf = self.buf[:length], self.buf[length:]
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


# ------------------------------------------------------------ reuse across client connections


@pytest.fixture(scope="module")
def pooled(tmp_path_factory, vault, pki, own_upstream) -> Iterator[Admin]:
    """A proxy whose parked connections wait 60 s (a loaded machine must not expire them
    between two steps of a test), with its metrics."""
    tmp = tmp_path_factory.mktemp("pooled")
    admin = start_admin_proxy(tmp, copy_policies(tmp), vault, pki,
                              "--upstream-reuse-idle", "60")
    yield admin
    stop_proxy(admin.proxy)


def _parked(admin: Admin) -> float:
    return admin.metrics().get(("sandgate_upstream_parked", ()), 0.0)


def _count(admin: Admin, event: str) -> float:
    return admin.metrics().get(("sandgate_upstream_reuse_total", (("event", event),)), 0.0)


def _one(admin: Admin, identity: str, sandbox: str | None, path: str,
         wait_parked: bool = True) -> tuple[int, bytes]:
    """One client connection: CONNECT, TLS, one request, close; then (by default) wait until
    the proxy has parked its upstream connection, so that the next one can take it."""
    before = _count(admin, "parked")
    c = Client(admin.proxy, identity, sandbox)
    try:
        status = c.get(path)
        body = c.body
    finally:
        c.close()
    if wait_parked:
        wait_for(lambda: _count(admin, "parked") > before, 10, "the upstream connection parked")
    return status, body


def _peer(upstream, path: str) -> object:
    return _peers(upstream, [path])[0]


def test_the_same_callers_next_client_connection_reuses_the_idle_upstream_connection(
        pooled, own_upstream) -> None:
    reused = _count(pooled, "reused")
    paths = [f"/docs/reuse-{i}" for i in range(4)]
    for p in paths:
        assert _one(pooled, "coding-agent", "sbx-reuse", p)[0] == 200
    peers = _peers(own_upstream, paths)
    assert len(set(peers)) == 1, peers  # four client connections, one upstream connection
    assert _count(pooled, "reused") - reused == 3


def test_a_parked_connection_is_never_handed_to_another_identity_or_sandbox(
        pooled, own_upstream) -> None:
    callers = [("coding-agent", "sbx-a", "a"), ("web-fetch", "sbx-a", "b"),
               ("coding-agent", "sbx-b", "c"), ("coding-agent", None, "d"),
               ("web-fetch", None, "e")]
    for round_ in range(2):  # each caller leaves a parked connection the next one could take
        for identity, sandbox, tag in callers:
            assert _one(pooled, identity, sandbox, f"/docs/iso-{tag}-{round_}")[0] == 200
    first = [_peer(own_upstream, f"/docs/iso-{tag}-0") for _, _, tag in callers]
    second = [_peer(own_upstream, f"/docs/iso-{tag}-1") for _, _, tag in callers]
    assert None not in first
    assert len(set(first)) == len(callers), first  # nobody took another caller's connection
    assert second == first  # and each caller got its own back


def test_a_desynchronised_upstream_connection_is_not_reused(pooled, own_upstream) -> None:
    # the extra response comes right after the answer: that connection is never taken again
    status, body = _one(pooled, "coding-agent", "sbx-desync", "/desync/now", wait_parked=False)
    assert (status, body) == (200, b"asked")
    status, body = _one(pooled, "coding-agent", "sbx-desync", "/docs/after-now",
                        wait_parked=False)
    assert status == 200 and b"smuggled" not in body and b"after-now" in body
    assert _peer(own_upstream, "/docs/after-now") != _peer(own_upstream, "/desync/now")

    # the extra response comes while the connection is parked: it is closed, not taken
    assert _one(pooled, "coding-agent", "sbx-late", "/docs/before-late")[0] == 200
    expired = _count(pooled, "expired")
    status, body = _one(pooled, "coding-agent", "sbx-late", "/desync/late?delay=0.5")
    assert (status, body) == (200, b"asked")
    assert _peer(own_upstream, "/desync/late") == _peer(own_upstream, "/docs/before-late")
    # the pool's sweep finds the bytes nobody asked for and closes the connection
    wait_for(lambda: _count(pooled, "expired") > expired, 10, "the desynchronised one closed")
    status, body = _one(pooled, "coding-agent", "sbx-late", "/docs/after-late")
    assert status == 200 and b"smuggled" not in body and b"after-late" in body
    assert _peer(own_upstream, "/docs/after-late") != _peer(own_upstream, "/desync/late")


def test_no_reuse_when_turned_off(tmp_path, vault, pki, own_upstream) -> None:
    admin = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki,
                              "--upstream-reuse-idle", "0")
    try:
        paths = [f"/docs/off-{i}" for i in range(3)]
        for p in paths:
            assert _one(admin, "coding-agent", "sbx-off", p, wait_parked=False)[0] == 200
        peers = _peers(own_upstream, paths)
        assert len(set(peers)) == 3, peers
        assert _parked(admin) == 0 and _count(admin, "parked") == 0
    finally:
        stop_proxy(admin.proxy)


H2_POLICY = """\
version: v1
identities:
  h2-agent:
    rules:
      - {name: h2, hosts: [h2.upstream.test], ports: [8443], methods: [GET],
         private_cidrs: [127.0.71.2/32]}
  h2-other:
    rules:
      - {name: h2, hosts: [h2.upstream.test], ports: [8443], methods: [GET],
         private_cidrs: [127.0.71.2/32]}
"""


def test_curl_over_http2_reuses_the_upstream_session_of_its_own_caller_only(
        tmp_path, vault, pki) -> None:
    """curl negotiates HTTP/2 with the proxy and the upstream: the session is parked with its
    connection and the same caller's next curl process continues it; another caller's never."""
    server = H2TrailerServer("127.0.71.2", 8443, str(pki.cert), str(pki.key)).start()
    admin = start_admin_proxy(tmp_path, copy_policies(tmp_path, H2_POLICY), vault, pki,
                              "--upstream-reuse-idle", "60",
                              "--resolve=h2.upstream.test=127.0.71.2")
    try:
        def run(identity: str) -> None:
            before = _count(admin, "parked")
            r = curl(admin.proxy, identity, "https://h2.upstream.test:8443/x", "--http2",
                     token=_token(admin.proxy, identity))
            body, status = split_status(r.stdout)
            assert status == 200 and "hello over h2" in body, (status, body, r.stderr[-500:])
            wait_for(lambda: _count(admin, "parked") > before, 10, "the h2 session parked")

        for identity in ("h2-agent", "h2-agent", "h2-other", "h2-agent", "h2-other"):
            run(identity)
        agent = [server.peers[i] for i in (0, 1, 3)]
        other = [server.peers[i] for i in (2, 4)]
        assert len(set(agent)) == 1 and len(set(other)) == 1, server.peers
        assert agent[0] != other[0]
        assert _count(admin, "reused") == 3
    finally:
        stop_proxy(admin.proxy)
        server.stop()
