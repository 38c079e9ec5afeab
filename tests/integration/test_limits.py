"""Issue #11, limits: oversized heads (431), slow clients (408, idle close), slow or silent
upstreams (504), request rates (429), secret call budgets (429), connection counts.

Real parts: the sandgate CLI, OpenBao, the session TLS upstream (127.0.0.2) and, on 127.0.11.x,
a scripted TLS upstream that hangs, streams slowly or answers late, and a listener whose accept
queue is full (a connect that never completes). Every limit is set small by flag so that the
whole file stays short; each test states its bounds.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import (
    GITHUB_TOKEN,
    SECRET_VALUES,
    Proxy,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

SCRIPTED_IP = "127.0.11.2"  # hang.r2.test, sse.r2.test, late.r2.test
BLACKHOLE_IP = "127.0.11.3"  # blackhole.r2.test: the accept queue is full
MUTE_IP = "127.0.12.30"  # mute.r2.test: connects, then never says a word (no ServerHello)

POLICY = """\
version: v1
secrets:
  github: {mount: kv, path: ci/github, field: token, kv_version: 1, budget: {calls: 2, per: 1h}}
templates:
  reach:
    - {name: docs, hosts: [upstream.test], methods: [GET], paths: [/docs/**],
       private_cidrs: [127.0.0.2/32]}
    - {name: scripted, hosts: [hang.r2.test, sse.r2.test, late.r2.test, blackhole.r2.test,
              mute.r2.test],
       methods: [GET], private_cidrs: [127.0.11.0/24, 127.0.12.30/32]}
identities:
  agent:
    use: [reach]
    rules:
      - name: github
        hosts: [upstream.test]
        methods: [GET]
        paths: [/github/**]
        inject: {basic: {username: x-access-token, password: "{{ secrets.github }}"}}
        private_cidrs: [127.0.0.2/32]
  rate-agent:
    use: [reach]
    limits: {rps: 0.2, burst: 2}
  conn-agent:
    use: [reach]
    limits: {max_connections: 2}
"""

SSE_EVENTS = 6
SSE_GAP = 0.4  # seconds between events: each gap under the 1 s read timeout, the whole over it


class ScriptedUpstream:
    """HTTP/1.1 over TLS, by path: /hang reads the request and never answers; /sse sends the
    head at once, then an event every SSE_GAP seconds; /late answers after 2.5 s."""

    def __init__(self, pki) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(pki.cert), str(pki.key))
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            path = head.split(b" ")[1]
            if path.startswith(b"/hang"):
                await asyncio.sleep(30)
            elif path.startswith(b"/bighead"):
                writer.write(b"HTTP/1.1 200 OK\r\n")
                for _ in range(100):  # 400 KB of one header, never ended
                    writer.write(b"X-Pad: " + b"p" * 4000 + b"\r\n")
                    await writer.drain()
                await asyncio.sleep(10)
            elif path.startswith(b"/late"):
                await asyncio.sleep(2.5)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlate")
            elif path.startswith(b"/sse"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(SSE_EVENTS):
                    await writer.drain()
                    await asyncio.sleep(SSE_GAP)
                    event = b"data: %d\n\n" % i
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except Exception:
            pass
        finally:
            writer.close()

    def start(self) -> ScriptedUpstream:
        self.thread.start()

        async def start() -> asyncio.Server:
            return await asyncio.start_server(self.handle, SCRIPTED_IP, 443, ssl=self.ctx)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            if self.server is not None:
                self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def scripted(pki) -> Iterator[ScriptedUpstream]:
    s = ScriptedUpstream(pki).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def blackhole() -> Iterator[None]:
    """A listener that never accepts, its queue filled: a new connect gets no SYN-ACK."""
    lsock = socket.socket()
    lsock.bind((BLACKHOLE_IP, 443))
    lsock.listen(0)
    fillers = []
    for _ in range(4):  # backlog 0 still queues one or two; fill them
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((BLACKHOLE_IP, 443))
        fillers.append(s)
    time.sleep(0.2)
    yield
    for s in fillers:
        s.close()
    lsock.close()


@pytest.fixture(scope="module")
def mute() -> Iterator[None]:
    """A listener that is never accepted from: the kernel completes each TCP handshake and
    queues what the proxy sends (its ClientHello); no byte ever comes back."""
    lsock = socket.socket()
    lsock.bind((MUTE_IP, 443))
    lsock.listen(64)
    yield
    lsock.close()


def _env(vault) -> dict[str, str]:
    return {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}


def _resolve() -> list[str]:
    return [f"--resolve={n}.r2.test={SCRIPTED_IP}" for n in ("hang", "sse", "late")] + [
        f"--resolve=blackhole.r2.test={BLACKHOLE_IP}", f"--resolve=mute.r2.test={MUTE_IP}"]


@pytest.fixture(scope="module")
def lproxy(tmp_path_factory, vault, upstream, scripted, blackhole, mute,
           pki) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("limits")
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "limits.yaml").write_text(POLICY)
    p = start_proxy(tmp, pol, _env(vault), pki, *_resolve(),
                    "--max-header-bytes", "4k", "--max-headers", "20",
                    "--header-timeout", "1", "--upstream-connect-timeout", "1",
                    "--upstream-read-timeout", "1")
    yield p
    stop_proxy(p)
    assert_no_secret([p.logs() + p.audit_file.read_text()], SECRET_VALUES,
                     "the proxy's logs or audit")


_tokens: dict[tuple[int, str], str] = {}


def _token(p: Proxy, identity: str) -> str:
    """One token per proxy and identity (issuing one starts the CLI: about a second)."""
    key = (p.port, identity)
    if key not in _tokens:
        _tokens[key] = p.token(identity)
    return _tokens[key]


def _curl(p: Proxy, identity: str, url: str, *args: str):
    return curl(p, identity, url, *args, token=_token(p, identity))


def _retry_after(out: str) -> int:
    return int(next(line.split(":", 1)[1] for line in out.splitlines()
                    if line.lower().startswith("retry-after")))


def _json(out: str) -> dict:
    return json.loads(out[out.index("{"):out.rindex("}") + 1])


def _connect_head(p: Proxy, identity: str, extra: bytes = b"") -> bytes:
    import base64

    cred = base64.b64encode(f"{identity}:{_token(p, identity)}".encode())
    return (b"CONNECT upstream.test:443 HTTP/1.1\r\nHost: upstream.test:443\r\n"
            b"Proxy-Authorization: Basic " + cred + b"\r\n" + extra + b"\r\n")


def _read_all(s: socket.socket, limit: float = 5.0) -> bytes:
    s.settimeout(limit)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _refusal(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


# ------------------------------------------------------------------------ heads: 431

def test_endless_connect_head_is_cut_at_the_limit(lproxy):
    """Bounds: 1 connection; a CONNECT head that never ends, 64 KiB sent; < 5 s."""
    with socket.create_connection((lproxy.host, lproxy.port)) as s:
        s.sendall(b"CONNECT upstream.test:443 HTTP/1.1\r\nX-Pad: ")
        sent = 0
        try:
            while sent < 64 * 1024:
                s.sendall(b"a" * 4096)
                sent += 4096
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us, as it should
        raw = _read_all(s)
    status, body = _refusal(raw)
    assert status == 431 and body["code"] == "headers_too_large"
    ev = lproxy.wait_audit(lambda e: e.get("event") == "limit"
                           and e.get("code") == "headers_too_large")
    assert "4096" in ev["reason"]


def test_too_many_headers_on_connect_431(lproxy):
    """Bounds: 1 connection, 1 CONNECT with 25 header fields; < 5 s."""
    extra = b"".join(b"X-H%d: v\r\n" % i for i in range(25))
    with socket.create_connection((lproxy.host, lproxy.port)) as s:
        s.sendall(_connect_head(lproxy, "agent", extra))
        status, body = _refusal(_read_all(s))
    assert status == 431 and body["code"] == "headers_too_large"
    lproxy.wait_audit(lambda e: e.get("event") == "connect"
                      and e.get("code") == "headers_too_large")


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
@pytest.mark.parametrize("what", ["count", "bytes"])
def test_oversized_head_inside_the_tunnel_431(lproxy, http, what):
    """Bounds: 1 request through curl (HTTP/1.1 or HTTP/2 inside the tunnel); < 5 s."""
    if what == "count":
        headers = [a for i in range(25) for a in ("-H", f"x-h{i}: v")]
    else:
        headers = ["-H", "x-big: " + "b" * 4300]
    r = _curl(lproxy, "agent", f"https://upstream.test/docs/{what}", http, *headers)
    body, status = split_status(r.stdout)
    assert status == 431, r.stdout + r.stderr
    assert json.loads(body)["code"] == "headers_too_large"


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_far_oversized_head_inside_the_tunnel_never_buffered(lproxy, upstream, http):
    """Bounds: 1 request with a 40 KB header (limit 4 KB). HTTP/1: 431 while reading the head;
    HTTP/2: the header list is over what the decoder accepts, the connection is ended."""
    before = len(upstream.seen)
    r = _curl(lproxy, "agent", "https://upstream.test/docs/huge", http,
              "-H", "x-huge: " + "h" * 40_000)
    body, status = split_status(r.stdout)
    if http == "--http1.1":
        assert status == 431 and json.loads(body)["code"] == "headers_too_large", r.stdout
    else:
        assert status in (0, 431), r.stdout + r.stderr
    assert len(upstream.seen) == before


# ------------------------------------------------------------------------ slow client: 408

def test_head_sent_a_byte_at_a_time_is_cut_off(lproxy):
    """Bounds: 1 connection; a byte every 0.2 s for 0.8 s (activity all along, so no idle
    timer would fire), then silence; --header-timeout 1; < 4 s."""
    with socket.create_connection((lproxy.host, lproxy.port)) as s:
        started = time.monotonic()
        s.sendall(b"GET http://upstream.test/docs/x HTTP/1.1\r\n")
        while time.monotonic() - started < 0.8:
            time.sleep(0.2)
            s.sendall(b"X")  # stop before the deadline: unread bytes would turn FIN into RST
        raw = _read_all(s, 4)
        elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 4
    status, body = _refusal(raw)
    assert status == 408 and body["code"] == "header_timeout"
    lproxy.wait_audit(lambda e: e.get("event") == "limit" and e.get("code") == "header_timeout")


def test_slow_head_inside_the_tunnel_is_cut_off(lproxy):
    """Bounds: 1 connection: CONNECT, TLS, half a request head, then silence; --header-timeout
    1; < 5 s. The 408 comes back through the tunnel's TLS."""
    with socket.create_connection((lproxy.host, lproxy.port)) as raw:
        raw.sendall(_connect_head(lproxy, "agent"))
        raw.settimeout(5)
        assert b" 200 " in raw.recv(4096)
        ctx = ssl.create_default_context(cafile=str(lproxy.ca))
        ctx.set_alpn_protocols(["http/1.1"])
        with ctx.wrap_socket(raw, server_hostname="upstream.test") as s:
            started = time.monotonic()
            s.sendall(b"GET /docs/slow HTTP/1.1\r\nHost: upstream.test\r\n")
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except (TimeoutError, ConnectionResetError, ssl.SSLError):
                pass
            elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 5
    status, body = _refusal(out)
    assert status == 408 and body["code"] == "header_timeout"


@pytest.mark.parametrize("head", [
    b"GARBAGE\r\n\r\n",  # no request line
    b"GET http://upstream.test/docs/x HTTP/1.1\r\nHost upstream.test\r\n\r\n",  # no colon
], ids=["request-line", "header-line"])
def test_unparseable_head_is_audited(lproxy, head):
    """Bounds: 1 connection, 1 head mitmproxy cannot parse; < 5 s. mitmproxy answers it itself
    (400, before any hook) and logs it only: Sandgate writes its request event."""
    with socket.create_connection((lproxy.host, lproxy.port)) as s:
        host, port = s.getsockname()[:2]
        client = f"{host}:{port}"
        s.sendall(head)
        status, body = _refusal(_read_all(s))
    assert status == 400 and body["code"] == "bad_request"
    ev = lproxy.wait_audit(lambda e: e.get("client") == client)
    assert (ev["event"], ev["decision"], ev["code"]) == ("request", "deny", "bad_request"), ev
    assert "GARBAGE" not in ev["reason"]  # a fixed reason: the head itself is not quoted


# ------------------------------------------------------------------------ upstream: 504

@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_silent_upstream_504(lproxy, http):
    """Bounds: 1 request; the upstream never answers; --upstream-read-timeout 1; < 5 s."""
    started = time.monotonic()
    r = _curl(lproxy, "agent", "https://hang.r2.test/hang", http)
    body, status = split_status(r.stdout)
    assert status == 504, r.stdout + r.stderr
    assert json.loads(body)["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5
    ev = lproxy.wait_audit(lambda e: e.get("event") == "request" and e.get("path") == "/hang"
                           and e.get("code") == "upstream_timeout")
    assert ev["decision"] == "deny"


def test_late_response_head_504(lproxy):
    """Bounds: 1 request; the upstream answers after 2.5 s, the read timeout is 1 s."""
    r = _curl(lproxy, "agent", "https://late.r2.test/late")
    body, status = split_status(r.stdout)
    assert status == 504 and json.loads(body)["code"] == "upstream_timeout", r.stdout


def test_unreachable_upstream_connect_504(lproxy):
    """Bounds: 1 request; the upstream's accept queue is full; --upstream-connect-timeout 1."""
    started = time.monotonic()
    r = _curl(lproxy, "agent", "https://blackhole.r2.test/x")
    body, status = split_status(r.stdout)
    assert status == 504, r.stdout + r.stderr
    assert json.loads(body)["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5


def test_upstream_silent_in_the_tls_handshake_504(lproxy):
    """Bounds: 1 request; the upstream accepts TCP and never sends a ServerHello;
    --upstream-read-timeout 1; < 5 s. A timeout, not a failed handshake: 504 (with the
    refusal body, and the request event's code), not 502."""
    started = time.monotonic()
    r = _curl(lproxy, "agent", "https://mute.r2.test/quiet")
    body, status = split_status(r.stdout)
    assert status == 504, r.stdout + r.stderr
    assert json.loads(body)["code"] == "upstream_timeout"
    assert time.monotonic() - started < 5
    lproxy.wait_audit(lambda e: e.get("event") == "request" and e.get("path") == "/quiet"
                      and e.get("code") == "upstream_timeout")


def test_endless_response_head_502(lproxy):
    """Bounds: 1 request; the upstream sends a head of 400 KB that never ends (bound 256 KiB)."""
    r = _curl(lproxy, "agent", "https://late.r2.test/bighead")
    body, status = split_status(r.stdout)
    assert status == 502 and json.loads(body)["code"] == "upstream_error", r.stdout


def test_stream_longer_than_the_read_timeout_keeps_flowing(lproxy):
    """Bounds: 1 request; 6 events 0.4 s apart (2.4 s in all) under a 1 s read timeout."""
    r = _curl(lproxy, "agent", "https://sse.r2.test/sse", "-N")
    body, status = split_status(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert body.count("data: ") == SSE_EVENTS


# ------------------------------------------------------------------------ rates and budgets

def test_request_rate_per_identity_429_with_retry_after(lproxy):
    """Bounds: 3 requests in a row; rate-agent has rps 0.2, burst 2."""
    statuses = []
    for i in range(3):
        r = _curl(lproxy, "rate-agent", f"https://upstream.test/docs/rate{i}", "-D", "-")
        statuses.append(split_status(r.stdout)[1])
    assert statuses == [200, 200, 429], statuses
    assert _retry_after(r.stdout) == 5  # a token every 5 s
    assert _json(r.stdout)["code"] == "rate_limited"
    ev = lproxy.wait_audit(lambda e: e.get("code") == "rate_limited")
    assert ev["identity"] == "rate-agent"
    # another identity is not held back by rate-agent's bucket
    assert split_status(_curl(lproxy, "agent", "https://upstream.test/docs/r").stdout)[1] == 200


def test_secret_budget_429_and_nothing_sent(lproxy, upstream):
    """Bounds: 3 requests injecting `github` (budget: 2 calls per hour)."""
    statuses = []
    for i in range(3):
        r = _curl(lproxy, "agent", f"https://upstream.test/github/budget{i}", "-D", "-")
        statuses.append(split_status(r.stdout)[1])
    assert statuses == [200, 200, 429], statuses
    assert 3500 < _retry_after(r.stdout) <= 3600
    assert _json(r.stdout)["code"] == "budget_exhausted"
    assert not [s for s in upstream.seen if "budget2" in str(s)]
    ev = lproxy.wait_audit(lambda e: e.get("code") == "budget_exhausted")
    assert ev["secrets"] == []  # nothing injected
    assert GITHUB_TOKEN not in r.stdout


# ------------------------------------------------------------------------ connections

def test_connections_per_identity(lproxy):
    """Bounds: 4 connections of conn-agent (max_connections: 2), each a CONNECT; < 5 s."""
    held = []
    try:
        for _ in range(2):
            s = socket.create_connection((lproxy.host, lproxy.port))
            s.sendall(_connect_head(lproxy, "conn-agent"))
            s.settimeout(5)
            assert b" 200 " in s.recv(4096).split(b"\r\n")[0] + b" "
            held.append(s)
        with socket.create_connection((lproxy.host, lproxy.port)) as s:
            s.sendall(_connect_head(lproxy, "conn-agent"))
            status, body = _refusal(_read_all(s))
        assert status == 429 and body["code"] == "too_many_connections"
        held.pop().close()  # released on disconnect: the next one gets in
        deadline = time.monotonic() + 5
        while True:
            with socket.create_connection((lproxy.host, lproxy.port)) as s:
                s.sendall(_connect_head(lproxy, "conn-agent"))
                s.settimeout(5)
                line = s.recv(4096).split(b"\r\n")[0]
            if b" 200 " in line + b" " or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert b" 200 " in line + b" "
    finally:
        for s in held:
            s.close()


def test_total_connections_and_idle_timeout(tmp_path: Path, vault, upstream, pki):
    """Bounds: its own proxy (--max-connections 2, --idle-timeout 1); 3 connections; < 8 s."""
    pol = tmp_path / "policies"
    pol.mkdir()
    (pol / "limits.yaml").write_text(POLICY)
    p = start_proxy(tmp_path, pol, _env(vault), pki, "--max-connections", "2",
                    "--idle-timeout", "1")
    try:
        a = socket.create_connection((p.host, p.port))
        b = socket.create_connection((p.host, p.port))
        with socket.create_connection((p.host, p.port)) as c:
            assert _read_all(c, 3) == b""  # closed at once, no answer
        p.wait_audit(lambda e: e.get("event") == "limit"
                     and e.get("code") == "too_many_connections")
        # the two held ones say nothing: closed after the idle timeout
        started = time.monotonic()
        assert _read_all(a, 5) == b"" and _read_all(b, 5) == b""
        assert time.monotonic() - started < 4.5
        p.wait_audit(lambda e: e.get("event") == "limit" and e.get("code") == "idle_timeout")
        a.close()
        b.close()
        # and both slots are free again
        r = _curl(p, "agent", "https://upstream.test/docs/after-idle")
        assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
    finally:
        stop_proxy(p)
