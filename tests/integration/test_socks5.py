"""The SOCKS5 listener (`sandgate run --socks5 HOST:PORT`, issue #12) with real clients.

curl `--socks5-hostname` and httpx with its SOCKS transport (socksio, the `clients` extra): an
injected call succeeds with a placeholder-only client; bash-tool is refused; no credentials, a
wrong or expired token and a source outside `--socks5-allow` are refused and audited; SNI and
target disagreement is refused. Names are resolved by Sandgate: nothing in the test namespace
resolves api.anthropic.com, only Sandgate's `--resolve` does. The attack classes shared with the
HTTP listener are in test_listeners.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    SECRET_VALUES,
    split_status,
)
from tests.support.listeners import (
    SOCKS5_OUTSIDE_SOURCE,
    Listener,
    dual_proxy_running,
    make_listener,
    recv_exact,
    socks5_open,
)
from tests.support.sdk import CLIENT_PY
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def socks(tmp_path_factory, vault, upstream, plain_upstream, pki):
    for proxy in dual_proxy_running(tmp_path_factory, vault, pki):
        yield make_listener("socks5", proxy)

# httpx with its SOCKS transport (socksio, the `clients` extra): prints {"status", "body"} or
# {"error"}.
HTTPX_SCRIPT = """
import json, ssl, sys
import httpx
proxy, ca, url, key = sys.argv[1:5]
try:
    with httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=ca),
                      timeout=15) as c:
        r = c.post(url, json={"model": "m"}, headers={"x-api-key": key})
    print(json.dumps({"status": r.status_code, "body": r.text}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__}))
"""


def _httpx(socks: Listener, identity: str, url: str) -> dict:
    proxy = f"socks5://{identity}:{socks.proxy.token(identity)}@{socks.host}:{socks.port}"
    r = subprocess.run([str(CLIENT_PY), "-c", HTTPX_SCRIPT, proxy, str(socks.proxy.ca), url,
                        "sandgate-placeholder-anthropic"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the httpx client")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _mark(socks: Listener) -> int:
    return len(socks.proxy.audit())


def _wait_new(socks: Listener, mark: int, pred, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in socks.proxy.audit()[mark:]:
            if ev.get("listener") == "socks5" and pred(ev):
                return ev
        time.sleep(0.05)
    raise AssertionError("no matching audit event from the SOCKS5 listener")


def test_curl_socks5_hostname_injected_call(socks, upstream):
    before, mark = len(upstream.seen), _mark(socks)
    r = socks.curl("coding-agent", "https://api.anthropic.com/v1/messages",
                   "-H", "x-api-key: sandgate-placeholder-anthropic", "-d", "{}")
    status = split_status(r.stdout)[1]
    assert status == 200, r.stdout + r.stderr
    seen = upstream.seen[before:]
    assert len(seen) == 1
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert "proxy-authorization" not in seen[0].headers
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "curl")
    connect = _wait_new(socks, mark, lambda e: e["event"] == "connect")
    assert connect["decision"] == "allow" and connect["rule"] == "llm"
    assert connect["host"] == "api.anthropic.com" and connect["method"] == "CONNECT"
    assert connect["identity_source"] == "token"
    req = _wait_new(socks, mark, lambda e: e["event"] == "request")
    assert req["secrets"][0].startswith("anthropic@") and req["dialed"] == "127.0.0.2:443"


def test_httpx_socks_transport_injected_call(socks, upstream):
    before = len(upstream.seen)
    out = _httpx(socks, "coding-agent", "https://api.anthropic.com/v1/messages")
    assert out.get("status") == 200, out
    seen = upstream.seen[before:]
    assert len(seen) == 1
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")


def test_httpx_bash_tool_refused(socks, upstream):
    before = len(upstream.seen)
    out = _httpx(socks, "bash-tool", "https://api.anthropic.com/v1/messages")
    assert out.get("status") == 403, out
    doc = json.loads(out["body"])
    assert doc["code"] == "no_rule" and doc["identity"] == "bash-tool"
    assert len(upstream.seen) == before


def test_curl_bash_tool_refused(socks, upstream):
    before, mark = len(upstream.seen), _mark(socks)
    r = socks.curl("bash-tool", "https://api.anthropic.com/v1/messages", "-d", "{}")
    body, status = split_status(r.stdout)
    assert status == 403
    assert json.loads(body)["code"] == "no_rule"
    assert len(upstream.seen) == before
    ev = _wait_new(socks, mark, lambda e: e["event"] == "connect")
    assert ev["decision"] == "deny" and ev["code"] == "no_rule"


def test_no_credentials_refused_and_audited(socks, upstream):
    before, mark = len(upstream.seen), _mark(socks)
    r = socks.curl(None, "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert r.returncode != 0 and split_status(r.stdout)[1] == 0, r.stdout
    ev = _wait_new(socks, mark, lambda e: e.get("code") == "auth_required")
    assert ev["event"] == "connect" and ev["decision"] == "deny"
    # by hand: a client offering only "no authentication" is told no method is acceptable
    s = socket.create_connection((socks.host, socks.port), timeout=10)
    s.sendall(b"\x05\x01\x00")
    assert recv_exact(s, 2) == b"\x05\xff"
    assert s.recv(100) == b""  # and closed
    s.close()
    assert len(upstream.seen) == before


@pytest.mark.parametrize("case", ["bad-signature", "other-identity", "expired", "empty-user"])
def test_wrong_token_refused_and_audited(socks, upstream, case):
    before, mark = len(upstream.seen), _mark(socks)
    user, token = "coding-agent", "sg1.bad.sig"
    if case == "other-identity":
        token = socks.proxy.token("bash-tool")
    elif case == "expired":
        token = socks.proxy.token("coding-agent", ttl="1s")
        time.sleep(2.1)
    elif case == "empty-user":
        user, token = "", socks.proxy.token("coding-agent")
    s, reply = socks5_open((socks.host, socks.port), user, token, "api.anthropic.com", 443)
    s.close()
    assert reply is None  # refused at authentication, before any CONNECT
    r = socks.curl(user, "https://api.anthropic.com/v1/messages", "-d", "{}", token=token)
    assert r.returncode != 0 and split_status(r.stdout)[1] == 0
    ev = _wait_new(socks, mark, lambda e: e.get("code") == "auth_invalid")
    assert ev["event"] == "connect" and ev["decision"] == "deny"
    assert len(upstream.seen) == before
    assert token not in json.dumps(socks.proxy.audit()[mark:])


def test_source_outside_socks5_allow_refused_before_handshake(socks, upstream):
    before, mark = len(upstream.seen), _mark(socks)
    s = socket.create_connection((socks.host, socks.port), timeout=10,
                                 source_address=(SOCKS5_OUTSIDE_SOURCE, 0))
    # closed without a byte sent by the client: the check is at connect
    assert s.recv(100) == b""
    s.close()
    r = socks.curl("coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}",
                   "--interface", SOCKS5_OUTSIDE_SOURCE)
    assert r.returncode != 0 and split_status(r.stdout)[1] == 0
    ev = _wait_new(socks, mark, lambda e: e.get("code") == "auth_invalid")
    assert ev["client"].startswith(SOCKS5_OUTSIDE_SOURCE + ":")
    assert "--socks5-allow" in ev["reason"]
    assert len(upstream.seen) == before


def test_http_listener_is_not_restricted_by_socks5_allow(socks, upstream):
    p = socks.proxy
    r = subprocess.run(["curl", "-sS", "--max-time", "15", "--proxy", p.url, "--proxy-user",
                        f"coding-agent:{p.token('coding-agent')}", "--cacert", str(p.ca),
                        "--interface", SOCKS5_OUTSIDE_SOURCE, "-w", "\n%{http_code}",
                        "https://upstream.test/page"], capture_output=True, text=True)
    assert split_status(r.stdout)[1] == 200, r.stderr


def test_sni_disagreeing_with_socks_target_refused(socks, upstream):
    # curl asks SOCKS5 for upstream.test but speaks TLS (SNI, Host) for api.anthropic.com
    before = len(upstream.seen)
    r = socks.curl("coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}",
                   "--connect-to", "api.anthropic.com:443:upstream.test:443")
    body, status = split_status(r.stdout)
    assert status == 400, r.stdout + r.stderr
    assert json.loads(body)["code"] == "bad_request" and "disagrees" in body
    assert len(upstream.seen) == before


def _plain_get_in_tunnel(listener: Listener) -> bytes:
    s = listener.open_tunnel("coding-agent", "plain.test", 80)
    s.sendall(b"GET /hello HTTP/1.1\r\nHost: plain.test\r\nConnection: close\r\n\r\n")
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_plain_http_through_socks_is_handled_as_in_a_connect_tunnel(socks, plain_upstream):
    # curl sends plain HTTP inside the SOCKS5 tunnel: judged exactly as plain HTTP inside an
    # HTTP CONNECT tunnel (not as the HTTP listener's absolute-form requests), never forwarded.
    before = len(plain_upstream.seen)
    r = socks.curl("coding-agent", "http://plain.test/hello")
    body, status = split_status(r.stdout)
    assert status == 403, r.stdout + r.stderr
    code = json.loads(body)["code"]
    http = Listener("http", socks.proxy.host, socks.proxy.port, socks.proxy)
    via_connect = _plain_get_in_tunnel(http)
    via_socks = _plain_get_in_tunnel(socks)
    assert via_connect.startswith(b"HTTP/1.1 403") and via_socks.startswith(b"HTTP/1.1 403")
    body_c = via_connect.partition(b"\r\n\r\n")[2]
    body_s = via_socks.partition(b"\r\n\r\n")[2]
    assert json.loads(body_c)["code"] == json.loads(body_s)["code"] == code
    assert len(plain_upstream.seen) == before


def test_unjudgeable_target_gets_a_socks_refusal(socks):
    mark = _mark(socks)
    tok = socks.proxy.token("coding-agent")
    s, reply = socks5_open((socks.host, socks.port), "coding-agent", tok, "bad host!", 443)
    s.close()
    assert reply == 0x02  # connection not allowed by ruleset
    ev = _wait_new(socks, mark, lambda e: e["event"] == "connect")
    assert ev["code"] == "bad_request" and ev["decision"] == "deny"


def test_commands_other_than_connect_refused(socks):
    tok = socks.proxy.token("coding-agent")
    s = socket.create_connection((socks.host, socks.port), timeout=10)
    s.sendall(b"\x05\x01\x02")
    assert recv_exact(s, 2) == b"\x05\x02"
    u, p = b"coding-agent", tok.encode()
    s.sendall(b"\x01" + bytes([len(u)]) + u + bytes([len(p)]) + p)
    assert recv_exact(s, 2) == b"\x01\x00"
    s.sendall(b"\x05\x03\x00\x01\x00\x00\x00\x00\x00\x00")  # UDP ASSOCIATE
    reply = recv_exact(s, 10)
    s.close()
    assert reply[:2] == b"\x05\x07"  # command not supported


def test_tokens_fit_socks5_password_field(socks):
    # RFC 1929 carries at most 255 bytes of password
    tok = socks.proxy.token("coding-agent", sandbox="a-rather-long-sandbox-id-0123456789")
    assert len(tok.encode()) <= 255
