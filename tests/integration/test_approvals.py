"""`action: ask` end to end: a real `sandgate run` (OpenBao for the injected key and the webhook's
HMAC key, a TLS upstream on loopback), curl through the proxy, approvers through the admin API
and `sandgate approvals`, a webhook receiver that verifies the signature, and two proxies
sharing a real redis-server.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandgate.approvals.webhook import verify
from tests.integration.admin_support import Admin, wait_for
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SANDGATE,
    SECRET_VALUES,
    Proxy,
    free_port,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.proxy_stack import refusal_doc
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.integration

OWN_IP = "127.0.62.2"  # the TLS upstream of these tests
HOOK_IP = "127.0.62.3"  # the webhook receiver
REDIS_IP = "127.0.62.4"  # the shared redis-server
NAMES = ("api.anthropic.com", "upstream.test")
ADMIN_TOKEN = "test-admin-token-approvals-1"
TOKENS = {"alice": "test-alice-token-1", "bob": "test-bob-token-2",
          "vic": "test-viewer-token-3"}
HOOK_KEY = "test-hook-hmac-key-4b1e"

POLICY = f"""
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
  hook-key: {{vault: secret/data/approvals/hook, field: key}}
webhooks:
  ops: {{url: "http://{HOOK_IP}:HOOK_PORT/hook", format: slack, secret: hook-key}}
  raw: {{url: "http://{HOOK_IP}:HOOK_PORT/json", format: json, secret: hook-key}}
identities:
  agent:
    rules:
      - name: messages
        action: ask
        description: model calls need a human
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{OWN_IP}/32]
        approval: {{timeout: 30, remember: [request, sandbox, identity], webhook: ops}}
      - name: short
        action: ask
        hosts: [upstream.test]
        paths: [/short/**]
        private_cidrs: [{OWN_IP}/32]
        approval: {{timeout: 2, webhook: raw}}
      - name: two-person
        action: ask
        hosts: [upstream.test]
        paths: [/two/**]
        private_cidrs: [{OWN_IP}/32]
        approval: {{require_approvers: 2, approvers: [alice, bob], timeout: 30}}
      - name: later
        action: ask
        hosts: [upstream.test]
        paths: [/async/**]
        private_cidrs: [{OWN_IP}/32]
        approval: {{mode: async, timeout: 60}}
      - name: docs
        hosts: [upstream.test]
        private_cidrs: [{OWN_IP}/32]
tests:
  - {{identity: agent, request: POST https://api.anthropic.com/v1/messages, expect: ask,
     rule: messages}}
  - {{identity: agent, request: GET https://upstream.test/two/x, expect: ask, rule: two-person}}
  - {{identity: agent, request: GET https://upstream.test/docs, expect: allow, rule: docs}}
"""


@dataclass
class Receiver:
    """A webhook receiver: records each post and whether its signature verified."""

    port: int
    posts: list[dict[str, Any]] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        posts = self.posts

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                ok = verify(HOOK_KEY.encode(), self.headers.get("X-Sandgate-Timestamp", ""),
                            body, self.headers.get("X-Sandgate-Signature", ""))
                posts.append({"path": self.path, "verified": ok, "body": json.loads(body),
                              "raw": body.decode()})
                self.send_response(200 if ok else 401)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOOK_IP, self.port), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self


@pytest.fixture(scope="module")
def upstream(pki) -> Iterator[UpstreamServer]:
    s = UpstreamServer(OWN_IP, 443, str(pki.cert), str(pki.key)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver(free_port()).start()
    yield r
    assert r.server is not None
    r.server.shutdown()


def write_setup(tmp: Path, vault, receiver: Receiver) -> tuple[Path, Path]:
    vault.put_kv2("approvals/hook", {"key": HOOK_KEY})
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "approvals.yaml").write_text(POLICY.replace("HOOK_PORT", str(receiver.port)))
    users = tmp / "users.yaml"
    users.write_text("users:\n" + "".join(
        f"  {n}: {{role: {'viewer' if n == 'vic' else 'approver'}, token_sha256: "
        f"{hashlib.sha256(t.encode()).hexdigest()}}}\n" for n, t in TOKENS.items()))
    return pol, users


def start(tmp: Path, pol: Path, users: Path, vault, pki, *extra: str) -> Admin:
    aport = free_port()
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
           "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    resolve = [f"--resolve={n}={OWN_IP}" for n in NAMES]
    p = start_proxy(tmp, pol, env, pki, *resolve, "--admin", f"127.0.0.1:{aport}",
                    "--admin-users", str(users), *extra)
    admin = Admin(p, f"http://127.0.0.1:{aport}", pol)
    wait_for(lambda: _up(admin), 15, "the admin listener")
    return admin


def _up(admin: Admin) -> bool:
    try:
        return admin.get("/healthz", token=None, timeout=2)[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, vault, pki, upstream, receiver) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("approvals")
    pol, users = write_setup(tmp, vault, receiver)
    a = start(tmp, pol, users, vault, pki)
    yield a
    stop_proxy(a.proxy)
    logs = a.proxy.logs() + a.proxy.audit_file.read_text()
    assert_no_secret([logs], [*SECRET_VALUES, ADMIN_TOKEN, HOOK_KEY, *TOKENS.values()],
                     "the proxy's logs or audit")


_TOKENS: dict[tuple[Path, str | None], str] = {}


def token_for(p: Proxy, sandbox: str | None) -> str:
    """One token per proxy and sandbox (issuing one starts a Python process)."""
    key = (p.confdir, sandbox)
    if key not in _TOKENS:
        _TOKENS[key] = p.token("agent", sandbox=sandbox)
    return _TOKENS[key]


def start_curl(p: Proxy, url: str, *args: str, sandbox: str | None = None,
               max_time: int = 40) -> subprocess.Popen[str]:
    token = token_for(p, sandbox)
    cmd = ["curl", "-sS", "--max-time", str(max_time), "--proxy", p.url,
           "--proxy-user", f"agent:{token}", "--cacert", str(p.ca), "-w", "\n%{http_code}",
           "-D", "-", url, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(c: subprocess.Popen[str]) -> tuple[str, int]:
    out, errs = c.communicate(timeout=60)
    assert c.returncode == 0, errs
    return split_status(out)


def pending_for(a: Admin, path: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        status, doc = a.get("/v1/approvals", token=TOKENS["vic"])
        assert status == 200, doc
        return next((x for x in doc["approvals"] if x["url"].endswith(path)), None)
    got = wait_for(find, 30, f"a pending approval for {path}")
    assert isinstance(got, dict)
    return got


def seen(upstream: UpstreamServer, path: str) -> int:
    return sum(1 for s in upstream.upstream.seen if s.path == path)


def decide(a: Admin, approval: str, user: str, decision: str = "approve",
           scope: dict[str, Any] | None = None) -> tuple[int, Any]:
    body: dict[str, Any] = {"decision": decision}
    if scope is not None:
        body["scope"] = scope
    return a.post(f"/v1/approvals/{approval}", body, token=TOKENS[user])


def cli(a: Admin, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SANDGATE_ADMIN_URL": a.url, "SANDGATE_ADMIN_TOKEN": TOKENS[user]}
    return subprocess.run([*SANDGATE, "approvals", *args], capture_output=True, text=True,
                          env=env, timeout=60, cwd=str(HERE.parent.parent), check=False)


# --------------------------------------------------------------------------- held, approved

def test_held_until_approved_through_the_api(proxy, upstream, receiver):
    path = "/v1/messages"
    before = seen(upstream, path)
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi ?key=x"}]}'
    c = start_curl(proxy.proxy, f"https://api.anthropic.com{path}?beta=true", "-X", "POST",
                   "-H", "content-type: application/json", "--data", body)
    ap = pending_for(proxy, path + "?beta=REDACTED")
    # who, what, why; never the body or a secret
    assert ap["identity"] == "agent" and ap["method"] == "POST" and ap["rule"] == "messages"
    assert ap["url"] == "https://api.anthropic.com/v1/messages?beta=REDACTED"
    assert ap["body_sha256"] == hashlib.sha256(body.encode()).hexdigest()
    assert ap["body_size"] == len(body) and ap["reason"] == "model calls need a human"
    assert "hi ?key" not in json.dumps(ap)
    assert seen(upstream, path) == before  # nothing went upstream while held
    # a viewer may look but not decide
    status, doc = decide(proxy, ap["id"], "vic")
    assert status == 403 and doc["error"] == "forbidden"
    status, doc = decide(proxy, ap["id"], "alice")
    assert status == 200 and doc["state"] == "approved", doc
    assert doc["approved_by"] == ["alice"]
    text, code = finish(c)
    assert code == 200, text
    assert seen(upstream, path) == before + 1
    sent = [s for s in upstream.upstream.seen if s.path == path][-1]
    assert sent.headers["x-api-key"] == ANTHROPIC_KEY  # injected after approval, from OpenBao
    assert sent.body == body.encode()
    # deciding again: already decided (used)
    assert decide(proxy, ap["id"], "bob")[0] == 409
    ev = proxy.proxy.wait_audit(lambda e: e["event"] == "approval"
                                and e.get("action") == "decided" and e["approval"] == ap["id"])
    assert ev["approver"] == "alice" and ev["decision"] == "approve"
    assert ev["scope"] == {"kind": "request", "ttl": None}
    proxy.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "used"
                           and e["approval"] == ap["id"])
    flow = proxy.proxy.wait_audit(lambda e: e.get("path", "").startswith(path)
                                  and e["event"] != "approval")
    assert flow["decision"] == "allow" and flow["rule"] == "messages"
    # the webhook got it, signed (Slack format)
    post = wait_for(lambda: next((p for p in receiver.posts if ap["id"] in p["raw"]), None), 10,
                    "the webhook post")
    assert post["verified"] and post["path"] == "/hook"
    assert ap["id"] in post["body"]["text"] and post["body"]["blocks"]
    assert ANTHROPIC_KEY not in post["raw"] and "hi ?key" not in post["raw"]


SDK_SCRIPT = """
import anthropic
client = anthropic.Anthropic(timeout=60, max_retries=0)
msg = client.messages.create(model="claude-test", max_tokens=8,
                             messages=[{"role": "user", "content": "deploy?"}])
print("TEXT:", msg.content[0].text)
"""


def test_the_anthropic_sdk_waits_for_the_approval(proxy, upstream):
    """The official SDK holding a placeholder key: its call waits, held, and returns the
    upstream's answer once approved (the real key injected only then)."""
    need_sdk("anthropic")
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
    env.update({"HTTPS_PROXY": f"http://agent:{token_for(proxy.proxy, None)}@"
                f"{proxy.proxy.host}:{proxy.proxy.port}", "NO_PROXY": "",
                "SSL_CERT_FILE": str(proxy.proxy.ca),
                "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    sdk = subprocess.Popen([str(CLIENT_PY), "-c", SDK_SCRIPT], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    ap = wait_for(lambda: next((a for a in proxy.get("/v1/approvals", token=TOKENS["vic"])[1]
                                ["approvals"] if a["body_size"] and "deploy?" not in a["url"]
                                and a["url"].endswith("/v1/messages")), None),
                  30, "the SDK's request held")
    before = seen(upstream, "/v1/messages")
    assert sdk.poll() is None
    assert decide(proxy, ap["id"], "bob")[0] == 200
    out, errs = sdk.communicate(timeout=60)
    assert sdk.returncode == 0, errs[-2000:]
    assert "TEXT: hello from the test upstream" in out
    assert seen(upstream, "/v1/messages") == before + 1
    sent = [s for s in upstream.upstream.seen if s.path == "/v1/messages"][-1]
    assert sent.headers["x-api-key"] == ANTHROPIC_KEY and b"deploy?" in sent.body
    assert_no_secret([out, errs], SECRET_VALUES, "the SDK output")


def test_approved_through_the_cli(proxy, upstream):
    c = start_curl(proxy.proxy, "https://upstream.test/two/cli")
    ap = pending_for(proxy, "/two/cli")
    r = cli(proxy, "alice", "list")
    assert r.returncode == 0 and ap["id"] in r.stdout and "/two/cli" in r.stdout, r.stderr
    r = cli(proxy, "alice", "approve", ap["id"], "--note", "ok by me")
    assert r.returncode == 0 and "needs 1 more" in r.stdout, r.stderr
    # the same approver again counts once
    assert cli(proxy, "alice", "approve", ap["id"]).returncode == 0
    # meanwhile other requests pass: a held request holds only itself
    text, code = finish(start_curl(proxy.proxy, "https://upstream.test/docs/while-held"))
    assert code == 200, text
    assert c.poll() is None and seen(upstream, "/two/cli") == 0  # one approver is not enough
    r = cli(proxy, "bob", "approve", ap["id"])
    assert r.returncode == 0 and "approved" in r.stdout, r.stderr
    text, code = finish(c)
    assert code == 200, text
    assert seen(upstream, "/two/cli") == 1
    shown = json.loads(cli(proxy, "vic", "show", ap["id"]).stdout)
    assert shown["state"] == "used" and shown["approved_by"] == ["alice", "bob"]
    assert [v["note"] for v in shown["votes"]][:1] == ["ok by me"]


def test_two_person_rule_names_its_approvers(proxy):
    c = start_curl(proxy.proxy, "https://upstream.test/two/admin")
    ap = pending_for(proxy, "/two/admin")
    status, doc = proxy.post(f"/v1/approvals/{ap['id']}", {"decision": "approve"},
                             token=ADMIN_TOKEN)
    assert status == 403 and doc["error"] == "not_an_approver"  # admin is not alice or bob
    assert decide(proxy, ap["id"], "bob", "deny")[0] == 200
    text, code = finish(c)
    assert code == 403 and '"approval_denied"' in text


def test_denied(proxy, upstream):
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                   "--data", "{}")
    ap = pending_for(proxy, "/v1/messages")
    before = seen(upstream, "/v1/messages")
    r = cli(proxy, "bob", "deny", ap["id"], "--note", "not now")
    assert r.returncode == 0 and "denied" in r.stdout, r.stderr
    text, code = finish(c)
    assert code == 403
    doc = refusal_doc(text.rpartition("\n\n")[2])
    assert doc["code"] == "approval_denied" and doc["approval"] == ap["id"]
    assert "bob" in doc["reason"]
    assert seen(upstream, "/v1/messages") == before
    ev = proxy.proxy.wait_audit(lambda e: e["event"] == "approval"
                                and e.get("action") == "decided" and e["approval"] == ap["id"])
    assert ev["approver"] == "bob" and ev["decision"] == "deny" and ev["note"] == "not now"


def test_timed_out(proxy, upstream, receiver):
    c = start_curl(proxy.proxy, "https://upstream.test/short/x")
    ap = pending_for(proxy, "/short/x")
    text, code = finish(c)
    assert code == 403
    doc = refusal_doc(text.rpartition("\n\n")[2])
    assert doc["code"] == "approval_timeout" and doc["approval"] == ap["id"]
    assert seen(upstream, "/short/x") == 0
    proxy.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "timed_out"
                           and e["approval"] == ap["id"])
    assert decide(proxy, ap["id"], "alice")[0] == 409
    post = wait_for(lambda: next((p for p in receiver.posts if p["path"] == "/json"), None), 10,
                    "the json webhook post")
    assert post["verified"] and post["body"]["event"] == "approval_requested"
    assert post["body"]["approval"]["id"] == ap["id"]
    status, text = proxy.get("/metrics", token=TOKENS["vic"])
    assert status == 200 and 'sandgate_approval_events_total{action="timed_out"}' in text


def test_remembered_for_a_sandbox(proxy, upstream):
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                   "--data", '{"n": 1}', sandbox="sb-remember")
    ap = pending_for(proxy, "/v1/messages")
    assert ap["sandbox"] == "sb-remember"
    status, doc = decide(proxy, ap["id"], "alice", scope={"kind": "sandbox", "ttl": 600})
    assert status == 200 and doc["scope"] == {"kind": "sandbox", "ttl": 600}, doc
    assert finish(c)[1] == 200
    before = seen(upstream, "/v1/messages")
    # the same sandbox, another body: passes without asking
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                   "--data", '{"n": 2}', sandbox="sb-remember")
    assert finish(c)[1] == 200
    assert seen(upstream, "/v1/messages") == before + 1
    ev = proxy.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "used"
                                and e.get("grant") == "sandbox")
    assert ev["approval"] == ap["id"] and ev["approvers"] == ["alice"]
    # another sandbox is asked again
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                   "--data", '{"n": 3}', sandbox="sb-other")
    other = pending_for(proxy, "/v1/messages")
    assert other["sandbox"] == "sb-other"
    decide(proxy, other["id"], "alice", "deny")
    assert finish(c)[1] == 403


def test_async_mode_202_then_the_identical_request_passes(proxy, upstream):
    url = "https://upstream.test/async/deploy?env=prod"
    text, code = finish(start_curl(proxy.proxy, url, "-X", "POST", "--data", "v1"))
    assert code == 202, text
    head, _, body = text.rpartition("\n\n")
    assert "retry-after: 30" in head.lower()
    doc = json.loads(body)
    assert doc["code"] == "approval_pending"
    aid = doc["approval"]
    assert f"x-sandgate-approval: {aid.lower()}" in head.lower()
    # asked again before a decision: the same approval, still 202
    text, code = finish(start_curl(proxy.proxy, url, "-X", "POST", "--data", "v1"))
    assert code == 202 and json.loads(text.rpartition("\n\n")[2])["approval"] == aid
    assert seen(upstream, "/async/deploy") == 0
    assert decide(proxy, aid, "bob")[0] == 200
    # a different body is another request: not approved
    text, code = finish(start_curl(proxy.proxy, url, "-X", "POST", "--data", "v2"))
    assert code == 202 and json.loads(text.rpartition("\n\n")[2])["approval"] != aid
    # the identical request passes, once
    text, code = finish(start_curl(proxy.proxy, url, "-X", "POST", "--data", "v1"))
    assert code == 200, text
    assert seen(upstream, "/async/deploy") == 1
    text, code = finish(start_curl(proxy.proxy, url, "-X", "POST", "--data", "v1"))
    assert code == 202  # one grant, one use


def _202(text: str) -> str:
    """The approval id of a 202 approval_pending answer."""
    doc = json.loads(text.rpartition("\n\n")[2])
    assert doc["code"] == "approval_pending", doc
    return str(doc["approval"])


def test_an_approval_covers_the_headers_it_was_asked_with(proxy, upstream):
    """Issue 34: approved once, the "identical" request must not go out with another method
    override, another Content-Type or another target header under that approval: each is a new
    pending approval, shown to approvers with its headers. The same headers (in another order
    and case, with other hop-by-hop headers) are covered."""
    url, path = "https://upstream.test/async/headers?env=prod", "/async/headers"
    base = ["-X", "POST", "--data", "v1", "-H", "content-type: application/json",
            "-H", "x-target-env: staging"]
    text, code = finish(start_curl(proxy.proxy, url, *base))
    assert code == 202, text
    aid = _202(text)
    assert decide(proxy, aid, "alice")[0] == 200
    others = []
    for what, extra in [
        ("method override", [*base, "-H", "X-HTTP-Method-Override: DELETE"]),
        ("content type", [*base[:4], "-H", "content-type: text/plain", *base[6:]]),
        ("target env", [*base[:6], "-H", "x-target-env: production"]),
    ]:
        text, code = finish(start_curl(proxy.proxy, url, *extra))
        assert code == 202, (what, text)  # not sent under the approval
        others.append(_202(text))
        assert others[-1] != aid, what
        assert seen(upstream, path) == 0, what
    # what approvers see: the headers each one binds
    status, ap = proxy.get(f"/v1/approvals/{aid}", token=TOKENS["vic"])
    assert status == 200 and ["x-target-env", "staging"] in ap["headers"], ap
    assert ["content-type", "application/json"] in ap["headers"]
    assert not [h for h in ap["headers"] if h[0] in ("proxy-authorization", "host")]
    shown = [proxy.get(f"/v1/approvals/{o}", token=TOKENS["vic"])[1] for o in others]
    assert all(o["state"] == "pending" and o["headers_sha256"] != ap["headers_sha256"]
               for o in shown)
    assert ["x-http-method-override", "DELETE"] in shown[0]["headers"]
    assert ["content-type", "text/plain"] in shown[1]["headers"]
    assert ["x-target-env", "production"] in shown[2]["headers"]
    # the approved headers, in another order and case, with a hop-by-hop one: covered, once
    same = ["-X", "POST", "--data", "v1", "-H", "X-Target-Env: staging",
            "-H", "Content-Type: application/json", "-H", "TE: trailers"]
    text, code = finish(start_curl(proxy.proxy, url, *same))
    assert code == 200, text
    assert seen(upstream, path) == 1
    sent = [s for s in upstream.upstream.seen if s.path == path][-1]
    assert sent.headers["x-target-env"] == "staging"
    assert "x-http-method-override" not in sent.headers
    text, code = finish(start_curl(proxy.proxy, url, *same))
    assert code == 202 and _202(text) != aid  # one approval, one use


def test_approvers_see_the_headers_scrubbed(proxy, receiver):
    """The headers shown in the admin API, the webhook and the CLI: a placeholder is named, a
    header the rule injects a credential into is shown by name only."""
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages?shown=1", "-X", "POST",
                   "--data", "{}", "-H", "x-api-key: sandgate-placeholder-anthropic",
                   "-H", "x-note: key sandgate-placeholder-anthropic",
                   "-H", "x-target-env: production")
    ap = pending_for(proxy, "/v1/messages?shown=REDACTED")
    assert ["x-note", "key [PLACEHOLDER:anthropic]"] in ap["headers"], ap["headers"]
    assert ["x-target-env", "production"] in ap["headers"]
    assert ap["headers_injected"] == ["x-api-key"]
    assert not [h for h in ap["headers"] if h[0] == "x-api-key"]  # replaced by Sandgate
    post = wait_for(lambda: next((p for p in receiver.posts if ap["id"] in p["raw"]), None), 10,
                    "the webhook post")
    assert "x-note: key [PLACEHOLDER:anthropic]" in post["raw"]
    assert "x-api-key: [injected by Sandgate]" in post["raw"]
    r = cli(proxy, "vic", "list")
    assert r.returncode == 0 and "    x-target-env: production" in r.stdout, r.stderr
    raw = json.dumps(ap) + post["raw"] + r.stdout
    assert "sandgate-placeholder-anthropic" not in raw and ANTHROPIC_KEY not in raw
    decide(proxy, ap["id"], "alice", "deny")
    assert finish(c)[1] == 403


def test_a_remembered_grant_covers_only_the_approved_headers(proxy, upstream):
    """A decision remembered for the sandbox covers its requests with the approved headers;
    another header asks anew, never under the grant."""
    url = "https://api.anthropic.com/v1/messages?grant=1"

    def granted() -> int:
        return sum(1 for s in upstream.upstream.seen
                   if s.path == "/v1/messages" and "grant=1" in s.query)
    hdrs = ["-H", "content-type: application/json", "-H", "x-target-env: staging"]
    c = start_curl(proxy.proxy, url, "-X", "POST", "--data", '{"n": 1}', *hdrs,
                   sandbox="sb-headers")
    ap = pending_for(proxy, "/v1/messages?grant=REDACTED")
    status, doc = decide(proxy, ap["id"], "alice", scope={"kind": "sandbox", "ttl": 600})
    assert status == 200 and doc["state"] == "approved", doc
    assert finish(c)[1] == 200
    # another body, the same headers: remembered
    c = start_curl(proxy.proxy, url, "-X", "POST", "--data", '{"n": 2}', *hdrs,
                   sandbox="sb-headers")
    assert finish(c)[1] == 200
    before = granted()
    c = start_curl(proxy.proxy, url, "-X", "POST", "--data", '{"n": 3}', *hdrs,
                   "-H", "X-HTTP-Method-Override: DELETE", sandbox="sb-headers")

    def held_or_done() -> dict[str, Any] | bool:
        if c.poll() is not None:
            return True  # went through: the grant covered it
        docs = proxy.get("/v1/approvals", token=TOKENS["vic"])[1]["approvals"]
        return next((a for a in docs if a["sandbox"] == "sb-headers"
                     and ["x-http-method-override", "DELETE"] in a.get("headers", [])), False)
    other = wait_for(held_or_done, 30, "the request held anew")
    assert isinstance(other, dict), finish(c)
    assert other["id"] != ap["id"] and c.poll() is None
    decide(proxy, other["id"], "alice", "deny")
    assert finish(c)[1] == 403
    assert granted() == before
    # the grant says what it binds: the rule's requests from the sandbox with those headers
    assert doc["binds"] == {
        "kind": "sandbox", "rule": "messages", "identity": "agent", "sandbox": "sb-headers",
        "headers_sha256": ap["headers_sha256"], "until": doc["binds"]["until"]}, doc
    assert doc["binds"]["until"] > time.time()


def test_a_client_that_leaves_withdraws_its_approval(proxy, upstream):
    c = start_curl(proxy.proxy, "https://upstream.test/two/gone")
    ap = pending_for(proxy, "/two/gone")
    c.kill()
    c.wait(10)

    def state() -> str:
        return str(proxy.get(f"/v1/approvals/{ap['id']}", token=TOKENS["vic"])[1]["state"])
    wait_for(lambda: state() == "withdrawn", 10, "the approval withdrawn")
    status, doc = decide(proxy, ap["id"], "alice")
    assert status == 409 and doc["error"] == "already_decided"
    proxy.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "withdrawn"
                           and e["approval"] == ap["id"])
    assert seen(upstream, "/two/gone") == 0


def test_watch_streams_new_approvals(proxy):
    env = {**os.environ, "SANDGATE_ADMIN_URL": proxy.url, "SANDGATE_ADMIN_TOKEN": TOKENS["vic"]}
    w = subprocess.Popen([*SANDGATE, "approvals", "--json", "watch", "--interval", "0.2"],
                         stdout=subprocess.PIPE, text=True, env=env,
                         cwd=str(HERE.parent.parent))
    c = start_curl(proxy.proxy, "https://upstream.test/two/watched")
    try:
        assert w.stdout is not None
        while True:  # those pending already, then each new one as it comes
            ap = json.loads(w.stdout.readline())
            if ap["url"].endswith("/two/watched"):
                break
    finally:
        w.kill()
        w.wait(10)
    assert ap["state"] == "pending" and ap["rule"] == "two-person"
    decide(proxy, ap["id"], "alice", "deny")
    assert finish(c)[1] == 403


def test_bad_votes(proxy):
    c = start_curl(proxy.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                   "--data", "{}")
    ap = pending_for(proxy, "/v1/messages")
    bad = [({"decision": "maybe"}, "bad_request"),
           ({"decision": "approve", "approver": "mallory"}, "bad_request"),
           ({"decision": "approve", "scope": {"kind": "forever"}}, "bad_request"),
           ({"decision": "approve", "scope": {"kind": "sandbox"}}, "scope_not_allowed"),
           ({"decision": "approve", "scope": {"kind": "identity", "ttl": 10 ** 9}},
            "ttl_too_long")]
    for body, code in bad:
        status, doc = proxy.post(f"/v1/approvals/{ap['id']}", body, token=TOKENS["alice"])
        assert status == 400 and doc["error"] == code, (body, doc)
    assert proxy.get("/v1/approvals/ap_nope", token=TOKENS["vic"])[0] == 404
    assert proxy.get("/v1/approvals", token="wrong")[0] == 401
    decide(proxy, ap["id"], "alice", "deny")
    assert finish(c)[1] == 403


# --------------------------------------------------------------------------- shared Redis

@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[str]:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is needed (scripts/setup.sh --test installs it)"
    tmp = tmp_path_factory.mktemp("redis")
    port = 6379
    proc = subprocess.Popen([exe, "--bind", REDIS_IP, "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import socket

    def up() -> bool:
        try:
            with socket.create_connection((REDIS_IP, port), timeout=0.5):
                return True
        except OSError:
            return False
    wait_for(up, 10, "redis-server")
    yield f"redis://{REDIS_IP}:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_decided_on_another_replica(tmp_path_factory, vault, pki, upstream, receiver,
                                    redis_server):
    base = tmp_path_factory.mktemp("replicas")
    pol, users = write_setup(base, vault, receiver)
    (base / "a").mkdir()
    (base / "b").mkdir()
    with ThreadPoolExecutor(2) as pool:  # two interpreters start at once
        fa, fb = (pool.submit(start, base / n, pol, users, vault, pki, "--state",
                              redis_server, "--instance", f"replica-{n}") for n in "ab")
        a, b = fa.result(), fb.result()
    try:
        c = start_curl(a.proxy, "https://upstream.test/two/replicas")
        ap = pending_for(b, "/two/replicas")  # replica b lists what replica a holds
        assert ap["replica"] == "replica-a"
        assert decide(b, ap["id"], "alice")[1]["state"] == "pending"
        assert decide(a, ap["id"], "alice")[1]["approved_by"] == ["alice"]  # counted once
        assert decide(b, ap["id"], "bob")[1]["state"] == "approved"
        text, code = finish(c)
        assert code == 200, text
        assert seen(upstream, "/two/replicas") == 1
        b.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "decided"
                           and e["approver"] == "bob")
        a.proxy.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "used"
                           and e["approval"] == ap["id"])
    finally:
        stop_proxy(a.proxy)
        stop_proxy(b.proxy)


def test_workers_hold_and_the_front_decides(tmp_path_factory, vault, pki, upstream, receiver):
    """--workers 2: requests are held in the workers; the one admin listener lists and decides
    them, and a decision remembered for a sandbox reaches every worker."""
    tmp = tmp_path_factory.mktemp("workers")
    pol, users = write_setup(tmp, vault, receiver)
    a = start(tmp, pol, users, vault, pki, "--workers", "2")
    try:
        c = start_curl(a.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                       "--data", '{"w": 1}', sandbox="sb-workers")
        ap = pending_for(a, "/v1/messages")
        assert decide(a, ap["id"], "vic")[0] == 403  # the front holds viewers to their role
        status, doc = decide(a, ap["id"], "alice", scope={"kind": "sandbox", "ttl": 600})
        assert status == 200 and doc["state"] == "approved", doc
        assert finish(c)[1] == 200
        status, doc = a.get(f"/v1/approvals/{ap['id']}", token=TOKENS["vic"])
        assert status == 200 and doc["approved_by"] == ["alice"]
        for i in range(4):  # new connections: spread over both workers, none asks again
            c = start_curl(a.proxy, "https://api.anthropic.com/v1/messages", "-X", "POST",
                           "--data", f'{{"again": {i}}}', sandbox="sb-workers")
            assert finish(c)[1] == 200
        ev = a.proxy.wait_audit(lambda e: e["event"] == "approval"
                                and e.get("action") == "decided" and e["approval"] == ap["id"])
        assert ev["approver"] == "alice"
    finally:
        stop_proxy(a.proxy)


def test_redis_store_against_a_real_redis(redis_server):
    """The Redis store itself: concurrent votes on two clients both count (WATCH), changes are
    published, grants and the async fingerprint are found, expired pending ones are not listed."""
    import asyncio

    import redis.asyncio

    from sandgate.approvals.redis_approvals import RedisStore
    from sandgate.approvals.votes import Approval, Scope, grant_for, vote

    async def run() -> None:
        prefix = f"t{time.time_ns()}"
        s1 = RedisStore(redis.asyncio.Redis.from_url(redis_server), prefix=prefix, owned=True)
        s2 = RedisStore(redis.asyncio.Redis.from_url(redis_server), prefix=prefix, owned=True)
        now = time.time()
        a = Approval(id="ap_r1", identity="agent", sandbox="sb", method="POST",
                     url="https://x/a", host="x", tool=None, rule="r", rule_source="p:1",
                     body_sha256="0" * 64, body_size=0, headers_sha256="a" * 64,
                     headers=(("x-target-env", "staging"),), headers_injected=(),
                     created=now, expires=now + 60,
                     mode="hold", require_approvers=3, approvers=None,
                     remember=("request", "sandbox"), max_remember_ttl=600, fingerprint="fp1")
        sub = await s2.subscribe()
        await s1.create(a)
        assert (await sub.get()).id == "ap_r1"
        assert [x.id for x in await s2.pending()] == ["ap_r1"]
        assert (await s2.find("fp1")) == a

        def v(user: str) -> Callable[[Approval], Approval]:
            return lambda x: vote(x, user, "approve", Scope("sandbox", 60), None, time.time())
        await asyncio.gather(s1.update("ap_r1", v("alice")), s2.update("ap_r1", v("bob")),
                             s1.update("ap_r1", v("carol")))
        got = await s2.get("ap_r1")
        assert got is not None and got.state == "approved"
        assert sorted(got.approved_by) == ["alice", "bob", "carol"]
        assert await s1.pending() == []
        g = grant_for(got)
        assert g is not None
        await s1.add_grant(g)
        assert await s2.grant("r", "agent", "sb", "a" * 64, time.time()) == g
        assert await s2.grant("r", "agent", "other", "a" * 64, time.time()) is None
        assert await s2.grant("r", "agent", "sb", "b" * 64, time.time()) is None  # headers
        ttl = await s1.r.pttl(f"{prefix}:grant:{g.key}")
        assert 0 < ttl <= 60_000
        expired = Approval.from_dict({**a.as_dict(), "id": "ap_r3", "expires": now - 1,
                                      "votes": []})
        await s1.create(expired)
        assert [x.id for x in await s1.pending()] == []
        await sub.aclose()
        await s1.aclose()
        await s2.aclose()

    asyncio.run(run())


def test_explain_says_ask(proxy):
    status, doc = proxy.post("/v1/explain", {"identity": "agent", "method": "GET",
                                              "url": "https://upstream.test/two/x"},
                             token=TOKENS["vic"])  # a viewer may explain
    assert status == 200, doc
    assert doc["decision"] == "ask" and doc["rule"] == "two-person"
    assert doc["approval"]["require_approvers"] == 2
    assert doc["approval"]["approvers"] == ["alice", "bob"]
    status, doc = proxy.get("/v1/policy", token=TOKENS["vic"])
    rules = {r["name"]: r["action"] for r in doc["identities"]["agent"]["rules"]}
    assert rules["two-person"] == "ask" and rules["docs"] == "allow"
    assert proxy.post("/v1/reload", token=TOKENS["alice"])[0] == 403  # admin only
