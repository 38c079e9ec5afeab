"""Base-URL gateway mode (`sandgate run --gateway HOST:PORT`): clients that set only a base URL
and put their Sandgate token where their SDK puts the API key.

Real parts: the sandgate process, OpenBao, the TLS upstreams of conftest (api.anthropic.com and
api.openai.com at 127.0.0.2), the official SDKs, Node's built-in fetch, curl.
No proxy variable and no CA reach the clients of the plain-HTTP gateway. Addresses: the gateway
listeners and the paused SSE upstream use 127.0.16.0/24.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    OPENAI_KEY,
    SECRET_VALUES,
    Proxy,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration

GATEWAY_IP = "127.0.16.1"
TLS_GATEWAY_IP = "127.0.16.2"
SSE_IP = "127.0.16.5"  # the paused SSE upstream, sse.r2.test (policies_gateway/gateways.yaml)
SHARED_IP = "127.0.16.6"  # a.r2.test and b.r2.test: one address, SNI recorded
CIDR_GATEWAY_IP = "127.0.16.3"
SANDBOX_IP = "127.0.16.7"  # what --identity-cidr says is coding-agent
TLS_NAME = "sandgate.internal"

@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gw-policies")
    shutil.copy(HERE / "policies" / "test.yaml", d / "test.yaml")
    shutil.copy(HERE / "policies_gateway" / "gateways.yaml", d / "gateways.yaml")
    return d


def _wait_port(host: str, port: int, p: Proxy) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the gateway did not listen:\n{p.logs()[-3000:]}")


class Gw:
    def __init__(self, proxy: Proxy, host: str, port: int) -> None:
        self.proxy, self.host, self.port = proxy, host, port

    def url(self, path: str = "") -> str:
        return f"http://{self.host}:{self.port}{path}"


@pytest.fixture(scope="module")
def gw(tmp_path_factory, vault, upstream, pki, policies) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("gw")
    port = free_port()
    p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token},
                    pki, f"--gateway={GATEWAY_IP}:{port}", f"--resolve=sse.r2.test={SSE_IP}",
                    f"--resolve=a.r2.test={SHARED_IP}", f"--resolve=b.r2.test={SHARED_IP}")
    _wait_port(GATEWAY_IP, port, p)
    yield Gw(p, GATEWAY_IP, port)
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


@pytest.fixture(scope="module")
def tls_gw(tmp_path_factory, vault, upstream, pki, policies) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("tlsgw")
    port = free_port()
    p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token},
                    pki, f"--gateway={TLS_GATEWAY_IP}:{port}", f"--gateway-tls-name={TLS_NAME}")
    _wait_port(TLS_GATEWAY_IP, port, p)
    yield Gw(p, TLS_GATEWAY_IP, port)
    stop_proxy(p)


@pytest.fixture(scope="module")
def cidr_gw(tmp_path_factory, vault, upstream, pki, policies) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("cidrgw")
    port = free_port()
    p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token},
                    pki, f"--gateway={CIDR_GATEWAY_IP}:{port}",
                    f"--identity-cidr={SANDBOX_IP}/32=coding-agent")
    _wait_port(CIDR_GATEWAY_IP, port, p)
    yield Gw(p, CIDR_GATEWAY_IP, port)
    stop_proxy(p)


def _clean_env() -> dict[str, str]:
    """No proxy variable, no CA, no key: only what each test gives."""
    return {k: v for k, v in os.environ.items()
            if "KEY" not in k and not k.startswith("VAULT") and "PROXY" not in k.upper()
            and k not in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
                          "NODE_EXTRA_CA_CERTS")}


def _raw(gw: Gw, head: str, body: bytes = b"",
         source: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """Send exactly these bytes (a request head, CRLFs added; the head must ask for
    `Connection: close`) and read the one response to the end."""
    data = head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body
    with socket.create_connection((gw.host, gw.port), timeout=10,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head_b, _, rest = buf.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.partition(":") for ln in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        rest = out
    return status, headers, rest


def _post(gw: Gw, path: str, token: str | None, header: str = "x-api-key",
          extra: str = "", body: bytes = b"{}") -> tuple[int, dict[str, str], bytes]:
    auth = f"\n{header}: {token}" if token is not None else ""
    return _raw(gw, f"POST {path} HTTP/1.1\nHost: {gw.host}:{gw.port}{auth}{extra}\n"
                f"Content-Type: application/json\nContent-Length: {len(body)}\n"
                "Connection: close", body)


def _refusal(body: bytes) -> dict:
    doc = json.loads(body)
    assert doc["error"] == "sandgate_refused"
    return doc


# ------------------------------------------------------------------ the official SDKs

ANTHROPIC = """
import anthropic, sys
c = anthropic.Anthropic(base_url=sys.argv[1], api_key=sys.argv[2])
m = c.messages.create(model="claude-test", max_tokens=8,
                      messages=[{"role": "user", "content": "hi"}])
print("TEXT:", m.content[0].text)
"""

OPENAI = """
import openai, sys
c = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2])
r = c.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
print("TEXT:", r.choices[0].message.content)
"""


def _sdk(script: str, base_url: str, token: str) -> subprocess.CompletedProcess[str]:
    need_sdk("anthropic", "openai")
    return subprocess.run([str(CLIENT_PY), "-c", script, base_url, token], capture_output=True,
                          text=True, env=_clean_env(), timeout=60)


def _no_token_upstream(seen, token: str) -> None:
    for s in seen:
        assert all(token not in v for v in s.headers.values()), "the token reached the upstream"


def test_anthropic_sdk_with_base_url_and_token(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    r = _sdk(ANTHROPIC, gw.url("/anthropic"), tok)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TEXT: hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [(s.method, s.path, s.host) for s in seen] == [("POST", "/v1/messages",
                                                           "api.anthropic.com")]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    _no_token_upstream(seen, tok)
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK output")
    ev = gw.proxy.wait_audit(lambda e: e.get("gateway") == "/anthropic"
                             and e.get("decision") == "allow")
    assert (ev["identity"], ev["rule"], ev["host"], ev["path"]) == (
        "coding-agent", "llm", "api.anthropic.com", "/v1/messages")
    assert ev["dialed"] == "127.0.0.2:443" and ev["secrets"][0].startswith("anthropic@")


def test_openai_sdk_with_base_url_and_bearer_token(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    r = _sdk(OPENAI, gw.url("/openai/v1"), tok)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TEXT: hello from openai test" in r.stdout
    seen = upstream.seen[before:]
    assert [(s.path, s.host) for s in seen] == [("/v1/chat/completions", "api.openai.com")]
    assert_secret_equal(seen[0].headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "upstream authorization")
    _no_token_upstream(seen, tok)
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK output")


def test_sdk_of_identity_without_rule_is_refused(gw, upstream):
    before = len(upstream.seen)
    r = _sdk(ANTHROPIC, gw.url("/anthropic"), gw.proxy.token("bash-tool"))
    assert r.returncode != 0
    assert "no_rule" in r.stderr
    assert len(upstream.seen) == before


NODE = """
(async () => {
  const r = await fetch(process.argv[1] + "/v1/messages", {method: "POST",
    headers: {"x-api-key": process.argv[2], "content-type": "application/json"},
    body: JSON.stringify({model: "m", max_tokens: 8, messages: []})});
  console.log("STATUS", r.status);
  console.log(await r.text());
})().catch((e) => { console.error(e); process.exit(3); });
"""


def test_node_builtin_fetch(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    r = subprocess.run(["node", "-e", NODE, gw.url("/anthropic"), tok], capture_output=True,
                       text=True, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "STATUS 200" in r.stdout and "hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [s.path for s in seen] == ["/v1/messages"]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "node's output")


# ------------------------------------------------------------------ SSE, unbuffered


class PausedSse:
    """A TLS upstream that sends one event, then holds the stream until released, and records
    when it finished: the order of events shows whether anything buffered."""

    def __init__(self, cert: str, key: str) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server((SSE_IP, 443))
        self.release = threading.Event()
        self.finished = threading.Event()
        self.headers = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with self.ctx.wrap_socket(conn, server_side=True) as s:
            while b"\r\n\r\n" not in self.headers:
                self.headers += s.recv(65536)
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            s.sendall(_chunk(b"data: first\n\n"))
            self.release.wait(60)
            # Set before the last bytes go: the client can read the end of the stream before
            # this thread is scheduled again (the CI flake of stop 30).
            self.finished.set()
            s.sendall(_chunk(b"data: second\n\n") + b"0\r\n\r\n")
            time.sleep(0.2)

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        self.thread.join(5)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_sse_streams_through_the_gateway_unbuffered(gw, pki):
    sse = PausedSse(str(pki.cert), str(pki.key))
    try:
        tok = gw.proxy.token("coding-agent")
        p = subprocess.Popen(["curl", "-sSN", "--max-time", "30", "-H", f"x-api-key: {tok}",
                              gw.url("/sse/events")], stdout=subprocess.PIPE, text=True,
                             env=_clean_env())
        assert p.stdout is not None
        first = p.stdout.readline()
        # The first event is through while the upstream still holds the stream open.
        assert first == "data: first\n"
        assert not sse.finished.is_set()
        sse.release.set()
        rest = p.stdout.read()
        p.wait(10)
        assert sse.finished.is_set()
        assert "data: second" in rest
        assert ANTHROPIC_KEY.encode() in sse.headers  # the rule's injection reached it
        assert tok.encode() not in sse.headers
    finally:
        sse.close()


# ------------------------------------------------------------------ upstreams sharing an IP


class SniRecorder:
    """A TLS upstream (keep-alive HTTP/1.1) recording, per request, the SNI of the connection
    it arrived on and its Host header."""

    def __init__(self, cert: str, key: str) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.sni_callback = self._sni
        self.seen: list[tuple[str | None, str, str]] = []  # (sni, host, path)
        self.connections: list[str | None] = []  # the SNI of each TLS connection accepted
        self.sock = socket.create_server((SHARED_IP, 443))
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _sni(sock, name, _ctx) -> None:  # type: ignore[no-untyped-def]
        sock.sandgate_sni = name

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as s:
                sni = getattr(s, "sandgate_sni", None)
                self.connections.append(sni)
                buf = b""
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = s.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    hdrs = {k.strip().lower(): v.strip() for k, _, v in
                            (ln.partition(":") for ln in lines[1:])}
                    self.seen.append((sni, hdrs.get("host", ""), lines[0].split()[1]))
                    s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (OSError, ssl.SSLError):
            return

    def close(self) -> None:
        self.sock.close()


def test_upstreams_sharing_an_address_never_share_a_tls_connection(gw, pki):
    """One keep-alive gateway connection, two prefixes whose upstreams resolve to one address:
    each request reaches the upstream on a connection verified (SNI) for its own name."""
    import http.client

    rec = SniRecorder(str(pki.cert), str(pki.key))
    try:
        tok = gw.proxy.token("coding-agent")
        c = http.client.HTTPConnection(gw.host, gw.port, timeout=10)
        for path in ("/a/1", "/b/2", "/a/3", "/b/4"):
            c.request("GET", path, headers={"x-api-key": tok})
            r = c.getresponse()
            assert (r.status, r.read()) == (200, b"ok"), path
        c.close()
        assert [(host, path) for _, host, path in rec.seen] == [
            ("a.r2.test", "/1"), ("b.r2.test", "/2"), ("a.r2.test", "/3"), ("b.r2.test", "/4")]
        assert all(sni == host for sni, host, _ in rec.seen), rec.seen
        # The upstream connection keeps the name it was verified for as its address: a later
        # request to that name reuses it (one TLS connection per name), and nothing renames an
        # open connection (mitmproxy refused that: `server_connected failed` in the log).
        assert sorted(rec.connections) == ["a.r2.test", "b.r2.test"], rec.connections
    finally:
        rec.close()
    assert "Cannot change server.address" not in gw.proxy.logs()


# ------------------------------------------------------------------ identity


def test_no_token_is_401_with_refusal_body(gw, upstream):
    before = len(upstream.seen)
    status, headers, body = _post(gw, "/anthropic/v1/messages", None)
    assert status == 401
    assert headers.get("www-authenticate", "").startswith("Bearer")
    assert headers.get("x-sandgate-reason") == "auth_required"
    doc = _refusal(body)
    assert doc["code"] == "auth_required" and doc["status"] == 401
    assert "x-api-key" in doc["reason"]
    assert len(upstream.seen) == before


@pytest.mark.parametrize("value", ["not-a-token", "sg1.AAAA.BBBB", "sandgate-placeholder-x"])
def test_bad_token_is_401(gw, upstream, value):
    before = len(upstream.seen)
    status, _, body = _post(gw, "/anthropic/v1/messages", value)
    assert status == 401
    assert _refusal(body)["code"] == "auth_invalid"
    assert value not in body.decode()
    assert len(upstream.seen) == before


def test_expired_token_is_401(gw, upstream):
    tok = gw.proxy.token("coding-agent", ttl="1s")
    time.sleep(2.1)
    status, _, body = _post(gw, "/anthropic/v1/messages", tok)
    assert status == 401 and _refusal(body)["code"] == "auth_invalid"


def test_token_twice_is_refused(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    status, _, body = _post(gw, "/anthropic/v1/messages", tok, extra=f"\nx-api-key: {tok}")
    assert status == 401 and _refusal(body)["code"] == "auth_invalid"


def test_token_in_two_token_headers_is_refused(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    status, _, body = _post(gw, "/anthropic/v1/messages", tok,
                            extra=f"\nAuthorization: Bearer {tok}")
    assert status == 401 and _refusal(body)["code"] == "auth_invalid"


def test_proxy_authorization_is_no_identity_on_the_gateway(gw, upstream):
    import base64

    tok = gw.proxy.token("coding-agent")
    basic = base64.b64encode(f"coding-agent:{tok}".encode()).decode()
    before = len(upstream.seen)
    status, _, body = _post(gw, "/anthropic/v1/messages", None,
                            extra=f"\nProxy-Authorization: Basic {basic}")
    assert status == 401 and _refusal(body)["code"] == "auth_required"
    assert len(upstream.seen) == before


def test_token_in_another_header_is_not_an_identity(gw, upstream):
    """The token counts only in the gateway's token_header: OpenAI's gateway reads
    authorization, so a token in x-api-key identifies nobody."""
    tok = gw.proxy.token("coding-agent")
    status, _, body = _post(gw, "/openai/v1/chat/completions", tok, header="x-api-key")
    assert status == 401 and _refusal(body)["code"] == "auth_required"


def test_authorization_token_without_bearer_and_header_removed(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    status, _, _ = _post(gw, "/openai/v1/chat/completions", tok, header="authorization")
    assert status == 200
    seen = upstream.seen[before:]
    assert_secret_equal(seen[0].headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "upstream authorization")
    _no_token_upstream(seen, tok)


# ------------------------------------------------------------------ prefixes, paths, hosts


@pytest.mark.parametrize("path", [
    "/anthropicx/v1/messages",
    "/Anthropic/v1/messages",
    "/anthropic%2Fv1/messages",
    "/anthropic%2F..%2Fopenai/v1/chat/completions",
    "/v1/messages",
    "/",
    "//anthropic/v1/messages",
])
def test_paths_under_no_prefix_are_404(gw, upstream, path):
    before = len(upstream.seen)
    status, headers, body = _post(gw, path, gw.proxy.token("coding-agent"))
    assert status == 404, body
    assert headers.get("x-sandgate-reason") == "no_gateway"
    doc = _refusal(body)
    assert "/anthropic" in doc["hint"]
    assert len(upstream.seen) == before


@pytest.mark.parametrize("path", [
    "/anthropic/../openai/v1/chat/completions",
    "/anthropic/%2e%2e/openai/v1/chat/completions",
    "/anthropic/v1/messages/..%2F..%2Fopenai/v1/chat/completions",
    "/anthropic/..\\openai/v1/chat/completions",
])
def test_dot_segments_stay_on_the_prefix_upstream_and_are_refused_there(gw, upstream, path):
    """What follows the prefix goes to the prefix's upstream only, judged like a proxied path:
    a dot segment there is refused whatever the rules (judged resolved, it would go on as
    sent), and the refusal names the prefix's upstream."""
    before = len(upstream.seen)
    status, _, body = _post(gw, path, gw.proxy.token("coding-agent"))
    assert status == 400, body
    doc = _refusal(body)
    assert doc["code"] == "bad_request" and "segment" in doc["reason"]
    assert doc["target"].startswith("https://api.anthropic.com:443/")
    assert len(upstream.seen) == before


def test_path_after_prefix_is_judged_by_the_rules(gw, upstream):
    """The llm rule allows POST /v1/messages only: another path under the prefix is refused."""
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    status, _, body = _post(gw, "/anthropic/v1/admin", tok)
    assert status == 403 and _refusal(body)["code"] == "no_rule"
    status, _, body = _raw(gw, f"GET /anthropic/v1/messages HTTP/1.1\nHost: x\nx-api-key: {tok}"
                           "\nConnection: close")
    assert status == 403 and _refusal(body)["code"] == "no_rule"
    assert len(upstream.seen) == before


@pytest.mark.parametrize("target", [
    "http://api.openai.com/v1/chat/completions",
    "https://api.openai.com/v1/chat/completions",
    f"http://{GATEWAY_IP}/anthropic/v1/messages",
])
def test_absolute_form_targets_are_refused(gw, upstream, target):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    status, _, body = _raw(gw, f"POST {target} HTTP/1.1\nHost: api.openai.com\n"
                           f"x-api-key: {tok}\nContent-Length: 2\nConnection: close", b"{}")
    assert status == 400, body
    assert len(upstream.seen) == before


def test_host_header_does_not_choose_the_upstream(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    status, _, body = _raw(gw, f"POST /anthropic/v1/messages HTTP/1.1\nHost: api.openai.com\n"
                           f"x-api-key: {tok}\nContent-Length: 2\nConnection: close", b"{}")
    assert status == 200, body
    seen = upstream.seen[before:]
    assert [(s.host, s.path) for s in seen] == [("api.anthropic.com", "/v1/messages")]


def test_query_passes_and_prefix_alone_is_the_root(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    status, _, body = _post(gw, "/anthropic?x=1", tok)
    assert status == 403 and _refusal(body)["target"] == "https://api.anthropic.com:443/"
    before = len(upstream.seen)
    status, _, _ = _post(gw, "/anthropic/v1/messages?beta=true", tok)
    assert status == 200
    assert [(s.path, s.query) for s in upstream.seen[before:]] == [("/v1/messages", "beta=true")]


def test_control_characters_are_refused(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    status, _, _ = _raw(gw, f"POST /anthropic/v1/messages HTTP/1.1\nHost: x\nx-api-key: {tok}\n"
                        "X-Evil: a\x01b\nContent-Length: 0\nConnection: close")
    assert status == 400


# ------------------------------------------------------------------ exfiltration, scrubbing


def test_placeholder_of_another_secret_is_exfiltration(gw, upstream):
    before = len(upstream.seen)
    status, _, body = _post(gw, "/anthropic/v1/messages", gw.proxy.token("coding-agent"),
                            extra="\nX-Note: sandgate-placeholder-openai")
    assert status == 403 and _refusal(body)["code"] == "exfiltration"
    assert len(upstream.seen) == before


def test_real_value_in_body_is_exfiltration(gw, upstream):
    before = len(upstream.seen)
    status, _, body = _post(gw, "/anthropic/v1/messages", gw.proxy.token("coding-agent"),
                            body=json.dumps({"k": OPENAI_KEY}).encode())
    # the value is cached only once a request needed it: make sure it is
    if status == 200:
        _post(gw, "/openai/v1/chat/completions", gw.proxy.token("coding-agent"),
              header="authorization")
        before = len(upstream.seen)
        status, _, body = _post(gw, "/anthropic/v1/messages", gw.proxy.token("coding-agent"),
                                body=json.dumps({"k": OPENAI_KEY}).encode())
    assert status == 403 and _refusal(body)["code"] == "exfiltration"
    assert len(upstream.seen) == before
    assert_no_secret([body.decode()], SECRET_VALUES, "the refusal")


def test_leaky_upstream_is_scrubbed(gw, upstream):
    tok = gw.proxy.token("coding-agent")
    status, headers, body = _raw(gw, f"GET /anthropic/echo-key HTTP/1.1\nHost: x\n"
                                 f"x-api-key: {tok}\nConnection: close")
    assert status == 200
    assert_no_secret([body.decode(errors="replace"), json.dumps(headers)], SECRET_VALUES,
                     "the gateway's answer")
    assert b"your key is" in body
    assert "x-sandgate-reason" not in headers  # the upstream's forged header is stripped


def test_upstream_tls_is_verified(gw, upstream):
    """nocert.test resolves to the test upstream, whose certificate does not name it."""
    before = len(upstream.seen)
    status, _, body = _post(gw, "/nocert/x", gw.proxy.token("coding-agent"))
    assert status == 502, body
    assert len(upstream.seen) == before


# ------------------------------------------------------------------ address identity


def test_address_identity_needs_no_token_and_swaps_a_placeholder(cidr_gw, upstream):
    before = len(upstream.seen)
    status, _, body = _raw(cidr_gw, "POST /anthropic/v1/messages HTTP/1.1\nHost: x\n"
                           "x-api-key: sandgate-placeholder-anthropic\nContent-Length: 2\n"
                           "Connection: close", b"{}", source=SANDBOX_IP)
    assert status == 200, body
    seen = upstream.seen[before:]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    ev = cidr_gw.proxy.wait_audit(lambda e: e.get("gateway") == "/anthropic")
    assert (ev["identity"], ev["identity_source"]) == ("coding-agent", "cidr")


def test_address_identity_and_a_token_of_another_identity_is_refused(cidr_gw, upstream):
    before = len(upstream.seen)
    status, _, body = _raw(cidr_gw, "POST /anthropic/v1/messages HTTP/1.1\nHost: x\n"
                           f"x-api-key: {cidr_gw.proxy.token('bash-tool')}\n"
                           "Content-Length: 2\nConnection: close", b"{}", source=SANDBOX_IP)
    assert status == 401 and _refusal(body)["code"] == "auth_invalid"
    assert len(upstream.seen) == before


def test_a_token_from_an_address_no_range_names_is_its_token(cidr_gw, upstream):
    """issue 38: --identity-cidr (needed for policy DNS) refused every token client elsewhere;
    the ranges say who their addresses are, a client elsewhere is its token's caller."""
    before = len(upstream.seen)
    status, _, body = _post(cidr_gw, "/anthropic/v1/messages",
                            cidr_gw.proxy.token("coding-agent", sandbox="gw-tok"))
    assert status == 200, body
    assert_secret_equal(upstream.seen[before].headers.get("x-api-key"), ANTHROPIC_KEY,
                        "upstream x-api-key")
    ev = cidr_gw.proxy.wait_audit(lambda e: e.get("sandbox") == "gw-tok")
    assert (ev["identity"], ev["identity_source"]) == ("coding-agent", "token")
    status, _, body = _post(cidr_gw, "/anthropic/v1/messages", "sg1.not.a-token")
    assert status == 401 and _refusal(body)["code"] == "auth_invalid"
    assert len(upstream.seen) == before + 1


# ------------------------------------------------------------------ TLS gateway


def test_tls_gateway_serves_a_certificate_for_its_name(tls_gw, upstream):
    tok = tls_gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    r = subprocess.run(
        ["curl", "-sS", "--max-time", "15", "--cacert", str(tls_gw.proxy.ca), "--resolve",
         f"{TLS_NAME}:{tls_gw.port}:{tls_gw.host}", "-w", "\n%{http_code}",
         "-H", f"x-api-key: {tok}", "-d", "{}",
         f"https://{TLS_NAME}:{tls_gw.port}/anthropic/v1/messages"],
        capture_output=True, text=True, env=_clean_env(), timeout=30)
    assert r.stdout.endswith("\n200"), r.stdout + r.stderr
    seen = upstream.seen[before:]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")


def test_tls_gateway_over_http2(tls_gw, upstream):
    tok = tls_gw.proxy.token("coding-agent")
    before = len(upstream.seen)
    r = subprocess.run(
        ["curl", "-sS", "--http2", "--max-time", "15", "--cacert", str(tls_gw.proxy.ca),
         "--resolve", f"{TLS_NAME}:{tls_gw.port}:{tls_gw.host}", "-w", "\n%{http_version}",
         "-H", f"authorization: Bearer {tok}", "-H", "Host: api.openai.com", "-d", "{}",
         f"https://{TLS_NAME}:{tls_gw.port}/anthropic/v1/messages"],
        capture_output=True, text=True, env=_clean_env(), timeout=30)
    assert r.stdout.endswith("\n2"), r.stdout + r.stderr
    assert "hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [(s.host, s.path) for s in seen] == [("api.anthropic.com", "/v1/messages")]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    _no_token_upstream(seen, tok)


def test_tls_gateway_refuses_plain_http(tls_gw, upstream):
    before = len(upstream.seen)
    status, _, body = _post(tls_gw, "/anthropic/v1/messages", tls_gw.proxy.token("coding-agent"))
    assert status == 403 and _refusal(body)["code"] == "not_tls"
    assert len(upstream.seen) == before


def test_proxy_listener_is_unchanged_next_to_the_gateway(gw, upstream):
    from tests.integration.conftest import curl, split_status

    r = curl(gw.proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200
