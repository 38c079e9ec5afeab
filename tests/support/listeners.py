"""The ways into Sandgate, for tests that must hold on every one of them.

A `Listener` is one way in of a running `sandgate run` (its `Proxy`): "http" (the proxy port,
HTTP CONNECT and absolute-form requests) or "socks5" (`--socks5`, curl's `--socks5-hostname`,
so names are resolved by Sandgate). Both carry the identity and the proxy token the same way
(`--proxy-user IDENTITY:TOKEN`). `open_tunnel` opens an authenticated tunnel by hand through
either, for tests that speak TLS or raw bytes inside.

`dual_proxy_running` is one `sandgate run` serving both, with `--socks5-allow 127.0.0.1/32`
(the source address loopback clients get by default); SOCKS5 listens in 127.0.15.0/24 (this
suite's loopback range). A test module makes it a fixture and picks listeners with
`make_listener`.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.integration.conftest import HERE, Proxy, free_port, start_proxy, stop_proxy
from tests.support.secrets import assert_no_secret
from tests.support.tunnel import granted_tunnel

SOCKS5_HOST = "127.0.15.1"
SOCKS5_ALLOWED_SOURCE = "127.0.0.1"
SOCKS5_OUTSIDE_SOURCE = "127.0.15.9"  # a loopback address outside --socks5-allow


@dataclass(frozen=True)
class Listener:
    kind: str  # "http" or "socks5"
    host: str
    port: int
    proxy: Proxy  # the sandgate process behind it (tokens, CA, audit)

    def __str__(self) -> str:
        return self.kind

    def curl_proxy_args(self, user: str | None, token: str | None) -> list[str]:
        """curl's options for going through this listener (no credentials: user None)."""
        if self.kind == "http":
            args = ["--proxy", f"http://{self.host}:{self.port}"]
        else:
            args = ["--socks5-hostname", f"{self.host}:{self.port}"]
        if user is not None:
            args += ["--proxy-user", f"{user}:{token}"]
        return args

    def curl(self, identity: str | None, url: str, *args: str, token: str | None = None,
             ) -> subprocess.CompletedProcess[str]:
        """Like tests.integration.conftest.curl, through this listener."""
        tok = None if identity is None else token or self.proxy.token(identity)
        cmd = ["curl", "-sS", "--max-time", "15", *self.curl_proxy_args(identity, tok),
               "--cacert", str(self.proxy.ca), "-w", "\n%{http_code}", url, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    def open_tunnel(self, identity: str, host: str, port: int = 443) -> socket.socket:
        """An authenticated tunnel to host:port that the listener granted."""
        if self.kind == "http":
            return granted_tunnel(self.proxy, identity, host, port)
        token = self.proxy.token(identity)
        s, reply = socks5_open((self.host, self.port), identity, token, host, port)
        assert reply == 0, f"SOCKS5 reply {reply}"
        return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def socks5_open(addr: tuple[str, int], user: str | None, password: str | None, host: str,
                port: int, source: str | None = None) -> tuple[socket.socket, int | None]:
    """A SOCKS5 CONNECT (domain-name target, RFC 1928/1929) by hand: the socket and the reply
    code (None: the server closed before replying to the CONNECT)."""
    s = socket.create_connection(addr, timeout=10,
                                 source_address=(source, 0) if source else None)
    s.sendall(b"\x05\x01\x02" if user is not None else b"\x05\x01\x00")
    method = recv_exact(s, 2)
    if method != b"\x05\x02":
        return s, None
    assert user is not None and password is not None
    u, p = user.encode(), password.encode()
    s.sendall(b"\x01" + bytes([len(u)]) + u + bytes([len(p)]) + p)
    if recv_exact(s, 2) != b"\x01\x00":
        return s, None
    h = host.encode()
    s.sendall(b"\x05\x01\x00\x03" + bytes([len(h)]) + h + port.to_bytes(2, "big"))
    reply = recv_exact(s, 10)
    return s, (reply[1] if len(reply) == 10 and reply[0] == 5 else None)


def start_dual_proxy(tmp, vault, pki, *extra: str) -> tuple[Proxy, int]:
    port = free_port()
    p = start_proxy(tmp, HERE / "policies", {"VAULT_ADDR": vault.addr,
                                             "VAULT_TOKEN": vault.root_token}, pki,
                    "--socks5", f"{SOCKS5_HOST}:{port}",
                    "--socks5-allow", f"{SOCKS5_ALLOWED_SOURCE}/32", *extra)
    deadline = time.monotonic() + 10  # both listeners start together; make sure
    while True:
        try:
            socket.create_connection((SOCKS5_HOST, port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                stop_proxy(p)
                raise RuntimeError(
                    f"the SOCKS5 listener did not come up:\n{p.logs()[-3000:]}") from None
            time.sleep(0.1)
    return p, port


@dataclass(frozen=True)
class DualProxy:
    proxy: Proxy  # its HTTP listener is proxy.host:proxy.port
    socks5_port: int  # on SOCKS5_HOST


def dual_proxy_running(tmp_path_factory, vault, pki) -> Iterator[DualProxy]:
    """One `sandgate run` with the HTTP listener and the SOCKS5 listener (a test module's
    fixture body: `yield from dual_proxy_running(...)`); its logs and audit must hold no
    secret."""
    from tests.integration.conftest import SECRET_VALUES

    p, port = start_dual_proxy(tmp_path_factory.mktemp("dual"), vault, pki)
    yield DualProxy(p, port)
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


def make_listener(kind: str, dual: DualProxy) -> Listener:
    """The `kind` way ("http" or "socks5") into a proxy started by dual_proxy_running."""
    p = dual.proxy
    if kind == "http":
        return Listener("http", p.host, p.port, p)
    return Listener("socks5", SOCKS5_HOST, dual.socks5_port, p)
