"""The HTTP listener's attack classes, on every listener (tests/support/listeners.py).

One `sandgate run` serves the HTTP proxy port and `--socks5`; every test runs once per listener
(`[http]`, `[socks5]`) with the case tables of test_proxy.py and test_request_integrity.py:
injection, policy refusals, host tricks, address spellings, names resolving inside,
SNI/Host/target disagreement, TLS-less and raw tunnels, passthrough, exfiltration (plain and
encoded) and response scrubbing. What differs between the listeners is only how the tunnel is
asked for.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import time

import pytest

from tests.integration.conftest import ANTHROPIC_KEY, SECRET_VALUES, split_status
from tests.integration.test_proxy import (
    ADDRESS_SPELLINGS,
    HOST_TRICKS,
    INTERNAL_NAMES,
    PATH_TRICKS,
    TUNNEL_DISAGREEMENTS,
)
from tests.integration.test_request_integrity import _forms
from tests.support.listeners import Listener, dual_proxy_running, make_listener
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.tunnel import recv_until_closed

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dual_proxy(tmp_path_factory, vault, upstream, plain_upstream, pki):
    yield from dual_proxy_running(tmp_path_factory, vault, pki)


@pytest.fixture(scope="module", params=["http", "socks5"])
def listener(request, dual_proxy) -> Listener:
    return make_listener(request.param, dual_proxy)


def _no_secret(*texts: str) -> None:
    assert_no_secret(texts, SECRET_VALUES, "the client side")


def _refusal(body: str) -> dict:
    doc = json.loads(body)
    assert doc["error"] == "sandgate_refused"
    return doc


def _new_events(listener: Listener, mark: int) -> list[dict]:
    return [e for e in listener.proxy.audit()[mark:] if e.get("listener") == listener.kind]


def _wait_new(listener: Listener, mark: int, pred, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in _new_events(listener, mark):
            if pred(ev):
                return ev
        time.sleep(0.05)
    raise AssertionError(f"no matching audit event on the {listener.kind} listener")


def _warm_cache(listener: Listener) -> None:
    r = listener.curl("coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200, r.stderr


def test_injected_call_with_placeholder_only(listener, upstream):
    before = len(upstream.seen)
    r = listener.curl("coding-agent", "https://api.anthropic.com/v1/messages",
                      "-H", "x-api-key: sandgate-placeholder-anthropic", "-d", '{"model":"m"}')
    body, status = split_status(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert "hello from the test upstream" in body
    seen = upstream.seen[before:]
    assert len(seen) == 1
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert seen[0].host == "api.anthropic.com"
    _no_secret(r.stdout, r.stderr)
    ev = listener.proxy.wait_audit(lambda e: e.get("listener") == listener.kind
                                   and e.get("path") == "/v1/messages"
                                   and e["decision"] == "allow")
    assert ev["identity"] == "coding-agent" and ev["rule"] == "llm"
    assert ev["dialed"] == "127.0.0.2:443"


def test_bash_tool_refused_with_readable_reason(listener, upstream):
    before = len(upstream.seen)
    r = listener.curl("bash-tool", "https://api.anthropic.com/v1/messages", "-d", "{}")
    body, status = split_status(r.stdout)
    assert status == 403, r.stderr
    doc = _refusal(body)
    assert doc["identity"] == "bash-tool" and doc["code"] == "no_rule"
    assert len(upstream.seen) == before


def test_explicit_deny_wins(listener, upstream):
    before = len(upstream.seen)
    r = listener.curl("coding-agent", "https://upstream.test/admin/users")
    body, status = split_status(r.stdout)
    assert status == 403
    assert _refusal(body)["code"] == "denied_by_rule"
    assert len(upstream.seen) == before


@pytest.mark.parametrize("path", PATH_TRICKS)
def test_path_tricks(listener, upstream, path):
    """As on the proxy port: a dot segment is refused 400 bad_request whatever the rules,
    `//admin` by its deny rule; nothing is forwarded."""
    before = len(upstream.seen)
    r = listener.curl("coding-agent", f"https://upstream.test{path}", "--path-as-is")
    body, status = split_status(r.stdout)
    if ".." in path or "%2e" in path:
        assert (status, _refusal(body)["code"]) == (400, "bad_request")
    else:
        assert (status, _refusal(body)["code"]) == (403, "denied_by_rule")
    assert len(upstream.seen) == before


@pytest.mark.parametrize("host", INTERNAL_NAMES)
def test_name_resolving_inside_refused(listener, host):
    r = listener.curl("coding-agent", f"https://{host}/x")
    body, status = split_status(r.stdout)
    assert status == 403, r.stderr
    assert _refusal(body)["code"] == "internal_address"


@pytest.mark.parametrize("host", ADDRESS_SPELLINGS)
def test_address_spellings_refused(listener, upstream, host):
    before, mark = len(upstream.seen), len(listener.proxy.audit())
    r = listener.curl("coding-agent", f"https://{host}/x")
    assert r.returncode != 0 or split_status(r.stdout)[1] in (400, 403)
    assert len(upstream.seen) == before
    ev = _wait_new(listener, mark, lambda e: e.get("method") == "CONNECT")
    assert ev["decision"] == "deny" and ev["identity"] == "coding-agent"


@pytest.mark.parametrize("url", HOST_TRICKS)
def test_host_and_port_tricks_refused(listener, upstream, url):
    before = len(upstream.seen)
    r = listener.curl("coding-agent", url, "-d", "{}")
    assert r.returncode != 0 or split_status(r.stdout)[1] == 403
    assert len(upstream.seen) == before


def test_uppercase_and_trailing_dot_host_still_allowed(listener, upstream):
    r = listener.curl("coding-agent", "https://API.Anthropic.com./v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr


def _tls_request(listener: Listener, connect_host: str, sni: str, host_header: str) -> bytes:
    s = listener.open_tunnel("coding-agent", connect_host)
    ctx = ssl.create_default_context(cafile=str(listener.proxy.ca))
    ctx.check_hostname = False
    tls = ctx.wrap_socket(s, server_hostname=sni)
    tls.sendall(f"GET /docs/x HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n"
                .encode())
    out = recv_until_closed(tls)
    tls.close()
    return out


@pytest.mark.parametrize("connect_host,sni,host_header", TUNNEL_DISAGREEMENTS)
def test_target_sni_host_disagreement_refused(listener, upstream, connect_host, sni,
                                              host_header):
    before = len(upstream.seen)
    out = _tls_request(listener, connect_host, sni, host_header)
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    assert b"disagrees" in out
    assert len(upstream.seen) == before


def test_tunnel_without_tls_refused(listener, upstream):
    s = listener.open_tunnel("coding-agent", "upstream.test")
    before = len(upstream.seen)
    s.sendall(b"GET /docs/x HTTP/1.1\r\nHost: upstream.test:443\r\nConnection: close\r\n\r\n")
    out = s.recv(65536)
    s.close()
    assert out.startswith(b"HTTP/1.1 403"), out[:300]
    assert b"not_tls" in out
    assert len(upstream.seen) == before


def test_raw_tcp_in_tunnel_is_killed(listener, upstream):
    s = listener.open_tunnel("coding-agent", "upstream.test")
    before = len(upstream.seen)
    s.sendall(b"\x00\x01binary-protocol-not-http\r\n\r\n")
    try:
        out = s.recv(4096)
    except OSError:
        out = b""
    s.close()
    assert b"200" not in out
    assert len(upstream.seen) == before


def test_passthrough_tunnel_is_not_intercepted(listener, upstream, pki):
    tok = listener.proxy.token("coding-agent")
    r = subprocess.run(["curl", "-sS", "--max-time", "15",
                        *listener.curl_proxy_args("coding-agent", tok), "--cacert",
                        str(pki.ca_cert), "-w", "\n%{http_code}",
                        "https://tunnel.test/anything"], capture_output=True, text=True)
    assert split_status(r.stdout)[1] == 200, r.stderr
    assert upstream.seen[-1].host == "tunnel.test"
    r = listener.curl("coding-agent", "https://tunnel.test/anything")
    assert r.returncode != 0  # Sandgate's CA does not verify: it really was not intercepted


def test_placeholder_sent_to_unbound_host_is_exfiltration(listener, upstream):
    before = len(upstream.seen)
    r = listener.curl("coding-agent", "https://upstream.test/page",
                      "-H", "authorization: Bearer sandgate-placeholder-anthropic")
    body, status = split_status(r.stdout)
    assert status == 403
    assert _refusal(body)["code"] == "exfiltration"
    assert len(upstream.seen) == before


def test_real_value_sent_elsewhere_is_exfiltration(listener, upstream):
    _warm_cache(listener)
    before = len(upstream.seen)
    r = listener.curl("coding-agent", "https://upstream.test/page?k=" + ANTHROPIC_KEY)
    assert split_status(r.stdout)[1] == 403
    assert len(upstream.seen) == before
    _no_secret(listener.proxy.audit_file.read_text())


@pytest.mark.parametrize("form", list(_forms()))
def test_encoded_value_in_body_is_exfiltration(listener, upstream, form):
    _warm_cache(listener)
    before = len(upstream.seen)
    body = b'{"messages":[{"role":"user","content":"' + _forms()[form] + b'"}]}'
    r = listener.curl("coding-agent", "https://api.anthropic.com/v1/messages",
                      "--data-binary", body.decode(), "-H", "content-type: application/json")
    text, status = split_status(r.stdout)
    assert len(upstream.seen) == before, "the request reached the upstream"
    assert status == 403
    assert _refusal(text)["code"] == "exfiltration"


def test_upstream_echoing_key_is_scrubbed(listener, upstream):
    r = listener.curl("coding-agent", "https://api.anthropic.com/echo-key", "-i")
    body, status = split_status(r.stdout)
    assert status == 200
    assert_secret_equal(upstream.seen[-1].headers.get("x-api-key"), ANTHROPIC_KEY,
                        "upstream x-api-key")
    _no_secret(r.stdout, r.stderr)
    assert "[REDACTED" in body or "***" in body
    assert "x-sandgate-reason" not in body.lower()
