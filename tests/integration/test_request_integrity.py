"""Request integrity: what a sandbox sends must reach the upstream exactly as judged.

Every test here looks at both ends: what the client got back, and what the upstream (the shared
aiohttp upstream, nginx, or a scripted raw server) received. Real parts only: a real `sandgate
run`, HTTP/2 with the `h2` library over real TLS inside a real CONNECT tunnel, Debian's nginx.
"""

from __future__ import annotations

import base64
import email
import email.policy
import gzip
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import brotli
import h2.errors
import pytest
import zstandard
from cryptography.hazmat.primitives import serialization
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SECRET_VALUES,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support import nginx as nginx_support
from tests.support.proxy_stack import (
    audit_mark,
    r2_proxy_running,
    refusal_doc,
    seen_count,
    token,
    vault_env,
    wait_new_audit,
)
from tests.support.rawupstream import RawServer, switch_on_any_upgrade
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.tunnel import (
    h1_in_tunnel,
    h2_request,
    open_tunnel,
    proxy_auth,
    recv_until_closed,
    split_response,
    tls_wrap,
)

pytestmark = pytest.mark.integration

PLACEHOLDER = "sandgate-placeholder-anthropic"


@pytest.fixture(scope="module")
def r2_proxy(tmp_path_factory, vault, pki, upstream, plain_upstream) -> Iterator:
    yield from r2_proxy_running(tmp_path_factory, vault, pki)


def _llm_h2_headers(extra: list[tuple[bytes, bytes]] = (), path: bytes = b"/v1/messages",
                    content_length: int | None = 2) -> list[tuple[bytes, bytes]]:
    h = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", path),
         (b":authority", b"api.anthropic.com"), (b"content-type", b"application/json"),
         (b"x-api-key", PLACEHOLDER.encode())]
    if content_length is not None:
        h.append((b"content-length", str(content_length).encode()))
    return h + list(extra)


def _warm_cache(proxy) -> None:
    """One allowed call so Sandgate has the anthropic value cached (and can recognise it)."""
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}",
             "-H", f"x-api-key: {PLACEHOLDER}")
    assert split_status(r.stdout)[1] == 200, r.stderr


def _assert_h2_bad_request(proxy, upstream, before: int, mark: int, res,
                           h2_refuses: bool = False) -> None:
    """Never forwarded, and answered 400 bad_request (audited). `h2_refuses`: h2 4.4 (mitmproxy
    12's) itself refuses a header value with CR, LF or NUL (RFC 9113 8.2.1): the connection
    ends with PROTOCOL_ERROR before mitmproxy makes a request of it, so there is no answer on
    the stream and no audit event (h2 4.1 passed such values on and Sandgate answered 400)."""
    time.sleep(0.2)  # anything forwarded would have been recorded by now
    new = upstream.seen[before:]
    n_new = len(new)
    assert n_new == 0, f"upstream received {n_new} request(s): " \
                       f"{[(s.method, s.path, sorted(s.headers)) for s in new]}"
    if h2_refuses:
        assert res.status is None and res.terminated == h2.errors.ErrorCodes.PROTOCOL_ERROR, (
            res.status, res.reset, res.terminated, res.body[:200])
        return
    assert res.status == 400, (res.status, res.reset, res.terminated, res.body[:200])
    assert res.header("x-sandgate-reason") == "bad_request"
    assert refusal_doc(res.body)["code"] == "bad_request"
    ev = wait_new_audit(proxy, mark, lambda e: e.get("method") == "POST"
                        and e.get("code") == "bad_request")
    assert ev["decision"] == "deny"


# ---------------------------------------------------------------- 1. CR/LF/NUL over h2

H2_BAD_VALUES = {
    "crlf": b"v\r\nX-Injected: 1",
    "lf": b"v\nX-Injected: 1",
    "cr": b"v\rX-Injected: 1",
    "nul": b"v\x00X-Injected: 1",
    "smuggled-request": (b"v\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: api.anthropic.com\r\n"
                         b"X-Pad: x"),
}


@pytest.mark.parametrize("value", list(H2_BAD_VALUES.values()), ids=list(H2_BAD_VALUES))
def test_h2_header_value_with_control_bytes_refused(proxy, upstream, value):
    before, mark = seen_count(upstream), audit_mark(proxy)
    res = h2_request(proxy, "coding-agent", token(proxy), "api.anthropic.com:443",
                     _llm_h2_headers([(b"x-a", value)]), b"{}")
    _assert_h2_bad_request(proxy, upstream, before, mark, res, h2_refuses=True)


@pytest.mark.parametrize("path", [
    b"/v1/messages HTTP/1.1\r\nX-Injected: 1\r\nX-Pad: x",
    b"/v1/messages\r\nX-Injected: 1",
    b"/v1/messages x",
], ids=["crlf-request-line", "crlf", "space"])
def test_h2_path_with_crlf_or_space_refused(proxy, upstream, path):
    before, mark = seen_count(upstream), audit_mark(proxy)
    res = h2_request(proxy, "coding-agent", token(proxy), "api.anthropic.com:443",
                     _llm_h2_headers(path=path), b"{}")
    _assert_h2_bad_request(proxy, upstream, before, mark, res,
                           h2_refuses=b"\r" in path or b"\n" in path)


_VISIBLE = st.binary(min_size=1, max_size=16).map(
    lambda b: bytes(0x21 + (x % 0x5e) for x in b))  # printable, no space: h2 itself accepts it
_FORBIDDEN = st.sampled_from([b"\r", b"\n", b"\x00", b"\r\n", b"\n\r"])


@settings(max_examples=20, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],  # no shrinking: keeps a failure bounded
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.tuples(_VISIBLE, st.lists(st.tuples(_FORBIDDEN, _VISIBLE), min_size=1, max_size=3)))
def test_h2_generated_header_values_with_forbidden_bytes_refused(proxy, upstream, parts):
    """Bounded: 20 generated values, one h2 request each, no shrinking (about 5 s)."""
    head, rest = parts
    value = head + b"".join(f + v for f, v in rest)
    before, mark = seen_count(upstream), audit_mark(proxy)
    res = h2_request(proxy, "coding-agent", token(proxy), "api.anthropic.com:443",
                     _llm_h2_headers([(b"x-generated", value)]), b"{}")
    _assert_h2_bad_request(proxy, upstream, before, mark, res, h2_refuses=True)


# ---------------------------------------------------------------- 2. h2 body framing

@pytest.mark.parametrize("body", [
    b"GET /admin HTTP/1.1\r\nHost: api.anthropic.com\r\n\r\n",
    b'{"model":"m","messages":[]}' * 40,
], ids=["body-looks-like-a-request", "json"])
def test_h2_body_without_content_length_stays_one_request(proxy, upstream, body):
    before = seen_count(upstream)
    res = h2_request(proxy, "coding-agent", token(proxy), "api.anthropic.com:443",
                     _llm_h2_headers(content_length=None), body)
    time.sleep(0.2)
    new = upstream.seen[before:]
    assert [(s.method, s.path) for s in new] == [("POST", "/v1/messages")]
    assert new[0].body == body
    assert res.status == 200, (res.status, res.body[:200])


# ---------------------------------------------------------------- 3. absolute-form in a tunnel

@pytest.fixture(scope="module")
def nginx(tmp_path_factory, pki) -> Iterator[nginx_support.Nginx]:
    if not nginx_support.available():
        pytest.fail("nginx is not installed: scripts/setup.sh --test installs it")
    n = nginx_support.Nginx(tmp_path_factory.mktemp("nginx"), "127.0.0.6", 443,
                            ["nginx.r2.test", "other.test"], pki.cert, pki.key).start()
    yield n
    n.stop()


def test_absolute_form_naming_another_host_refused(r2_proxy, nginx):
    other_before = len(nginx.requests("other.test"))
    allowed_before = len(nginx.requests("nginx.r2.test"))
    mark = audit_mark(r2_proxy)
    out = h1_in_tunnel(r2_proxy, "coding-agent", token(r2_proxy), "nginx.r2.test:443",
                       b"GET https://other.test/x HTTP/1.1\r\nHost: nginx.r2.test\r\n"
                       b"Connection: close\r\n\r\n")
    status, headers, body = split_response(out)
    time.sleep(0.2)
    assert nginx.requests("other.test")[other_before:] == []
    assert nginx.requests("nginx.r2.test")[allowed_before:] == []
    assert status.startswith(b"HTTP/1.1 400"), out[:300]
    assert headers.get("x-sandgate-reason") == "bad_request"
    assert refusal_doc(body)["code"] == "bad_request"
    ev = wait_new_audit(r2_proxy, mark, lambda e: e.get("method") == "GET")
    # the audit must not claim that the allowed host served this
    assert ev["decision"] == "deny" and ev["code"] == "bad_request"
    assert ev.get("upstream_status") is None


def test_absolute_form_naming_the_tunnel_host_goes_out_in_origin_form(r2_proxy, nginx):
    before = len(nginx.requests("nginx.r2.test"))
    out = h1_in_tunnel(r2_proxy, "coding-agent", token(r2_proxy), "nginx.r2.test:443",
                       b"GET https://nginx.r2.test/x HTTP/1.1\r\nHost: nginx.r2.test\r\n"
                       b"Connection: close\r\n\r\n")
    status, _, body = split_response(out)
    assert status.startswith(b"HTTP/1.1 200"), out[:300]
    assert body == b"vhost nginx.r2.test\n"
    assert nginx.requests("nginx.r2.test")[before:] == ["nginx.r2.test|GET /x HTTP/1.1"]


# ---------------------------------------------------------------- 4. X-Sandgate-* from clients

@pytest.mark.parametrize("url", ["https://upstream.test/page", "http://plain.test/page"])
def test_client_x_sandgate_headers_never_reach_upstream(proxy, upstream, plain_upstream, url):
    server = upstream if url.startswith("https") else plain_upstream
    before = seen_count(server)
    r = curl(proxy, "coding-agent", url, "-H", "X-Sandgate-Anything: 1",
             "-H", "x-sandgate-identity: admin", "-H", "X-SANDGATE-RULE: everything",
             "-H", "X-SandGate-Reason: forged")
    assert split_status(r.stdout)[1] in (200, 400), r.stdout + r.stderr
    for s in server.seen[before:]:
        leaked = [k for k in s.headers if k.lower().startswith("x-sandgate")]
        assert not leaked, leaked


# ---------------------------------------------------------------- 5. placeholders elsewhere

@pytest.mark.parametrize("header", ["x-echo", "authorization"])
def test_bound_placeholder_in_another_header_is_not_substituted(proxy, upstream, header):
    before = seen_count(upstream)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/echo-key",
             "-H", f"{header}: {PLACEHOLDER}")
    assert split_status(r.stdout)[1] == 200, r.stderr
    seen = upstream.seen[before:]
    n = len(seen)
    assert n == 1
    # the injected header carries the key; the other header still the placeholder
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "injected x-api-key")
    assert_secret_equal(seen[0].headers.get(header), PLACEHOLDER, f"upstream {header}")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the client side")


# ---------------------------------------------------------------- 6. exfiltration encodings

def _forms() -> dict[str, bytes]:
    k = ANTHROPIC_KEY.encode()
    return {
        "base64": base64.b64encode(k),
        "base64-unaligned": base64.b64encode(b"key=" + k + b";"),
        "base64-urlsafe": base64.urlsafe_b64encode(b"k:" + k),
        "hex": k.hex().encode(),
        "HEX": k.hex().upper().encode(),
        "upper": k.upper(),
        "percent-every-byte": "".join(f"%{b:02X}" for b in k).encode(),
        "percent-every-byte-lower": "".join(f"%{b:02x}" for b in k).encode(),
    }


@pytest.mark.parametrize("form", list(_forms()))
def test_encoded_cached_value_in_body_is_exfiltration(proxy, upstream, form):
    _warm_cache(proxy)
    before, mark = seen_count(upstream), audit_mark(proxy)
    body = b'{"messages":[{"role":"user","content":"' + _forms()[form] + b'"}]}'
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "--data-binary", body.decode(), "-H", "content-type: application/json")
    text, status = split_status(r.stdout)
    assert seen_count(upstream) == before, "the request reached the upstream"
    assert status == 403
    assert refusal_doc(text)["code"] == "exfiltration"
    wait_new_audit(proxy, mark, lambda e: e.get("code") == "exfiltration")


def test_gzip_body_with_cached_value_is_exfiltration(proxy, upstream, tmp_path):
    _warm_cache(proxy)
    f = tmp_path / "body.gz"
    f.write_bytes(gzip.compress(b'{"content":"' + ANTHROPIC_KEY.encode() + b'"}'))
    before = seen_count(upstream)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "--data-binary", f"@{f}", "-H", "content-encoding: gzip",
             "-H", "content-type: application/json")
    text, status = split_status(r.stdout)
    assert seen_count(upstream) == before, "the request reached the upstream"
    assert status == 403
    assert refusal_doc(text)["code"] == "exfiltration"


def _post_encoded(proxy, tmp_path, body: bytes, coding: str) -> tuple[str, int]:
    f = tmp_path / "body.bin"
    f.write_bytes(body)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "--data-binary", f"@{f}", "-H", f"content-encoding: {coding}",
             "-H", "content-type: application/json")
    return split_status(r.stdout)


def test_a_value_in_any_gzip_member_or_stacked_coding_is_exfiltration(proxy, upstream,
                                                                       tmp_path):
    """Issue 34: the check read the first gzip member only; an upstream decoding the body
    reads every member (and undoes `gzip, br` layer by layer)."""
    _warm_cache(proxy)
    leak = b'{"content":"' + ANTHROPIC_KEY.encode() + b'"}'
    bodies = {"second member": (gzip.compress(b'{"x": 1}') + gzip.compress(leak), "gzip"),
              "gzip, br": (brotli.compress(gzip.compress(leak)), "gzip, br"),
              "zstd": (zstandard.ZstdCompressor().compress(leak), "zstd")}
    for name, (body, coding) in bodies.items():
        before = seen_count(upstream)
        text, status = _post_encoded(proxy, tmp_path, body, coding)
        assert seen_count(upstream) == before, f"{name}: the request reached the upstream"
        assert status == 403, name
        assert refusal_doc(text)["code"] == "exfiltration", name


@pytest.mark.parametrize("body,coding,code", [
    (b"plain", "compress", "bad_request"),  # a coding Sandgate cannot decode
    (gzip.compress(b'{"a": 1}')[:-6], "gzip", "bad_request"),  # cut short
    (gzip.compress(b"\0" * (40 << 20)), "gzip", "too_large"),  # over --max-request-body
], ids=["unknown-coding", "gzip-cut", "gzip-bomb"])  # (gzip stamps the time: not the bodies)
def test_a_body_sandgate_cannot_decode_is_refused(proxy, upstream, tmp_path, body, coding,
                                                  code):
    before = seen_count(upstream)
    text, status = _post_encoded(proxy, tmp_path, body, coding)
    assert seen_count(upstream) == before, "the request reached the upstream"
    assert status in (400, 413)
    assert refusal_doc(text)["code"] == code


def test_a_quoted_printable_echo_with_any_escapes_is_scrubbed(proxy, upstream):
    """Issue 34: a MIME part with the key's bytes escaped (=2D, =6b, ...) and soft breaks
    reached the client."""
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/echo-key?as=qp")
    text, status = split_status(r.stdout)
    assert status == 200, r.stderr
    scrubbed = "[REDACTED:anthropic]" in text
    assert scrubbed, "the quoted-printable key was not scrubbed"  # (no body: it holds the key)
    part = email.message_from_bytes(b'Content-Type: multipart/mixed; boundary="b1"\r\n\r\n'
                                    + text.encode(), policy=email.policy.default)
    decoded = b"".join(p.get_payload(decode=True) or b"" for p in part.iter_parts())
    assert decoded.startswith(b"key: ")
    assert_no_secret([decoded.decode("latin-1"), text], [ANTHROPIC_KEY], "the MIME answer")


def test_the_audit_signing_key_is_exfiltration(proxy, upstream, tmp_path):
    """Issue 34: the audit chain's private key is a credential Sandgate holds; a sandbox that
    got hold of it (whole, or its seed in hex) cannot send it out."""
    key_file = proxy.confdir / "audit-signing.key"
    assert key_file.exists()  # the session proxy's chain signs with the confdir key
    pem = key_file.read_text()
    seed = serialization.load_pem_private_key(pem.encode(), None).private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
        serialization.NoEncryption())
    for body in (json.dumps({"k": pem}).encode(), b"seed=" + seed.hex().encode()):
        f = tmp_path / "body"
        f.write_bytes(body)
        before = seen_count(upstream)
        r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
                 "--data-binary", f"@{f}", "-H", "content-type: application/json")
        text, status = split_status(r.stdout)
        assert seen_count(upstream) == before, "the request reached the upstream"
        assert status == 403
        doc = refusal_doc(text)
        assert doc["code"] == "exfiltration" and "audit-signing-key" in doc["reason"]


@pytest.mark.parametrize("which", ["ca-private-key", "proxy-token-key"])
def test_the_ca_key_and_the_token_key_are_exfiltration(proxy, upstream, tmp_path, which):
    """Issue 34: the CA's private key (it signs every certificate a sandbox trusts) and the
    proxy-token key (it mints any identity's token) are credentials Sandgate holds: a sandbox
    that got hold of one cannot send it out. The CA certificate is public and goes through."""
    if which == "ca-private-key":
        text = (proxy.confdir / "mitmproxy-ca.pem").read_text()
        body = json.dumps({"k": text[:text.index("-----END")]}).encode()
    else:
        body = b"key=" + (proxy.confdir / "sandgate-token.key").read_bytes().strip()
    f = tmp_path / "body"
    f.write_bytes(body)
    before = seen_count(upstream)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "--data-binary", f"@{f}", "-H", "content-type: application/json")
    text, status = split_status(r.stdout)
    assert seen_count(upstream) == before, "the request reached the upstream"
    assert status == 403
    doc = refusal_doc(text)
    assert doc["code"] == "exfiltration" and which in doc["reason"]
    cert = tmp_path / "cert"
    cert.write_bytes(json.dumps({"ca": (proxy.confdir / "mitmproxy-ca-cert.pem").read_text()})
                     .encode())
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "--data-binary", f"@{cert}", "-H", "content-type: application/json")
    assert split_status(r.stdout)[1] != 403, r.stdout[:300]


# ---------------------------------------------------------------- 7. body limits

def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_unauthenticated_huge_chunked_post_is_not_buffered(r2_proxy, plain_upstream):
    """Bounds: one connection, at most 300 MB offered, at most 20 s; RSS polled every 20 ms."""
    before = seen_count(plain_upstream)
    base = _rss_kb(r2_proxy.proc.pid)
    s = socket.create_connection((r2_proxy.host, r2_proxy.port), timeout=10)
    s.sendall(b"POST http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n"
              b"Transfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n")
    chunk = b"100000\r\n" + b"A" * 0x100000 + b"\r\n"
    state = {"sent_mb": 0, "closed": False}
    deadline = time.monotonic() + 20

    def send() -> None:
        try:
            for _ in range(300):
                if time.monotonic() > deadline:
                    return
                s.sendall(chunk)
                state["sent_mb"] += 1
            s.sendall(b"0\r\n\r\n")
        except OSError:
            state["closed"] = True

    t = threading.Thread(target=send, daemon=True)
    t.start()
    peak = base
    while t.is_alive() and time.monotonic() < deadline + 1:
        peak = max(peak, _rss_kb(r2_proxy.proc.pid))
        time.sleep(0.02)
    t.join(2)
    out = b"" if state["closed"] else recv_until_closed(s, 5, stop=b"\r\n\r\n")
    s.close()
    peak = max(peak, _rss_kb(r2_proxy.proc.pid))
    grew_mb = (peak - base) / 1024
    assert seen_count(plain_upstream) == before
    assert grew_mb < 64, f"RSS grew by {grew_mb:.0f} MB while {state['sent_mb']} MB were " \
                         f"offered without authentication"
    assert state["closed"] or out.startswith(b"HTTP/1.1 407") or out == b"", out[:200]


def test_declared_length_over_limit_is_413(vault, pki, upstream, tmp_path):
    """Bounds: its own proxy (--max-request-body 1m); two requests of 0.5 and 2 MB."""
    p = start_proxy(tmp_path, HERE / "policies", vault_env(vault), pki,
                    "--max-request-body", "1m")
    try:
        small, big = tmp_path / "small", tmp_path / "big"
        small.write_bytes(b"x" * 512 * 1024)
        big.write_bytes(b"x" * 2 * 1024 * 1024)
        before = seen_count(upstream)
        r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages",
                 "--data-binary", f"@{big}", "-H", "Expect:")
        text, status = split_status(r.stdout)
        assert status == 413, r.stdout[-300:] + r.stderr
        assert refusal_doc(text)["code"] == "too_large"
        assert seen_count(upstream) == before
        r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages",
                 "--data-binary", f"@{small}", "-H", "Expect:")
        assert split_status(r.stdout)[1] == 200
        assert upstream.seen[-1].body == small.read_bytes(), "the body arrived changed"
        # chunked uploads (no length up front) are measured as they arrive, not refused at the
        # head: a small one goes through whole, a large one is refused with the same code
        r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages",
                 "--data-binary", f"@{small}", "-H", "Expect:", "-H",
                 "Transfer-Encoding: chunked")
        assert split_status(r.stdout)[1] == 200, r.stdout[-300:]
        assert upstream.seen[-1].body == small.read_bytes(), "the chunked body arrived changed"
        before = seen_count(upstream)
        r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages",
                 "--data-binary", f"@{big}", "-H", "Expect:", "-H", "Transfer-Encoding: chunked")
        text, status = split_status(r.stdout)
        assert status == 413, r.stdout[-300:] + r.stderr
        assert refusal_doc(text)["code"] == "too_large"
        assert seen_count(upstream) == before
    finally:
        stop_proxy(p)


# ---------------------------------------------------------------- 12. non-websocket upgrades

@pytest.fixture(scope="module")
def upgrade_servers(pki) -> Iterator[tuple[RawServer, RawServer]]:
    tls = RawServer("127.0.0.7", 443, str(pki.cert), str(pki.key),
                    responders={"/": switch_on_any_upgrade}).start()
    plain = RawServer("127.0.0.7", 80, responders={"/": switch_on_any_upgrade}).start()
    yield tls, plain
    tls.stop()
    plain.stop()


UPGRADES = {
    "foo": b"Connection: Upgrade\r\nUpgrade: foo\r\n",
    "h2c": (b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"),
    "H2C": (b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: H2C\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"),
}


@pytest.mark.parametrize("scheme", ["https", "http"])
@pytest.mark.parametrize("upgrade", list(UPGRADES))
def test_non_websocket_upgrade_refused(r2_proxy, upgrade_servers, scheme, upgrade):
    server = upgrade_servers[0] if scheme == "https" else upgrade_servers[1]
    n_req, n_conn = len(server.requests), len(server.raw)
    auth = proxy_auth("coding-agent", token(r2_proxy))
    if scheme == "https":
        raw_sock, head = open_tunnel(r2_proxy.host, r2_proxy.port, "up.r2.test:443", auth)
        assert b" 200 " in head.split(b"\r\n")[0], head
        s = tls_wrap(raw_sock, str(r2_proxy.ca), "up.r2.test", ["http/1.1"])
        req = b"GET /u HTTP/1.1\r\nHost: up.r2.test\r\n" + UPGRADES[upgrade] + b"\r\n"
    else:
        s = socket.create_connection((r2_proxy.host, r2_proxy.port), timeout=10)
        req = (b"GET http://up.r2.test/u HTTP/1.1\r\nHost: up.r2.test\r\n"
               b"Proxy-Authorization: " + auth.encode() + b"\r\n" + UPGRADES[upgrade] + b"\r\n")
    try:
        s.sendall(req)
        answer = recv_until_closed(s, 5, stop=b"\r\n\r\n")
        if b"\r\n\r\n" in answer and b"content-length" in answer.lower():
            answer += recv_until_closed(s, 1)
        try:  # what a client would do after a 101: speak the new protocol
            s.sendall(b"RAW-AFTER-UPGRADE\r\n\r\n")
        except OSError:
            pass
        time.sleep(0.3)
    finally:
        s.close()
    upgraded = [r for r in server.requests[n_req:] if r.header("upgrade")]
    assert not upgraded, "the upstream was asked to switch protocols"
    assert not any(b"RAW-AFTER-UPGRADE" in bytes(c) for c in server.raw[n_conn:]), \
        "raw bytes reached the upstream after an upgrade"
    status, _, body = split_response(answer)
    assert status.startswith(b"HTTP/1.1 400"), answer[:300]
    assert refusal_doc(body)["code"] == "bad_request"


def test_plain_get_through_the_upgrade_rule_allowed(r2_proxy, upgrade_servers):
    """Control: a plain GET without Upgrade through the same rule works (the refusal above is
    about the Upgrade, not the rule)."""
    out = h1_in_tunnel(r2_proxy, "coding-agent", token(r2_proxy), "up.r2.test:443",
                       b"GET /u HTTP/1.1\r\nHost: up.r2.test\r\nConnection: close\r\n\r\n")
    assert split_response(out)[0].startswith(b"HTTP/1.1 200"), out[:200]


# ---------------------------------------------------------------- helpers kept honest

def test_percent_forms_really_decode_to_the_value():
    """The encodings used above are what a client could send and decode (no test typo)."""
    for name, form in _forms().items():
        if name.startswith("percent"):
            assert urllib.parse.unquote(form.decode()) == ANTHROPIC_KEY
