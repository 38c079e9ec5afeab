"""Every channel, every encoding, end to end: a real `sandgate run` with OpenBao, curl, a
scripted HTTP/1 upstream that reflects the injected key in odd places, and a real WebSocket
server (aiohttp) driven by a wsproto client.

Found on main (issue 20): a header *name* carrying the key; the key in a multipart part in
base64 wrapped at 76 columns or quoted-printable with soft breaks; br, zstd and `gzip, gzip`
bodies cut with no answer; WebSocket ping, pong and close payloads relayed unjudged both ways.

Addresses: 127.0.43.3 raw.r3.test (RawServer), 127.0.43.4 ws.r3.test (WsServer); run inside
`unshare -n` like every non-Docker integration test.
"""

from __future__ import annotations

import base64
import email
import email.policy
import gzip
import json
import quopri
from collections.abc import Iterator

import brotli
import pytest
import wsproto.events as ev
import zstandard

from tests.integration.admin_support import wait_for
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    Proxy,
    curl,
    split_status,
)
from tests.support.pki import make_pki
from tests.support.rawupstream import RawRequest, RawServer
from tests.support.secrets import assert_no_secret
from tests.support.wsclient import WsprotoClient
from tests.support.wsserver import WsServer

pytestmark = pytest.mark.integration

RAW_IP, WS_IP = "127.0.43.3", "127.0.43.4"
NAMES = ["raw.r3.test", "ws.r3.test"]

POLICY = f"""
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
identities:
  agent:
    rules:
      - name: raw
        hosts: [raw.r3.test]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{RAW_IP}/32]
      - name: ws
        hosts: [ws.r3.test]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{WS_IP}/32]
"""


def _key(req: RawRequest) -> bytes:
    return (req.header("x-api-key") or "").encode()


def _answer(body: bytes, *headers: tuple[str, str], chunked: bool = False) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
    for k, v in headers:
        head += f"{k}: {v}\r\n".encode()
    if chunked:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        return head + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                               for i in range(0, len(body), 7)) + b"0\r\n\r\n"
    return head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def header_names(req: RawRequest) -> bytes:
    key = _key(req)
    return (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n"
            + key.hex().encode() + b": 1\r\nX-" + key + b": 2\r\n\r\nok\n")


def mime(req: RawRequest) -> bytes:
    key = _key(req)
    qp = quopri.encodestring(b"q" * 61 + key + b" done").replace(b"\n", b"\r\n")
    b64 = base64.encodebytes(b"b" * 50 + key + b" done").replace(b"\n", b"\r\n")
    body = (b"--XyZ\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Transfer-Encoding: base64\r\n\r\n" + b64 +
            b"--XyZ\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Transfer-Encoding: quoted-printable\r\n\r\n" + qp +
            b"\r\n--XyZ--\r\n")
    chunked = "chunked" in req.path
    return _answer(body, ("Content-Type", 'multipart/mixed; boundary="XyZ"'), chunked=chunked)


CODINGS = {
    "br": brotli.compress,
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
    "gzip, gzip": lambda b: gzip.compress(gzip.compress(b)),
    "compress": lambda b: b"\x1f\x9d" + b,  # nobody decodes LZW here: refused, readably
}


def coded(req: RawRequest) -> bytes:
    coding = req.path.split("/")[2].replace("+", ", ")
    body = CODINGS[coding](b"you sent " + _key(req) + b"\n")
    return _answer(body, ("Content-Encoding", coding), chunked="chunked" in req.path)


@pytest.fixture(scope="module")
def r3(tmp_path_factory: pytest.TempPathFactory, proxy_stack) -> Iterator[tuple[Proxy, RawServer,
                                                                                 WsServer]]:
    tmp = tmp_path_factory.mktemp("r3")
    pki = make_pki(tmp / "pki", NAMES)
    raw = RawServer(RAW_IP, 443, str(pki.cert), str(pki.key), responders={
        "/names": header_names, "/mime": mime, "/coded/": coded}).start()
    ws = WsServer(WS_IP, 443, str(pki.cert), str(pki.key)).start()
    stack = proxy_stack("r3-proxy", pki, policy={"r3.yaml": POLICY},
                        resolve={"raw.r3.test": RAW_IP, "ws.r3.test": WS_IP})
    try:
        yield stack.proxy, raw, ws
    finally:
        try:
            stack.stop()  # and no secret in its log or audit
        finally:
            raw.stop()
            ws.stop()


def _get(proxy: Proxy, path: str, *args: str) -> tuple[str, int, str]:
    out = curl(proxy, "agent", f"https://raw.r3.test{path}", "-D", "-", *args)
    body, status = split_status(out.stdout)
    return body, status, out.stderr


# ---------------------------------------------------------------- header names


def test_a_header_name_never_carries_the_key(r3) -> None:
    proxy, raw, _ = r3
    text, status, err = _get(proxy, "/names", "--http1.1")
    assert raw.requests[-1].header("x-api-key") == ANTHROPIC_KEY
    assert status == 200 and text.endswith("ok\n")
    key = ANTHROPIC_KEY.encode()
    assert_no_secret([text, err], [ANTHROPIC_KEY, key.hex()], "the response head")


# ---------------------------------------------------------------- MIME


@pytest.mark.parametrize("path", ["/mime", "/mime-chunked"])
def test_mime_parts_never_carry_the_key(r3, path: str) -> None:
    proxy, raw, _ = r3
    out = curl(proxy, "agent", f"https://raw.r3.test{path}", "-o", "-")
    body, status = split_status(out.stdout)
    assert status == 200 and raw.requests[-1].header("x-api-key") == ANTHROPIC_KEY
    assert "[REDACTED:anthropic]" in body
    # what any MIME library makes of it: each part decoded
    msg = email.message_from_bytes(b"Content-Type: multipart/mixed; boundary=\"XyZ\"\r\n\r\n"
                                   + body.encode(), policy=email.policy.default)
    parts = [p.get_payload(decode=True) or b"" for p in msg.iter_parts()]
    assert len(parts) == 2
    decoded = [p.decode("latin-1") for p in parts]
    assert_no_secret([body, *decoded], [ANTHROPIC_KEY], "the MIME parts, decoded")


# ---------------------------------------------------------------- content codings


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip+gzip"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_compressed_bodies_are_decoded_and_scrubbed(r3, coding: str, framing: str) -> None:
    proxy, _, _ = r3
    text, status, err = _get(proxy, f"/coded/{coding}/{framing}")
    assert status == 200, err
    assert text.endswith("you sent [REDACTED:anthropic]\n")
    assert "content-encoding" not in text.lower()
    assert_no_secret([text, err], [ANTHROPIC_KEY], "the decoded body")


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_sandgate_cannot_decode_gets_a_readable_502(r3, framing: str) -> None:
    proxy, _, _ = r3
    out = curl(proxy, "agent", f"https://raw.r3.test/coded/compress/{framing}")
    body, status = split_status(out.stdout)
    assert status == 502, out.stderr
    doc = json.loads(body)
    assert doc["code"] == "upstream_error" and "compress" in doc["reason"]
    ev_ = proxy.wait_audit(lambda e: (e.get("path") or "").startswith("/coded/compress")
                           and e.get("code") == "upstream_error")
    assert ev_["decision"] == "deny"


# ---------------------------------------------------------------- WebSocket control frames


def _client(proxy: Proxy) -> WsprotoClient:
    return WsprotoClient(proxy, "agent", "ws.r3.test", "/ws-control")


def _text(client: WsprotoClient, text: str, want: type) -> list[ev.Event]:
    client.send(ev.TextMessage(data=text))
    return client.receive(until=lambda e: isinstance(e, want), timeout=5)


@pytest.mark.parametrize(("command", "kind"), [("ping-key", ev.Ping), ("pong-key", ev.Pong)])
def test_server_ping_and_pong_payloads_are_scrubbed(r3, command: str, kind: type) -> None:
    proxy, _, ws = r3
    client = _client(proxy)
    try:
        got = _text(client, command, kind)
    finally:
        client.close()
    assert ws.upgrade_headers[-1]["x-api-key"] == ANTHROPIC_KEY
    frames = [e for e in got if isinstance(e, kind)]
    assert frames, got
    payload = bytes(frames[-1].payload)
    assert b"REDACTED" in payload
    assert_no_secret([payload.decode("latin-1")], [ANTHROPIC_KEY], "a control frame")


def test_server_close_reason_is_scrubbed(r3) -> None:
    proxy, _, _ = r3
    client = _client(proxy)
    try:
        got = _text(client, "close-key", ev.CloseConnection)
    finally:
        client.close()
    closes = [e for e in got if isinstance(e, ev.CloseConnection)]
    assert closes and closes[-1].code == 4000
    assert_no_secret([closes[-1].reason or ""], [ANTHROPIC_KEY], "a close reason")


def test_client_ping_with_the_key_never_reaches_the_server(r3) -> None:
    proxy, _, ws = r3
    client = _client(proxy)
    try:
        client.send(ev.Ping(payload=b"hello"))
        got = client.receive(until=lambda e: isinstance(e, ev.TextMessage), timeout=5)
        assert any(isinstance(e, ev.TextMessage) and e.data == "got ping" for e in got)
        client.send(ev.Ping(payload=b"k=" + ANTHROPIC_KEY.encode()))
        client.send(ev.Pong(payload=ANTHROPIC_KEY.encode()))
        client.receive(timeout=2)
    finally:
        client.close()
    assert ("ping", b"hello") in ws.control
    assert_no_secret([p.decode("latin-1") for _, p in ws.control], [ANTHROPIC_KEY],
                     "the WebSocket server (control frames)")
    event = proxy.wait_audit(lambda e: e.get("event") == "websocket"
                             and e.get("code") == "exfiltration")
    assert event["exfiltration"] == ["anthropic:value:websocket"]


@pytest.mark.parametrize("reason", ["plain bye", "bye " + ANTHROPIC_KEY])
def test_client_close_reason_with_the_key_never_reaches_the_server(r3, reason: str) -> None:
    proxy, _, ws = r3
    before = len(ws.control)
    client = _client(proxy)
    try:
        client.send(ev.CloseConnection(code=4001, reason=reason))
        client.receive(until=lambda e: isinstance(e, ev.CloseConnection), timeout=5)
    finally:
        client.close()
    # the proxy answers the client and closes towards the server at the same time
    wait_for(lambda: any(k == "close" for k, _ in ws.control[before:]), 5,
             "the close at the server")
    closes = [p for k, p in ws.control[before:] if k == "close"]
    assert_no_secret([p.decode("latin-1") for p in closes], [ANTHROPIC_KEY],
                     "the WebSocket server (close reason)")
