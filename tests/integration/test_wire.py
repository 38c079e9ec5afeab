"""The wire: 1xx answers, a request without Host, self addresses, TLS to the proxy port.

Real parts: `sandgate run` with its admin API, a scripted HTTP/1 upstream over real TLS
(tests/support/rawupstream.py), curl as the client. Fixed addresses (run in a network
namespace): 127.0.44.2:443 raw.wire.test / pass.wire.test, the admin API on 127.0.0.1:9444.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import HERE, Proxy, split_status, start_proxy, stop_proxy
from tests.support.rawupstream import RawRequest, RawServer
from tests.support.round2 import refusal_doc, token, vault_env, wait_new_audit
from tests.support.tunnel import h1_in_tunnel, open_tunnel, proxy_auth

pytestmark = pytest.mark.integration

RAW_IP = "127.0.44.2"
ADMIN = ("127.0.0.1", 9444)
ADMIN_TOKEN = "test-admin-token-wire-4"
RESOLVE = {
    "raw.wire.test": RAW_IP,
    "get.wire.test": RAW_IP,
    "pass.wire.test": RAW_IP,
    "zero.wire.test": "0.0.0.0",
    "zero6.wire.test": "::",
    "zeromap.wire.test": "::ffff:0.0.0.0",
    "self.wire.test": "127.0.0.1",
}
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nContent-Type: text/plain\r\n\r\nfinal\n"


def _echo_host(req: RawRequest) -> bytes:
    body = f"host={req.header('host')}\n".encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


RESPONDERS = {
    "/continue": lambda _r: b"HTTP/1.1 100 Continue\r\n\r\n" + FINAL,
    "/hints": lambda _r: (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                          + FINAL),
    "/both": lambda _r: (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"
                         b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" + FINAL),
    "/host": _echo_host,
    # a chunk size past any index (h11 0.14 reads any number of hex digits)
    "/overflowing-chunk": lambda _r: (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                      b"Content-Type: text/plain\r\n\r\n"
                                      b"10000000000000005\r\nabc\r\n"),
}


@pytest.fixture(scope="module")
def raw(pki) -> Iterator[RawServer]:
    s = RawServer(RAW_IP, 443, str(pki.cert), str(pki.key), responders=RESPONDERS).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def wire_proxy(tmp_path_factory, vault, pki, raw) -> Iterator[Proxy]:
    env = {**vault_env(vault), "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    p = start_proxy(tmp_path_factory.mktemp("wire"), HERE / "policies_wire", env, pki,
                    *[f"--resolve={n}={ip}" for n, ip in RESOLVE.items()],
                    "--admin", f"{ADMIN[0]}:{ADMIN[1]}")
    yield p
    stop_proxy(p)


def _curl(proxy: Proxy, pki, url: str, *args: str, max_time: float = 8,
          proxy_url: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["curl", "-sS", "--max-time", str(max_time), "--proxy", proxy_url or proxy.url,
           "--proxy-user", f"coding-agent:{token(proxy)}", "--cacert", str(proxy.ca),
           "-w", "\n%{http_code}", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=max_time + 10)


# ---------------------------------------------------------------- 1xx from the upstream

@pytest.mark.parametrize("path", ["/continue", "/hints", "/both"])
def test_interim_responses_are_dropped_and_the_final_one_arrives(wire_proxy, pki, path):
    r = _curl(wire_proxy, pki, f"https://raw.wire.test{path}")
    body, status = split_status(r.stdout)
    assert (status, body) == (200, "final\n"), r.stderr


# ---------------------------------------------------------------- HTTP/1.0 without Host

def test_http10_without_host_is_forwarded_with_the_judged_host(wire_proxy, raw):
    before = len(raw.requests)
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443",
                       b"GET /host HTTP/1.0\r\n\r\n")
    assert out.split(b"\r\n", 1)[0].endswith(b"200 OK"), out[:200]
    assert b"host=raw.wire.test\n" in out
    new = raw.requests[before:]
    assert [r.header("host") for r in new] == ["raw.wire.test"]


# ---------------------------------------------------------------- self addresses

def _admin_reachable() -> None:
    """The admin API is up on ADMIN (so a refusal below is Sandgate's, not a dead port)."""
    r = subprocess.run(["curl", "-sS", "--max-time", "5", "-o", "/dev/null", "-w",
                        "%{http_code}", f"http://{ADMIN[0]}:{ADMIN[1]}/healthz"],
                       capture_output=True, text=True, timeout=15)
    assert r.stdout == "200", r.stderr


@pytest.mark.parametrize("name", ["zero.wire.test", "zero6.wire.test", "zeromap.wire.test"])
def test_unspecified_address_is_self_whatever_private_cidrs_say(wire_proxy, pki, name):
    _admin_reachable()
    r = _curl(wire_proxy, pki, f"http://{name}:{ADMIN[1]}/healthz")
    body, status = split_status(r.stdout)
    assert status == 403, (status, body[:200], r.stderr)
    doc = refusal_doc(body)
    assert doc["code"] == "self_address"


def test_passthrough_connect_to_the_admin_port_refused_at_connect(wire_proxy):
    _admin_reachable()
    s, head = open_tunnel(wire_proxy.host, wire_proxy.port, f"self.wire.test:{ADMIN[1]}",
                          proxy_auth("coding-agent", token(wire_proxy)))
    s.close()
    status = head.split(b"\r\n", 1)[0]
    assert b" 403 " in status, head[:300]
    assert b"self_address" in head


def test_passthrough_still_dials_the_address_checked_at_connect(wire_proxy, pki):
    r = _curl(wire_proxy, pki, "https://pass.wire.test/x", "--cacert", str(pki.ca_cert))
    body, status = split_status(r.stdout)
    assert (status, body) == (200, "ok\n"), r.stderr


# ---------------------------------------------------------------- TLS to the proxy port

def test_tls_to_the_proxy_port_passthrough_works(wire_proxy, pki):
    """curl --proxy https://: the tunnel runs inside TLS to Sandgate; the passthrough relay
    must hand the upstream the inner bytes, not the outer TLS records."""
    url = f"https://{wire_proxy.host}:{wire_proxy.port}"
    for _ in range(3):  # several requests: the lean relay engaged after the first chunk
        r = _curl(wire_proxy, pki, "https://pass.wire.test/x", "--cacert", str(pki.ca_cert),
                  "--proxy-cacert", str(wire_proxy.ca), proxy_url=url)
        body, status = split_status(r.stdout)
        assert (status, body) == (200, "ok\n"), r.stderr
        time.sleep(0.1)


def test_tls_to_the_proxy_port_intercepted_request_works(wire_proxy, pki):
    url = f"https://{wire_proxy.host}:{wire_proxy.port}"
    r = _curl(wire_proxy, pki, "https://raw.wire.test/host", "--proxy-cacert",
              str(wire_proxy.ca), proxy_url=url)
    body, status = split_status(r.stdout)
    assert (status, body) == (200, "host=raw.wire.test\n"), r.stderr


# ---------------------------------------------------------------- readable refusals

BIG_HEADER = "x" * (256 * 1024)


@pytest.mark.parametrize("url,version", [("https://raw.wire.test/host", "--http1.1"),
                                         ("http://raw.wire.test/host", "--http1.1")],
                         ids=["in-tunnel-h1", "proxied"])
def test_huge_request_header_gets_a_readable_431(wire_proxy, pki, raw, url, version,
                                                 tmp_path):
    """256 KiB in one header: 431 with the JSON body, never a reset. (curl cannot send a header
    block over 64 KiB on HTTP/2 at all: its nghttp2 refuses the stream itself, REFUSED_STREAM,
    before a byte reaches the proxy; the HTTP/2 case is the h2 test below.)"""
    before = len(raw.requests)
    headers = tmp_path / "headers.txt"
    headers.write_text(f"X-Big: {BIG_HEADER}\n")
    r = _curl(wire_proxy, pki, url, "-H", f"@{headers}", version)
    body, status = split_status(r.stdout)
    assert status == 431, (status, r.stderr)
    assert refusal_doc(body)["code"] == "headers_too_large"
    assert len(raw.requests) == before


@pytest.mark.parametrize("path", [b"/x/../host", b"/x/..%2Fhost", b"/x/%2e%2e/host",
                                  b"/./host"])
def test_a_dot_segment_is_refused_not_judged_resolved(wire_proxy, raw, path):
    """Judged as /host, the request would go on as sent: an upstream that does not resolve dot
    segments acts on another path than the one judged. Refused, readable, nothing sent."""
    before = len(raw.requests)
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443",
                       b"GET " + path + b" HTTP/1.1\r\nHost: raw.wire.test\r\n\r\n")
    assert out.split(b"\r\n", 1)[0] == b"HTTP/1.1 400 Bad Request", out[:300]
    doc = refusal_doc(out.split(b"\r\n\r\n", 1)[1].decode())
    assert doc["code"] == "bad_request" and "segment" in doc["reason"]
    assert len(raw.requests) == before


@pytest.mark.parametrize("size", [b"10000000000000005", b"ffffffffffffffffffff"])
def test_overflowing_chunk_size_gets_a_readable_400(wire_proxy, raw, size):
    """A request body whose chunk size does not fit an index: 400 `bad_request` with the JSON
    body, and nothing reaches the upstream (before: no answer at all, the connection died)."""
    before = len(raw.requests)
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443",
                       b"POST /host HTTP/1.1\r\nHost: raw.wire.test\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n")
    assert out.split(b"\r\n", 1)[0] == b"HTTP/1.1 400 Bad Request", out[:300]
    assert refusal_doc(out.split(b"\r\n\r\n", 1)[1].decode())["code"] == "bad_request"
    assert len(raw.requests) == before


def test_overflowing_chunk_size_from_the_upstream_ends_the_stream_at_once(wire_proxy, pki):
    """The head has gone out (a chunked body streams), so the body can only be cut: at once,
    with nothing of it relayed, and the audit names the error (before: the bytes after the
    size line were relayed and the client waited for the rest of 2**64 bytes)."""
    mark = len(wire_proxy.audit())
    r = _curl(wire_proxy, pki, "https://raw.wire.test/overflowing-chunk", "--http1.1")
    body, _status = split_status(r.stdout)
    assert r.returncode not in (0, 28), (r.returncode, r.stderr)  # cut, not a timeout
    assert "abc" not in body
    ev = wait_new_audit(wire_proxy, mark, lambda e: e.get("event") == "request"
                        and e.get("path") == "/overflowing-chunk")
    assert "chunk size" in (ev.get("error") or ""), ev.get("error")


def test_huge_http2_header_block_gets_a_readable_431_on_its_stream(wire_proxy, raw):
    """Over HTTP/2 (h2 as the client, inside a tunnel) a 256 KiB header block is decoded and
    answered 431 with the JSON body on its stream; before, it ended the connection (GOAWAY)."""
    from tests.support.tunnel import h2_request

    before = len(raw.requests)
    res = h2_request(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443", [
        (b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"raw.wire.test"),
        (b":path", b"/host"), (b"x-big", BIG_HEADER.encode())])
    assert res.terminated is None and res.reset is None, (res.terminated, res.reset)
    assert res.status == 431, res
    assert refusal_doc(res.body.decode())["code"] == "headers_too_large"
    assert len(raw.requests) == before


def test_huge_request_header_readable_with_requests(wire_proxy):
    import requests

    auth = f"coding-agent:{token(wire_proxy)}"
    proxy = f"http://{auth}@{wire_proxy.host}:{wire_proxy.port}"
    r = requests.get("http://raw.wire.test/host", headers={"X-Big": BIG_HEADER},
                     proxies={"http": proxy}, timeout=15)
    assert r.status_code == 431
    assert refusal_doc(r.text)["code"] == "headers_too_large"


def test_expect_continue_to_a_denied_target_is_refused_before_the_body(wire_proxy, raw):
    """No `100 Continue` for a refused request: the 403 comes first, the body never sent."""
    before = len(raw.requests)
    head = (b"POST /upload HTTP/1.1\r\nHost: get.wire.test\r\nContent-Length: 1000\r\n"
            b"Expect: 100-continue\r\n\r\n")
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "get.wire.test:443",
                       head, timeout=10)
    status = out.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 403"), out[:300]
    assert refusal_doc(out.partition(b"\r\n\r\n")[2])["code"] == "no_rule"
    assert len(raw.requests) == before


def test_expect_continue_with_a_large_body_gets_its_403_with_curl(wire_proxy, pki, raw,
                                                                  tmp_path):
    """curl waits for 100 Continue (up to --expect100-timeout) before the 1 MiB body; the
    refusal arrives instead (before: the flow was killed, an empty reply)."""
    data = tmp_path / "body.bin"
    data.write_bytes(b"a" * (1024 * 1024))
    before = len(raw.requests)
    r = _curl(wire_proxy, pki, "https://get.wire.test/upload", "--data-binary", f"@{data}",
              "-H", "Expect: 100-continue", "--expect100-timeout", "30")
    body, status = split_status(r.stdout)
    assert status == 403, (status, r.stderr)
    assert refusal_doc(body)["code"] == "no_rule"
    assert len(raw.requests) == before


def test_refused_head_with_a_body_streaming_gets_its_403(wire_proxy, pki, raw, tmp_path):
    """No Expect: the client sends 1 MiB at once; it still reads the refusal."""
    data = tmp_path / "body.bin"
    data.write_bytes(b"a" * (1024 * 1024))
    r = _curl(wire_proxy, pki, "https://get.wire.test/upload", "--data-binary", f"@{data}",
              "-H", "Expect:")
    body, status = split_status(r.stdout)
    assert status == 403, (status, r.stderr)
    assert refusal_doc(body)["code"] == "no_rule"


def test_quoted_crlf_in_a_chunk_extension_gets_a_readable_400(wire_proxy, raw):
    before = len(raw.requests)
    req = (b"POST /host HTTP/1.1\r\nHost: raw.wire.test\r\nTransfer-Encoding: chunked\r\n"
           b"\r\n5;ext=\"a\r\nb\"\r\nhello\r\n0\r\n\r\n")
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443", req)
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    assert refusal_doc(out.partition(b"\r\n\r\n")[2])["code"] == "bad_request"
    assert len(raw.requests) == before


# ---------------------------------------------------------------- CONNECT streams over HTTP/2

@pytest.mark.parametrize("rfc9113", [True, False], ids=["rfc9113", "scheme-and-path"])
def test_an_http2_connect_to_the_proxy_port_gets_no_tunnel(wire_proxy, rfc9113):
    """TLS + h2 to the proxy port, a CONNECT stream: mitmproxy 12.3.1 with h2 4.4 serves no
    CONNECT over HTTP/2. h2 refuses a CONNECT block with :scheme and :path (RFC 9113 8.5),
    mitmproxy's request parser one without them (it needs :scheme); either ends the whole
    connection, and no tunnel is granted or judged. (mitmproxy 11.0.2 with h2 4.1 answered the
    second spelling 200, and several streams of one connection could each be a tunnel:
    mitm/guards/tunnels.py keeps one record per CONNECT stream, and pins that parser, so a
    mitmproxy that serves them again is looked at.)"""
    from tests.support.h2tunnels import H2Proxy

    auth = proxy_auth("coding-agent", token(wire_proxy))
    mark = len(wire_proxy.audit())
    c = H2Proxy(wire_proxy.host, wire_proxy.port, str(wire_proxy.ca))
    try:
        with pytest.raises(ConnectionError):  # closed or reset: no answer on the stream
            st = c.connect("raw.wire.test:443", auth, rfc9113=rfc9113)
            assert st.status is None
            c.pump(1.0)
    finally:
        c.close()
    time.sleep(0.3)
    assert not [e for e in wire_proxy.audit()[mark:]
                if e.get("event") in ("connect", "request") and e.get("decision") == "allow"]


# ---------------------------------------------------------------- h11 0.16 and h2 4.4

def test_a_chunk_without_its_crlf_never_reaches_the_upstream(wire_proxy, raw):
    """A chunked request body whose chunk is followed by two bytes other than CRLF: h11 0.14
    (mitmproxy 11's) skipped any two bytes there, so "1\\r\\naXY0..." read as the body "a",
    while a server that counts differently could read a second request out of the same bytes
    (CVE-2025-43859). h11 0.16 refuses it: the request is answered 400 and never forwarded."""
    before = len(raw.requests)
    out = h1_in_tunnel(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443",
                       b"POST /host HTTP/1.1\r\nHost: raw.wire.test\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n"
                       b"1\r\naXY0\r\n\r\n", timeout=5)
    assert out.split(b"\r\n", 1)[0].startswith(b"HTTP/1.1 400 "), out[:200]
    assert refusal_doc(out.partition(b"\r\n\r\n")[2].decode())["code"] == "bad_request"
    assert len(raw.requests) == before


def test_an_http2_request_with_two_host_headers_never_reaches_the_upstream(wire_proxy, raw):
    """Inside a tunnel, HTTP/2 (forwarded to the HTTP/1.1 upstream) with :authority and two
    `host` fields that disagree: h2 4.4.1 refuses the header block (a malformed request);
    Sandgate's own head checks refused it before as well. Either way nothing is forwarded."""
    from tests.support.tunnel import h2_request

    before = len(raw.requests)
    res = h2_request(wire_proxy, "coding-agent", token(wire_proxy), "raw.wire.test:443", [
        (b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"raw.wire.test"),
        (b":path", b"/host"), (b"host", b"raw.wire.test"), (b"host", b"get.wire.test")],
        timeout=5)
    assert res.status != 200, res
    assert b"host=" not in res.body
    assert len(raw.requests) == before
