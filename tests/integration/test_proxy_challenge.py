"""Clients that send proxy credentials only after a 407 challenge (curl --proxy-anyauth, Python's
urllib ProxyBasicAuthHandler; Java, .NET and Go clients, and Codex's CONNECT to github.com, do
the same): Sandgate's 407 carries `Proxy-Authenticate: Basic realm="sandgate"`, closes the
connection, and the client's retry (on a new connection) is identified. The challenge is
audited once, with decision `challenge` (not `deny`): a client that authenticates only when
asked is no refusal storm (docs/clients.md)."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import Proxy, split_status

pytestmark = pytest.mark.integration


def _anyauth(proxy: Proxy, identity: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """curl told to find out the proxy's scheme itself: its first request carries no
    credentials, and only a 407 naming Basic makes it send them."""
    cmd = ["curl", "-sS", "--max-time", "15", "--proxy", proxy.url, "--proxy-anyauth",
           "--proxy-user", f"{identity}:{proxy.token(identity)}", "--cacert", str(proxy.ca),
           "-w", "\n%{http_code}", "-v", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _challenges(proxy: Proxy, seen: int) -> list[dict]:
    return [e for e in proxy.audit()[seen:] if e.get("code") == "auth_required"]


def test_curl_proxy_anyauth_connect(proxy: Proxy, upstream) -> None:
    """A CONNECT without credentials, challenged, then sent again with them."""
    seen = len(proxy.audit())
    r = _anyauth(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200, r.stderr[-2000:]
    assert "407" in r.stderr and 'Proxy-Authenticate: Basic realm="sandgate"' in r.stderr
    (challenge,) = _challenges(proxy, seen)
    assert challenge["event"] == "connect" and challenge["decision"] == "challenge"
    allowed = proxy.wait_audit(lambda e: e.get("event") == "request"
                               and e.get("identity") == "coding-agent"
                               and e.get("path") == "/v1/messages")
    assert allowed["decision"] == "allow"


def test_curl_proxy_anyauth_plain_http_with_a_body(proxy: Proxy, plain_upstream) -> None:
    """An absolute-form request: its body is not read before the caller is known; the retry
    is identified and forwarded."""
    seen = len(proxy.audit())
    r = _anyauth(proxy, "coding-agent", "http://plain.test/anyauth")
    assert split_status(r.stdout)[1] == 200, r.stderr[-2000:]
    assert plain_upstream.seen[-1].path == "/anyauth"
    assert "proxy-authorization" not in plain_upstream.seen[-1].headers
    (challenge,) = _challenges(proxy, seen)
    assert challenge["event"] == "request" and challenge["decision"] == "challenge"


def test_curl_proxy_anyauth_post_body_is_sent_again_identified(proxy: Proxy,
                                                             plain_upstream) -> None:
    """A POST with a body: the challenged request's body is never read; curl sends it again
    with the credentials, and that request is judged as the identity's (here: no rule allows
    a POST to plain.test, so 403 for coding-agent, not another 407)."""
    r = _anyauth(proxy, "coding-agent", "http://plain.test/post", "-d", '{"x": 1}')
    body, status = split_status(r.stdout)
    assert status == 403, r.stderr[-2000:]
    doc = json.loads(body)
    assert doc["code"] == "no_rule" and doc["identity"] == "coding-agent"


def test_urllib_proxy_basic_auth_handler(proxy: Proxy, plain_upstream) -> None:
    """urllib answers a 407 and nothing else: it never sends credentials unasked."""
    password_mgr = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    password_mgr.add_password(None, proxy.url, "coding-agent", proxy.token("coding-agent"))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": proxy.url}),
        urllib.request.ProxyBasicAuthHandler(password_mgr))
    seen = len(proxy.audit())
    with opener.open("http://plain.test/urllib", timeout=15) as resp:
        assert resp.status == 200
    assert plain_upstream.seen[-1].path == "/urllib"
    (challenge,) = _challenges(proxy, seen)
    assert challenge["decision"] == "challenge"
    # without credentials to give, urllib gets the 407 itself
    bare = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
    with pytest.raises(urllib.error.HTTPError) as e:
        bare.open("http://plain.test/urllib", timeout=15)
    assert e.value.code == 407
    assert e.value.headers["Proxy-Authenticate"] == 'Basic realm="sandgate"'


def test_the_challenge_reads_no_body_and_closes(proxy: Proxy) -> None:
    """Bounded before trusted: a request without credentials that announces a body is
    answered 407 before the body is read, and the connection is closed (the client retries on
    a new one, credentials first)."""
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as s:
        # a body within every limit, announced and never sent: answered at once all the same
        s.sendall(b"POST http://plain.test/x HTTP/1.1\r\nHost: plain.test\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"x" * 1000)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("HTTP/1.1 407 ")
    assert 'Proxy-Authenticate: Basic realm="sandgate"' in head.replace("proxy-authenticate",
                                                                        "Proxy-Authenticate")
    assert "connection: close" in head.lower()


def test_wrong_credentials_are_a_refusal_not_a_challenge(proxy: Proxy, plain_upstream) -> None:
    """Credentials that were sent and are wrong: 407 auth_invalid, audited as the refusal."""
    seen = len(proxy.audit())
    bad = base64.b64encode(b"coding-agent:not-a-token").decode()
    r = subprocess.run(["curl", "-sS", "--max-time", "15", "--proxy", proxy.url, "-H",
                        f"Proxy-Authorization: Basic {bad}", "-w", "\n%{http_code}",
                        "http://plain.test/x"], capture_output=True, text=True, timeout=30)
    assert split_status(r.stdout)[1] == 407
    events = [e for e in proxy.audit()[seen:] if e.get("code") == "auth_invalid"]
    assert events and all(e["event"] == "request" and e["decision"] == "deny" for e in events)
