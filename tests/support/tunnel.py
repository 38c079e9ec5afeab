"""Clients that speak to Sandgate the hard way: raw CONNECT tunnels, raw HTTP/1, raw HTTP/2.

curl normalises what it sends; these helpers send exactly the bytes (or h2 frames) a test
chose, through a real CONNECT tunnel and a real TLS session with Sandgate's CA, and report
what came back. Every read has a deadline.
"""

from __future__ import annotations

import base64
import socket
import ssl
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def proxy_auth(identity: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{identity}:{token}".encode()).decode()


def open_tunnel(host: str, port: int, target: str, auth: str | None,
                timeout: float = 10) -> tuple[socket.socket, bytes]:
    """CONNECT `target` ("host:port"); returns the socket and the CONNECT answer's head."""
    s = socket.create_connection((host, port), timeout=timeout)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if auth:
        head += f"Proxy-Authorization: {auth}\r\n"
    s.sendall((head + "\r\n").encode())
    resp = b""
    deadline = time.monotonic() + timeout
    while b"\r\n\r\n" not in resp and time.monotonic() < deadline:
        d = s.recv(4096)
        if not d:
            break
        resp += d
    return s, resp


def granted_tunnel(proxy, identity: str, host: str, port: int = 443,
                   timeout: float = 10) -> socket.socket:
    """An authenticated CONNECT tunnel to host:port that the proxy granted (200)."""
    s, head = open_tunnel(proxy.host, proxy.port, f"{host}:{port}",
                          proxy_auth(identity, proxy.token(identity)), timeout)
    assert b" 200 " in head.split(b"\r\n")[0], head[:200]
    return s


def tls_wrap(s: socket.socket, ca: str, server_hostname: str,
             alpn: list[str] | None = None) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=ca)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(s, server_hostname=server_hostname)


def recv_until_closed(s: socket.socket, timeout: float = 10.0,
                      stop: bytes | None = None) -> bytes:
    """Read until EOF, an error, `stop` seen, or `timeout` seconds."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
        try:
            d = s.recv(65536)
        except TimeoutError:
            if stop is not None and stop in out:
                break
            continue
        except (ssl.SSLError, OSError):
            break
        if not d:
            break
        out += d
        if stop is not None and stop in out:
            break
    return out


def h1_in_tunnel(proxy, identity: str, token: str, connect: str, raw: bytes,
                 sni: str | None = None, timeout: float = 10.0) -> bytes:
    """Send `raw` over TLS inside an authenticated CONNECT to `connect`; return all answered."""
    s, head = open_tunnel(proxy.host, proxy.port, connect, proxy_auth(identity, token))
    assert b" 200 " in head.split(b"\r\n")[0], head[:200]
    tls = tls_wrap(s, str(proxy.ca), sni or connect.rsplit(":", 1)[0], ["http/1.1"])
    try:
        tls.sendall(raw)
        return recv_until_closed(tls, timeout)
    finally:
        tls.close()


def split_response(raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """(status line, lower-cased headers, body) of the first HTTP/1 response in `raw`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.decode("latin-1").strip().lower()] = v.decode("latin-1").strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    return lines[0], headers, body


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        try:
            n = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


@dataclass
class H2Result:
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    ended: bool = False
    reset: int | None = None  # RST_STREAM error code
    terminated: int | None = None  # GOAWAY error code
    connect_head: bytes = b""

    def __repr__(self) -> str:  # short, and never the headers or body (they may hold a value)
        return (f"H2Result(status={self.status}, body_len={len(self.body)}, "
                f"trailers={len(self.trailers)}, ended={self.ended}, reset={self.reset}, "
                f"terminated={self.terminated})")

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.decode().lower() == name.lower():
                return v.decode("latin-1")
        return None

    def everything(self) -> str:
        """All the client saw, as text, for secret checks."""
        parts = [self.connect_head, self.body]
        parts += [k + b": " + v for k, v in self.headers + self.trailers]
        return b"\n".join(parts).decode("latin-1")


def h2_request(proxy, identity: str, token: str, connect: str,
               headers: list[tuple[bytes, bytes]], body: bytes | None = None,
               timeout: float = 10.0) -> H2Result:
    """One HTTP/2 request over TLS (ALPN h2) inside a CONNECT tunnel, with header checks off
    on our side so the test can send what a hostile client would (CR, LF, NUL, odd paths)."""
    s, head = open_tunnel(proxy.host, proxy.port, connect, proxy_auth(identity, token))
    res = H2Result(connect_head=head)
    assert b" 200 " in head.split(b"\r\n")[0], head[:200]
    tls = tls_wrap(s, str(proxy.ca), connect.rsplit(":", 1)[0], ["h2"])
    assert tls.selected_alpn_protocol() == "h2", tls.selected_alpn_protocol()
    c = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False,
        normalize_outbound_headers=False, validate_inbound_headers=False))
    c.initiate_connection()
    c.send_headers(1, headers, end_stream=body is None)
    if body is not None:
        c.send_data(1, body, end_stream=True)
    tls.sendall(c.data_to_send())
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not (res.ended or res.reset is not None
                                                    or res.terminated is not None):
            tls.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
            try:
                data = tls.recv(65536)
            except TimeoutError:
                continue
            except (ssl.SSLError, OSError):
                break
            if not data:
                break
            try:
                events = c.receive_data(data)
            except h2.exceptions.ProtocolError:
                break
            for ev in events:
                if isinstance(ev, h2.events.ResponseReceived):
                    res.headers = list(ev.headers)
                    res.status = int(dict(ev.headers)[b":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    res.body += ev.data
                    c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.TrailersReceived):
                    res.trailers = list(ev.headers)
                elif isinstance(ev, h2.events.StreamEnded):
                    res.ended = True
                elif isinstance(ev, h2.events.StreamReset):
                    res.reset = ev.error_code
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    res.terminated = ev.error_code
            out = c.data_to_send()
            if out:
                tls.sendall(out)
    finally:
        tls.close()
    return res
