"""The proxy end to end: real sandgate process, real OpenBao, real TLS upstream, real curl."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    GITHUB_TOKEN,
    OPENAI_KEY,
    SECRET_VALUES,
    curl,
    split_status,
)
from tests.support.secrets import assert_no_secret, assert_secret_equal, assert_secret_in
from tests.support.tunnel import granted_tunnel, recv_until_closed

pytestmark = pytest.mark.integration

# Case tables, also run over every listener by tests/integration/test_listeners.py.
PATH_TRICKS = ["/docs/../admin/x", "/docs/%2e%2e/admin/x", "//admin/x", "/docs/..%2fadmin/x"]
ADDRESS_SPELLINGS = [
    "127.0.0.1", "127.1", "0x7f000001", "2130706433", "0177.0.0.1", "[::1]",
    "[::ffff:127.0.0.1]", "169.254.169.254", "10.0.0.1", "100.64.0.1", "[fd00::1]",
]
HOST_TRICKS = [
    "https://api.anthropic.com.evil.test/v1/messages",
    "https://API.ANTHROPIC.COM:8443/v1/messages",
    "https://xn--pi-anthropic-xyz.com/v1/messages",
]
INTERNAL_NAMES = ["inside.test", "meta.test"]  # --resolve'd to 10.1.2.3 and 169.254.169.254
TUNNEL_DISAGREEMENTS = [
    ("upstream.test", "upstream.test", "api.anthropic.com"),  # Host disagrees
    ("upstream.test", "api.anthropic.com", "upstream.test"),  # SNI disagrees
    ("upstream.test", "upstream.test", "upstream.test:8443"),  # port disagrees
]


def _no_secret(*texts: str) -> None:
    assert_no_secret(texts, SECRET_VALUES, "the client side")


def _refusal(body: str) -> dict:
    doc = json.loads(body)
    assert doc["error"] == "sandgate_refused"
    return doc


def test_llm_call_gets_real_key_injected(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "-H", "x-api-key: sandgate-placeholder-anthropic", "-d", '{"model":"m"}',
             "-H", "content-type: application/json")
    body, status = split_status(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert "hello from the test upstream" in body
    seen = upstream.seen[before:]
    assert len(seen) == 1
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert "proxy-authorization" not in seen[0].headers
    assert seen[0].host == "api.anthropic.com"
    _no_secret(r.stdout, r.stderr)
    ev = proxy.wait_audit(lambda e: e.get("path") == "/v1/messages" and e["decision"] == "allow")
    assert ev["identity"] == "coding-agent"
    assert ev["rule"] == "llm"
    assert ev["secrets"] and ev["secrets"][0].startswith("anthropic@")
    assert ev["upstream_status"] == 200
    assert ev["dialed"] == "127.0.0.2:443"


def test_injection_replaces_client_header_never_duplicates(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
             "-H", "X-Api-Key: whatever-the-client-had", "-d", "{}")
    assert split_status(r.stdout)[1] == 200
    seen = upstream.seen[before:][0]
    assert_secret_equal(seen.headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    raw = [k for k in seen.headers if k == "x-api-key"]
    assert len(raw) == 1


def test_bash_tool_refused_llm_host_with_readable_reason(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "bash-tool", "https://api.anthropic.com/v1/messages", "-d", "{}")
    # The CONNECT is refused by policy, but answered inside the tunnel: curl (like most
    # clients) would hide a CONNECT response body from the agent.
    body, status = split_status(r.stdout)
    assert status == 403
    doc = _refusal(body)
    assert doc["identity"] == "bash-tool" and doc["code"] == "no_rule"
    assert "api.anthropic.com" in doc["reason"] and doc["hint"]
    assert len(upstream.seen) == before
    ev = proxy.wait_audit(lambda e: e.get("identity") == "bash-tool" and
                          e.get("host") == "api.anthropic.com")
    assert ev["decision"] == "deny"
    assert ev["code"] == "no_rule"


def test_refusal_body_inside_tunnel_is_agent_readable(proxy, upstream):
    # bash-tool may reach upstream.test (docs), so the CONNECT passes and the inner POST is refused
    before = len(upstream.seen)
    r = curl(proxy, "bash-tool", "https://upstream.test/docs/a", "-X", "POST", "-i")
    body, status = split_status(r.stdout)
    assert status == 403
    head, _, payload = body.partition("\n\n{")
    payload = "{" + payload
    assert "x-sandgate-reason: no_rule" in head.lower()
    doc = _refusal(payload)
    assert doc["identity"] == "bash-tool"
    assert "POST" in doc["reason"] and "upstream.test" in doc["reason"]
    assert doc["hint"]
    assert len(upstream.seen) == before


def test_same_request_allowed_for_agent_tool_refused_for_bash_tool(proxy, upstream):
    ok = curl(proxy, "coding-agent", "https://upstream.test/page")
    assert split_status(ok.stdout)[1] == 200
    before = len(upstream.seen)
    no = curl(proxy, "bash-tool", "https://upstream.test/page")
    assert split_status(no.stdout)[1] == 403
    assert len(upstream.seen) == before


def test_each_keepalive_request_judged_on_its_own(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "bash-tool", "https://upstream.test/docs/one", "--next",
             "--proxy", proxy.url, "--proxy-user", f"bash-tool:{proxy.token('bash-tool')}",
             "--cacert", str(proxy.ca), "-w", "\n%{http_code}", "https://upstream.test/secret")
    assert r.stdout.count("200") >= 1 and "403" in r.stdout
    paths = [s.path for s in upstream.seen[before:]]
    assert paths == ["/docs/one"]


def test_explicit_deny_wins(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://upstream.test/admin/users")
    body, status = split_status(r.stdout)
    assert status == 403
    assert _refusal(body)["code"] == "denied_by_rule"
    assert len(upstream.seen) == before


@pytest.mark.parametrize("path", PATH_TRICKS)
def test_path_tricks_normalised_before_matching(proxy, upstream, path):
    """Refused, never forwarded: a dot segment as 400 bad_request whatever the rules (judged
    resolved, it would go on as sent), `//admin` by the deny rule it resolves to."""
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", f"https://upstream.test{path}", "--path-as-is")
    body, status = split_status(r.stdout)
    if ".." in path or "%2e" in path:
        assert (status, _refusal(body)["code"]) == (400, "bad_request")
    else:
        assert (status, _refusal(body)["code"]) == (403, "denied_by_rule")
    assert len(upstream.seen) == before


def test_missing_or_bad_proxy_auth_gets_407(proxy):
    r = curl(proxy, None, "https://api.anthropic.com/v1/messages", "-i")
    assert "407" in r.stdout or "407" in r.stderr
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", token="sg1.bad.sig")
    assert "407" in r.stdout or "407" in r.stderr
    # a valid token for another identity, presented under this name
    other = proxy.token("bash-tool")
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", token=other)
    assert "407" in r.stdout or "407" in r.stderr


def test_expired_token_refused(proxy):
    tok = proxy.token("coding-agent", ttl="1s")
    time.sleep(2.1)
    r = curl(proxy, "coding-agent", "https://upstream.test/page", token=tok)
    assert "407" in r.stdout or "407" in r.stderr


def test_token_issued_while_running_is_accepted(proxy):
    tok = proxy.token("bash-tool", sandbox="sbx-123")
    r = curl(proxy, "sbx-123", "https://upstream.test/docs/x", token=tok)
    assert split_status(r.stdout)[1] == 200
    ev = proxy.wait_audit(lambda e: e.get("sandbox") == "sbx-123")
    assert ev["identity"] == "bash-tool"


def test_upstream_echoing_key_is_scrubbed_in_headers_and_split_body(proxy, upstream):
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/echo-key", "-i")
    body, status = split_status(r.stdout)
    assert status == 200
    assert_secret_equal(upstream.seen[-1].headers.get("x-api-key"), ANTHROPIC_KEY,
                        "upstream x-api-key")
    _no_secret(r.stdout, r.stderr)
    assert "[REDACTED" in body or "***" in body
    # the upstream tried to forge Sandgate's reason header: stripped
    assert "x-sandgate-reason" not in body.lower()


def test_placeholder_sent_to_unbound_host_is_exfiltration(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://upstream.test/page",
             "-H", "authorization: Bearer sandgate-placeholder-anthropic")
    body, status = split_status(r.stdout)
    assert status == 403
    assert _refusal(body)["code"] == "exfiltration"
    assert len(upstream.seen) == before
    ev = proxy.wait_audit(lambda e: e.get("code") == "exfiltration")
    assert ev["exfiltration"]


def test_real_value_sent_elsewhere_is_exfiltration(proxy, upstream):
    # warm the cache so Sandgate knows the value
    curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://upstream.test/page?k=" + ANTHROPIC_KEY)
    assert split_status(r.stdout)[1] == 403
    assert len(upstream.seen) == before
    _no_secret(proxy.audit_file.read_text())


def test_placeholder_substituted_on_bound_request(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://api.openai.com/v1/chat/completions", "-d", "{}",
             "-H", "authorization: Bearer sandgate-placeholder-openai")
    assert split_status(r.stdout)[1] == 200
    assert_secret_equal(upstream.seen[before].headers.get("authorization"),
                        f"Bearer {OPENAI_KEY}", "upstream authorization")


def test_basic_and_query_injection_from_kv1(proxy, upstream):
    import base64

    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://upstream.test/github/repos?access_token=mine&x=1")
    assert split_status(r.stdout)[1] == 200
    seen = upstream.seen[before]
    user, _, pw = base64.b64decode(seen.headers["authorization"][6:]).decode().partition(":")
    assert user == "x-access-token"
    assert_secret_equal(pw, GITHUB_TOKEN, "basic password")
    assert_secret_in(seen.query, f"access_token={GITHUB_TOKEN}", "injected query")
    assert "x=1" in seen.query
    assert "mine" not in seen.query
    ev = proxy.wait_audit(lambda e: e.get("rule") == "github")
    assert "REDACTED" in ev["path"]
    assert_no_secret([json.dumps(ev)], [GITHUB_TOKEN], "the audit event")


def test_secret_missing_in_vault_gives_503_and_nothing_forwarded(proxy, upstream):
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/missing-secret")
    body, status = split_status(r.stdout)
    assert status == 503
    doc = _refusal(body)
    assert doc["code"] == "secret_unavailable" and "missing" in doc["reason"]
    assert len(upstream.seen) == before


@pytest.mark.parametrize("host", INTERNAL_NAMES)
def test_dns_answer_pointing_inside_refused(proxy, host):
    r = curl(proxy, "coding-agent", f"https://{host}/x")
    body, status = split_status(r.stdout)
    assert status == 403
    assert _refusal(body)["code"] == "internal_address"


@pytest.mark.parametrize("host", ADDRESS_SPELLINGS)
def test_address_spellings_refused(proxy, host):
    r = curl(proxy, "coding-agent", f"https://{host}/x")
    assert r.returncode != 0 or split_status(r.stdout)[1] in (400, 403)
    ev = proxy.wait_audit(lambda e: e.get("decision") == "deny" and e.get("method") == "CONNECT")
    assert ev["identity"] == "coding-agent"


@pytest.mark.parametrize("url", HOST_TRICKS)
def test_host_and_port_tricks_refused(proxy, url):
    r = curl(proxy, "coding-agent", url, "-d", "{}")
    assert r.returncode != 0 or split_status(r.stdout)[1] == 403


def test_uppercase_and_trailing_dot_host_still_allowed(proxy, upstream):
    r = curl(proxy, "coding-agent", "https://API.Anthropic.com./v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr


def _open_tunnel(proxy, identity: str, connect_host: str) -> socket.socket:
    """A raw CONNECT tunnel, authenticated, that the proxy accepted."""
    return granted_tunnel(proxy, identity, connect_host)


def _raw_tunnel(proxy, identity: str, connect_host: str, sni: str, host_header: str,
                extra: bytes = b"") -> bytes:
    s = _open_tunnel(proxy, identity, connect_host)
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    ctx.check_hostname = False
    tls = ctx.wrap_socket(s, server_hostname=sni)
    tls.sendall(f"GET /docs/x HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n".encode()
                + extra + b"\r\n")
    out = recv_until_closed(tls)
    tls.close()
    return out


@pytest.mark.parametrize("connect_host,sni,host_header", TUNNEL_DISAGREEMENTS)
def test_connect_sni_host_disagreement_refused(proxy, upstream, connect_host, sni, host_header):
    before = len(upstream.seen)
    out = _raw_tunnel(proxy, "coding-agent", connect_host, sni, host_header)
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    assert b"disagrees" in out
    assert len(upstream.seen) == before


def test_smuggling_content_length_with_transfer_encoding_refused(proxy, upstream):
    before = len(upstream.seen)
    out = _raw_tunnel(proxy, "coding-agent", "upstream.test", "upstream.test", "upstream.test",
                      b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n")
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    assert len(upstream.seen) == before


def test_connect_without_tls_refused(proxy, upstream):
    s = _open_tunnel(proxy, "coding-agent", "upstream.test")
    before = len(upstream.seen)
    s.sendall(b"GET /docs/x HTTP/1.1\r\nHost: upstream.test:443\r\nConnection: close\r\n\r\n")
    out = s.recv(65536)
    s.close()
    assert out.startswith(b"HTTP/1.1 403"), out[:300]
    assert b"not_tls" in out
    assert len(upstream.seen) == before


def test_plain_http_absolute_form_judged(proxy, plain_upstream):
    r = curl(proxy, "coding-agent", "http://plain.test/hello")
    assert split_status(r.stdout)[1] == 200
    assert plain_upstream.seen[-1].path == "/hello"
    assert "proxy-authorization" not in plain_upstream.seen[-1].headers
    # plain http to a host whose rule is https-only: refused
    r = curl(proxy, "coding-agent", "http://upstream.test/docs/x")
    assert split_status(r.stdout)[1] == 403


def test_sse_stream_arrives_unbuffered(proxy, upstream):
    upstream.upstream.sse_release.clear()
    tok = proxy.token("coding-agent")
    p = subprocess.Popen(["curl", "-sSN", "--max-time", "20", "--proxy", proxy.url,
                          "--proxy-user", f"coding-agent:{tok}", "--cacert", str(proxy.ca),
                          "https://api.anthropic.com/sse"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    first = p.stdout.readline()  # arrives while the upstream still holds the stream open
    assert first.strip() == "data: first"
    upstream.upstream.sse_release.set()
    rest = p.stdout.read()
    p.wait(10)
    assert "data: second" in rest


def test_sse_event_is_whole_at_once_with_secrets_cached(proxy, upstream):
    """A small event (shorter than any secret) and its closing blank line reach the client
    while the upstream still holds the stream: the scrubber holds back only bytes that could
    start a secret (it used to hold len(secret)-1 bytes, so this event came only at the end)."""
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200  # the anthropic key is cached now
    upstream.upstream.sse_release.clear()
    tok = proxy.token("coding-agent")
    p = subprocess.Popen(["curl", "-sSN", "--max-time", "20", "--proxy", proxy.url,
                          "--proxy-user", f"coding-agent:{tok}", "--cacert", str(proxy.ca),
                          "https://api.anthropic.com/sse"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "data: first\n"
        assert p.stdout.readline() == "\n"  # the event is complete before the next one exists
    finally:
        upstream.upstream.sse_release.set()
        p.wait(10)


def test_large_body_streams(proxy, upstream):
    r = subprocess.run(["curl", "-sS", "--max-time", "30", "--proxy", proxy.url, "--proxy-user",
                        f"coding-agent:{proxy.token('coding-agent')}", "--cacert", str(proxy.ca),
                        "-o", "/dev/null", "-w", "%{size_download} %{http_code}",
                        "https://api.anthropic.com/big?mb=32"], capture_output=True, text=True)
    size, code = r.stdout.split()
    assert code == "200" and int(size) == 32 * 1024 * 1024


def test_audit_event_fields(proxy):
    curl(proxy, "bash-tool", "https://upstream.test/docs/audit?token=abc123")
    ev = proxy.wait_audit(lambda e: (e.get("path") or "").startswith("/docs/audit"))
    for field in ("time", "identity", "sandbox", "client", "method", "scheme", "host", "port",
                  "path", "rule", "decision", "reason", "secrets", "upstream_status",
                  "bytes_in", "bytes_out", "duration_ms"):
        assert field in ev, field
    assert "abc123" not in json.dumps(ev)
    assert ev["path"] == "/docs/audit?token=REDACTED"


def test_passthrough_tunnel_is_not_intercepted(proxy, upstream, pki):
    # The client sees the upstream's own certificate (no interception) and the dial is pinned.
    r = subprocess.run(["curl", "-sS", "--max-time", "15", "--proxy", proxy.url, "--proxy-user",
                        f"coding-agent:{proxy.token('coding-agent')}", "--cacert",
                        str(pki.ca_cert), "-w", "\n%{http_code}", "https://tunnel.test/anything"],
                       capture_output=True, text=True)
    assert split_status(r.stdout)[1] == 200, r.stderr
    assert upstream.seen[-1].host == "tunnel.test"
    # with Sandgate's CA instead, verification fails: it really was not intercepted
    r = curl(proxy, "coding-agent", "https://tunnel.test/anything")
    assert r.returncode != 0


def test_raw_tcp_in_connect_without_passthrough_is_killed(proxy, upstream):
    s = _open_tunnel(proxy, "coding-agent", "upstream.test")
    before = len(upstream.seen)
    s.sendall(b"\x00\x01binary-protocol-not-http\r\n\r\n")
    try:
        out = s.recv(4096)
    except OSError:
        out = b""
    s.close()
    assert b"200" not in out
    assert len(upstream.seen) == before


def test_upstream_cert_not_matching_name_gets_no_key(proxy, upstream):
    # nocert.test resolves to the upstream, whose certificate does not name it.
    before = len(upstream.seen)
    r = curl(proxy, "coding-agent", "https://nocert.test/x")
    assert split_status(r.stdout)[1] == 502
    assert len(upstream.seen) == before
    _no_secret(r.stdout, r.stderr)


def test_head_request_keeps_framing(proxy, upstream):
    r = curl(proxy, "coding-agent", "https://upstream.test/page", "-I")
    head, status = split_status(r.stdout)
    assert status == 200
    assert "transfer-encoding" not in head.lower()


def test_real_value_in_a_denied_path_never_reaches_the_audit(proxy, upstream):
    curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")  # cache it
    r = curl(proxy, "bash-tool", f"https://upstream.test/bot{ANTHROPIC_KEY}/x")
    assert split_status(r.stdout)[1] == 403
    _no_secret(r.stdout, r.stderr)
    ev = proxy.wait_audit(lambda e: (e.get("path") or "").startswith("/bot"))
    assert "REDACTED" in ev["path"]
    _no_secret(proxy.audit_file.read_text())
