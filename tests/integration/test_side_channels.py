"""Side channels: responses, WebSocket, trailers, error pages, options,
refusal bodies, odd addresses and DNS inside a tunnel.

Each test shows what the client saw (and, where something could go out, what the upstream got).
Real parts only: a real `sandgate run`, aiohttp WebSocket client and server, an HTTP/2 server
built on the `h2` library, scripted HTTP/1 servers over real TLS, curl.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import re
import socket
import ssl
import struct
import subprocess
import time
import urllib.parse
from collections.abc import Iterator

import aiohttp
import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    GITHUB_TOKEN,
    HERE,
    SANDGATE,
    SECRET_VALUES,
    curl,
    free_port,
    split_status,
)
from tests.support.proxy_stack import (
    POLICIES_R2,
    audit_mark,
    r2_proxy_running,
    refusal_doc,
    seen_count,
    token,
    vault_env,
    wait_new_audit,
)
from tests.support.rawupstream import (
    H2TrailerServer,
    RawServer,
    chunked_with_trailers,
    echo_credential_forms,
    malformed_status_quotes_key,
    reason_quotes_key,
)
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.tunnel import h1_in_tunnel, h2_request, open_tunnel, proxy_auth, split_response
from tests.support.wsserver import WsServer

pytestmark = pytest.mark.integration


def _no_secret(*texts: str | bytes, what: str = "the client side") -> None:
    assert_no_secret([t.decode("latin-1") if isinstance(t, bytes) else t for t in texts],
                     SECRET_VALUES, what)


@pytest.fixture(scope="module")
def r2_proxy(tmp_path_factory, vault, pki, upstream, plain_upstream) -> Iterator:
    yield from r2_proxy_running(tmp_path_factory, vault, pki)


@pytest.fixture(scope="module")
def ws_server(pki) -> Iterator[WsServer]:
    s = WsServer("127.0.0.3", 443, str(pki.cert), str(pki.key)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def raw_server(pki) -> Iterator[RawServer]:
    s = RawServer("127.0.0.4", 443, str(pki.cert), str(pki.key), responders={
        "/reason": reason_quotes_key,
        "/malformed": malformed_status_quotes_key,
        "/trailers": chunked_with_trailers,
        "/forms": echo_credential_forms,
    }).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def h2_server(pki) -> Iterator[H2TrailerServer]:
    s = H2TrailerServer("127.0.0.5", 443, str(pki.cert), str(pki.key)).start()
    yield s
    s.stop()


# ---------------------------------------------------------------- 9a. WebSocket

async def _ws_session(proxy, tok: str, sends: list[str]) -> list[str]:
    """Connect through the proxy, ask for the key, then send `sends` and "last"; return what
    came back. Bounded: 15 s in all, 5 s per receive."""
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    got: list[str] = []
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.ws_connect("wss://ws.r2.test/ws", proxy=proxy.url, ssl=ctx,
                                      proxy_auth=aiohttp.BasicAuth("coding-agent", tok),
                                      headers={"x-api-key": "sandgate-placeholder-anthropic"}
                                      ) as ws:
            await ws.send_str("send-key")
            msg = await ws.receive(timeout=5)
            got.append(msg.data if msg.type == aiohttp.WSMsgType.TEXT else f"<{msg.type}>")
            try:
                for text in [*sends, "last"]:
                    await ws.send_str(text)
            except ConnectionError:
                return got  # the proxy may end the session instead of dropping the message
            end = time.monotonic() + 5
            while time.monotonic() < end:
                try:
                    msg = await ws.receive(timeout=max(0.1, end - time.monotonic()))
                except TimeoutError:
                    break
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                got.append(msg.data)
                # the server numbers what it received: "send-key" was 1, "last" is at least 2
                if msg.data.startswith("ack ") and int(msg.data.split()[1]) >= 1 + len(sends):
                    break
    return got


def test_websocket_secret_from_server_is_redacted(r2_proxy, ws_server):
    got = asyncio.run(_ws_session(r2_proxy, token(r2_proxy), []))
    assert got, "no message came back"
    _no_secret(*got)
    assert "[REDACTED:anthropic]" in got[0], got[0]
    # the server did get the key injected on the upgrade request
    assert_secret_equal(ws_server.upgrade_headers[-1].get("x-api-key"), ANTHROPIC_KEY,
                        "x-api-key on the upgrade request")


@pytest.mark.parametrize("payload", ["value", "unbound-placeholder"])
def test_websocket_client_message_with_credential_never_reaches_server(r2_proxy, ws_server,
                                                                        payload):
    text = (f"exfil {ANTHROPIC_KEY}" if payload == "value"
            else "exfil sandgate-placeholder-openai")
    mark = audit_mark(r2_proxy)
    n = len(ws_server.received)
    asyncio.run(_ws_session(r2_proxy, token(r2_proxy), [text]))
    time.sleep(0.3)
    received = ws_server.received[n:]
    assert "send-key" in received  # the session itself worked
    assert text not in received, "the server received the credential"
    assert not any("exfil" in m for m in received)
    ev = wait_new_audit(r2_proxy, mark, lambda e: e.get("event") == "websocket"
                        and bool(e.get("exfiltration")))
    assert "exfiltration" in json.dumps(ev)


# ---------------------------------------------------------------- 9b. h2 trailers

def test_h2_response_trailers_are_scrubbed(r2_proxy, h2_server):
    res = h2_request(r2_proxy, "coding-agent", token(r2_proxy), "h2.r2.test:443",
                     [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/t"),
                      (b":authority", b"h2.r2.test")])
    assert res.status == 200, (res.status, res.reset, res.terminated)
    assert b"hello over h2" in res.body
    assert h2_server.streams, "the h2 upstream got no request"
    _no_secret(res.everything())


# ---------------------------------------------------------------- 9c/9d. status lines

def test_reason_phrase_quoting_secret_is_not_forwarded(r2_proxy, raw_server):
    out = h1_in_tunnel(r2_proxy, "coding-agent", token(r2_proxy), "raw.r2.test:443",
                       b"GET /reason HTTP/1.1\r\nHost: raw.r2.test\r\nConnection: close\r\n\r\n")
    assert raw_server.requests and raw_server.requests[-1].path == "/reason"
    _no_secret(out)
    status, _, body = split_response(out)
    assert status.startswith(b"HTTP/1.1 200"), status[:40]
    assert body == b"ok\n"


def test_reason_phrase_seen_by_curl_has_no_secret(r2_proxy, raw_server):
    # HTTP/1.1 to the proxy: over h2 curl would never see a reason phrase at all
    r = curl(r2_proxy, "coding-agent", "https://raw.r2.test/reason", "-v", "--http1.1")
    _no_secret(r.stdout, r.stderr)
    assert split_status(r.stdout)[1] == 200


def test_malformed_status_line_gives_json_502_without_secret(r2_proxy, raw_server):
    out = h1_in_tunnel(r2_proxy, "coding-agent", token(r2_proxy), "raw.r2.test:443",
                       b"GET /malformed HTTP/1.1\r\nHost: raw.r2.test\r\nConnection: close\r\n\r\n")
    assert raw_server.requests and raw_server.requests[-1].path == "/malformed"
    _no_secret(out)
    status, headers, body = split_response(out)
    assert status.startswith(b"HTTP/1.1 502"), status[:40]
    assert headers.get("x-sandgate-reason") == "upstream_error"
    assert refusal_doc(body)["code"] == "upstream_error"


# ---------------------------------------------------------------- 9e. chunked trailers

def test_chunked_response_with_trailers_arrives_promptly(r2_proxy, raw_server):
    """Bounds: one request, 10 s at most."""
    t0 = time.monotonic()
    r = subprocess.run(["curl", "-sS", "--max-time", "10", "--proxy", r2_proxy.url,
                        "--proxy-user", f"coding-agent:{token(r2_proxy)}",
                        "--cacert", str(r2_proxy.ca), "-w", "\n%{http_code}",
                        "https://raw.r2.test/trailers"], capture_output=True, text=True,
                       timeout=20)
    took = time.monotonic() - t0
    body, status = split_status(r.stdout)
    assert r.returncode == 0, f"curl exit {r.returncode} after {took:.1f}s: {r.stderr[-200:]}"
    assert status == 200 and body == "hello world!"
    assert took < 10


# ---------------------------------------------------------------- 9f. encodings back

def test_echoed_credential_forms_never_reach_the_client(r2_proxy, raw_server):
    r = curl(r2_proxy, "coding-agent", "https://raw.r2.test/forms")
    body, status = split_status(r.stdout)
    assert status == 200, r.stderr
    seen = raw_server.requests[-1]
    assert seen.path.startswith("/forms"), "the upstream got no /forms request"
    assert (seen.header("authorization") or "").startswith("Basic ")
    lines = body.splitlines()
    assert lines and lines[-1] == "end", "the echo came back incomplete"
    k = GITHUB_TOKEN.encode()
    forms = [GITHUB_TOKEN, base64.b64encode(k).decode(), base64.urlsafe_b64encode(k).decode(),
             k.hex(), k.hex().upper(), urllib.parse.quote(GITHUB_TOKEN, safe=""),
             base64.b64encode(b"x-access-token:" + k).decode()]
    assert_no_secret([body], forms, "the client side (encoded forms)")
    # decode whatever the client got back, the way a sandbox would
    decoded = [body]
    for word in re.split(r"\s+", body):
        decoded.append(urllib.parse.unquote(word))
        for dec in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                decoded.append(dec(word + "=" * (-len(word) % 4)).decode("latin-1"))
            except (binascii.Error, ValueError):
                pass
        try:
            decoded.append(bytes.fromhex(word).decode("latin-1"))
        except ValueError:
            pass
    assert_no_secret(decoded, [GITHUB_TOKEN], "what the client can decode")


# ---------------------------------------------------------------- 8. pinned options

PINNED_SETS = ["stream_large_bodies=1k", "mode=socks5", "validate_inbound_headers=false",
               "connection_strategy=eager", "ssl_insecure=true"]


def _run_with_set(vault, tmp, spec: str) -> subprocess.Popen[bytes]:
    port = free_port()
    cmd = [*SANDGATE, "run", "--policies", str(HERE / "policies"), "--listen",
           f"127.0.0.1:{port}", "--confdir", str(tmp / "conf"), "--audit",
           str(tmp / "audit.jsonl"), "--set", spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAULT_")}
    env.update(vault_env(vault))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.port = port  # type: ignore[attr-defined]
    return p


def _exited_or_listening(p: subprocess.Popen[bytes], timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return "exited"
        try:
            with socket.create_connection(("127.0.0.1", p.port), timeout=0.3):  # type: ignore[attr-defined]
                return "listening"
        except OSError:
            time.sleep(0.1)
    return "neither"


def test_pinned_options_refused_at_start(vault, tmp_path):
    """Bounds: five `sandgate run` processes started together; 20 s at most."""
    procs = {}
    for i, spec in enumerate(PINNED_SETS):
        d = tmp_path / str(i)
        d.mkdir()
        procs[spec] = _run_with_set(vault, d, spec)
    problems = []
    try:
        for spec, p in procs.items():
            state = _exited_or_listening(p)
            if state != "exited":
                problems.append(f"--set {spec}: {state}, not refused")
                continue
            err = p.stderr.read().decode() if p.stderr else ""
            name = spec.split("=")[0]
            if p.returncode != 2 or name not in err or "pinned" not in err.lower():
                problems.append(f"--set {spec}: exit {p.returncode}, stderr {err[-300:]!r}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    assert not problems, problems


def test_harmless_option_still_starts(vault, tmp_path):
    p = _run_with_set(vault, tmp_path, "termlog_verbosity=warn")
    try:
        assert _exited_or_listening(p) == "listening", \
            (p.stderr.read().decode()[-500:] if p.poll() is not None and p.stderr else "")
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(10)


# ---------------------------------------------------------------- 10. refusal bodies

@pytest.mark.parametrize("url", ["https://upstream.test/docs/x", "http://plain.test/x"])
def test_unknown_identity_refusal_names_no_other_identity(proxy, upstream, plain_upstream, url):
    tok = token(proxy, "nobody")
    server = upstream if url.startswith("https") else plain_upstream
    before = seen_count(server)
    r = curl(proxy, "nobody", url, "-i", token=tok)
    body, status = split_status(r.stdout)
    assert status == 403, r.stdout[-300:]
    assert seen_count(server) == before
    payload = body[body.index("{"):]
    assert refusal_doc(payload)["code"] == "unknown_identity"
    for other in ("coding-agent", "web-fetch", "bash-tool"):
        assert other not in body, f"the refusal names identity {other!r}"


def test_deny_rule_refusal_shows_no_policy_layout(proxy, upstream):
    mark = audit_mark(proxy)
    r = curl(proxy, "coding-agent", "https://upstream.test/admin/x", "-i")
    body, status = split_status(r.stdout)
    assert status == 403
    payload = body[body.index("{"):]
    assert refusal_doc(payload)["code"] == "denied_by_rule"
    assert ".yaml" not in body and ".yml" not in body and "policies/" not in body
    ev = wait_new_audit(proxy, mark, lambda e: e.get("path") == "/admin/x")
    assert ev["rule"] == "no-admin"
    ex = subprocess.run([*SANDGATE, "explain", "--policies", str(HERE / "policies"),
                         "--identity", "coding-agent", "GET", "https://upstream.test/admin/x"],
                        capture_output=True, text=True, timeout=30)
    assert "no-admin" in ex.stdout + ex.stderr


# ---------------------------------------------------------------- 11. translated addresses

def test_ipv4_translated_address_is_internal(r2_proxy):
    r = curl(r2_proxy, "coding-agent", "https://x.r2.test/x")
    body, status = split_status(r.stdout)
    assert status == 403, r.stdout[-300:] + r.stderr
    assert refusal_doc(body)["code"] == "internal_address"


# ---------------------------------------------------------------- 13. DNS inside CONNECT

def _dns_query(name: str, qid: int = 0x5347) -> bytes:
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00" + struct.pack("!HH", 1, 1)  # A, IN


def test_dns_over_connect_53_is_not_answered(proxy):
    """Bounds: one CONNECT, one query, 3 s wait for an answer.

    plain.test resolves to 127.0.0.2; a DNS listener there (TCP and UDP port 53) shows whether
    anything was dialled. The answer, if any, must be REFUSED with no records.
    """
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.2", 53))
    tcp.listen(4)
    tcp.settimeout(0)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.2", 53))
    udp.settimeout(0)
    mark = audit_mark(proxy)
    answer = b""
    try:
        s, head = open_tunnel(proxy.host, proxy.port, "plain.test:53",
                              proxy_auth("coding-agent", token(proxy)))
        try:
            if b" 200 " in head.split(b"\r\n")[0]:
                q = _dns_query("localhost")
                s.sendall(struct.pack("!H", len(q)) + q)
                s.settimeout(3)
                try:
                    while len(answer) < 2 or len(answer) < 2 + struct.unpack("!H", answer[:2])[0]:
                        d = s.recv(4096)
                        if not d:
                            break
                        answer += d
                except OSError:
                    pass
        finally:
            s.close()
        time.sleep(0.2)
        dialled = []
        try:
            dialled.append(tcp.accept()[1])
        except BlockingIOError:
            pass
        try:
            dialled.append(udp.recvfrom(4096)[1])
        except BlockingIOError:
            pass
    finally:
        tcp.close()
        udp.close()
    assert not dialled, f"the DNS server at 127.0.0.2:53 was contacted from {dialled}"
    assert not [e for e in proxy.audit()[mark:] if (e.get("dialed") or "").endswith(":53")]
    if len(answer) >= 14:
        msg = answer[2:]
        rcode = msg[3] & 0x0F
        ancount = struct.unpack("!H", msg[6:8])[0]
        assert ancount == 0 and rcode == 5, \
            f"DNS answered (rcode {rcode}, {ancount} record(s)); expected REFUSED (5) or nothing"


def test_channel_servers_policy_loads():
    """The channel servers' policy itself is valid (a broken file would fail every test above)."""
    r = subprocess.run([*SANDGATE, "check", str(POLICIES_R2)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
