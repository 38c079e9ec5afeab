"""The admin listener of a real `sandgate run --admin`: auth, every endpoint, exact metrics."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.admin_support import (
    ADMIN_TOKEN,
    Admin,
    copy_policies,
    delta,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
    wait_for,
)
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SANDGATE,
    SECRET_VALUES,
    curl,
    free_port,
    split_status,
    stop_proxy,
)
from tests.support.bao import SeedableVault
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

LOGIN_LIMIT = 40  # wrong tokens a minute from 127.0.0.1; the last test spends the rest
ENDPOINTS = [("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/policy"),
             ("POST", "/v1/reload"), ("POST", "/v1/explain"), ("POST", "/v1/tokens"),
             ("DELETE", "/v1/sandboxes/sbx-1"), ("GET", "/nope")]


@pytest.fixture(scope="module")
def admin(tmp_path_factory, vault, own_upstream, pki) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("admin")
    a = start_admin_proxy(tmp, copy_policies(tmp), vault, pki,
                          "--admin-login-limit", str(LOGIN_LIMIT))
    yield a
    stop_proxy(a.proxy)
    logs = a.proxy.logs() + a.proxy.audit_file.read_text()
    assert_no_secret([logs], [*SECRET_VALUES, ADMIN_TOKEN], "the proxy's logs or audit")


def test_every_endpoint_but_healthz_needs_the_token(admin):
    assert admin.get("/healthz", token=None) == (200, {"status": "ok"})
    for method, path in ENDPOINTS:
        for token in (None, "wrong", ADMIN_TOKEN + "x", ""):
            status, body = admin.call(method, path, token=token,
                                      body={} if method == "POST" else None)
            assert status == 401, (method, path, token, body)
            assert body["error"] == "unauthorized"


def test_readyz(admin):
    status, body = admin.get("/readyz")
    assert status == 200, body
    assert body["ready"] is True and body["reasons"] == []
    assert body["policy_version"] == admin.version()


def test_policy_endpoint(admin):
    status, doc = admin.get("/v1/policy")
    assert status == 200
    assert len(doc["version"]) == 16
    assert doc["files"] == [str(admin.policies / "test.yaml")]
    assert abs(doc["loaded_at"] - time.time()) < 3600
    ident = doc["identities"]["coding-agent"]
    assert ident["mode"] == "enforce"
    llm = next(r for r in ident["rules"] if r["name"] == "llm")
    assert llm["secrets"] == ["anthropic"] and llm["hosts"] == ["api.anthropic.com"]
    assert "anthropic" in doc["secrets"]
    assert_no_secret([json.dumps(doc)], SECRET_VALUES, "/v1/policy")


@pytest.mark.parametrize(("identity", "method", "url"), [
    ("coding-agent", "POST", "https://api.anthropic.com/v1/messages"),
    ("bash-tool", "POST", "https://api.anthropic.com/v1/messages"),
    ("coding-agent", "GET", "https://upstream.test/admin/x"),
    ("nobody", "GET", "https://upstream.test/"),
])
def test_explain_is_the_cli_explain(admin, identity, method, url):
    status, doc = admin.post("/v1/explain", {"identity": identity, "method": method, "url": url})
    assert status == 200, doc
    # the same --resolve pins as the running proxy: both show the same address step
    pins = [a for a in admin.proxy.proc.args if str(a).startswith("--resolve=")]
    r = subprocess.run([*SANDGATE, "explain", "--policies", str(admin.policies), *pins,
                        "--identity", identity, method, url], capture_output=True, text=True,
                       cwd=str(HERE.parent.parent), env=dict(os.environ), check=False)
    assert json.loads(r.stdout) == doc


def test_explain_takes_headers_as_the_cli_does(admin):
    """`headers` (a signing rule judges those a SigV4 signature covers) as `explain -H`."""
    url = "https://api.anthropic.com/v1/messages"
    status, doc = admin.post("/v1/explain", {"identity": "coding-agent", "method": "POST",
                                              "url": url,
                                              "headers": {"x-amz-copy-source": "/a/b"}})
    assert status == 200, doc
    pins = [a for a in admin.proxy.proc.args if str(a).startswith("--resolve=")]
    r = subprocess.run([*SANDGATE, "explain", "--policies", str(admin.policies), *pins,
                        "--identity", "coding-agent", "-H", "x-amz-copy-source: /a/b", "POST",
                        url], capture_output=True, text=True, cwd=str(HERE.parent.parent),
                       env=dict(os.environ), check=False)
    assert json.loads(r.stdout) == doc
    for bad in ({"x amz": "v"}, {"x-a": 1}, "x-a: v"):
        status, doc = admin.post("/v1/explain", {"identity": "coding-agent", "method": "POST",
                                                  "url": url, "headers": bad})
        assert status == 400 and doc["error"] == "bad_request", doc


def test_explain_takes_the_batch_line_fields(admin, tmp_path):
    """`POST /v1/explain` reads its body as `explain --batch` reads a JSON line (one parser,
    sandgate.explain.inputs): the same fields, the same answer; no file of the proxy's is read,
    and a field it does not know is refused rather than dropped from what is judged."""
    line = {"identity": "coding-agent", "sandbox": "sb-1", "method": "POST",
            "url": "https://api.anthropic.com/v1/messages",
            "body": {"jsonrpc": "2.0", "id": 1, "method": "ping"},
            "headers": {"x-amz-copy-source": ["/a/b"]}}
    status, doc = admin.post("/v1/explain", line)
    assert status == 200, doc
    pins = [a for a in admin.proxy.proc.args if str(a).startswith("--resolve=")]
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps(line) + "\n")
    r = subprocess.run([*SANDGATE, "explain", "--policies", str(admin.policies), *pins,
                        "--batch", str(batch)], capture_output=True, text=True,
                       cwd=str(HERE.parent.parent), env=dict(os.environ), check=False)
    (got,) = [json.loads(x) for x in r.stdout.splitlines()]
    assert got.pop("line") == 1 and got == doc
    for bad, why in (({"body_file": "/etc/passwd"}, "body_file"), ({"bodyy": "x"}, "bodyy"),
                     ({"body": "x", "rpc_method": "ping"}, "not both")):
        base = {k: v for k, v in line.items() if k not in ("body", "headers")}
        status, err = admin.post("/v1/explain", {**base, **bad})
        assert status == 400 and why in err["reason"], err


def test_explain_bad_input(admin):
    assert admin.post("/v1/explain", {"identity": "bash-tool"})[0] == 400
    status, doc = admin.post("/v1/explain", {"identity": "bash-tool", "method": "GET",
                                              "url": "not a url"})
    assert status == 400 and doc["error"] == "bad_request"
    assert admin.call("POST", "/v1/explain", body=[1, 2])[0] == 400


def test_tokens_issue_a_working_token(admin, own_upstream):
    status, doc = admin.post("/v1/tokens", {"identity": "bash-tool", "sandbox": "sb-1",
                                             "ttl": "15m"})
    assert status == 200, doc
    assert doc["identity"] == "bash-tool" and doc["ttl"] == 900 and doc["sandbox"] == "sb-1"
    r = curl(admin.proxy, "bash-tool", "https://upstream.test/docs/via-api-token",
             token=doc["token"])
    assert split_status(r.stdout)[1] == 200
    ev = admin.proxy.wait_audit(lambda e: e.get("path") == "/docs/via-api-token")
    assert ev["sandbox"] == "sb-1"
    ev = admin.proxy.wait_audit(lambda e: e["event"] == "token" and e["sandbox"] == "sb-1")
    assert ev["identity"] == "bash-tool" and ev["ttl"] == 900
    assert doc["token"] not in admin.proxy.audit_file.read_text()
    # default TTL, unknown identity, over the cap, junk
    assert admin.post("/v1/tokens", {"identity": "bash-tool"})[1]["ttl"] == 3600
    status, doc = admin.post("/v1/tokens", {"identity": "nobody"})
    assert status == 404 and doc["error"] == "unknown_identity"
    status, doc = admin.post("/v1/tokens", {"identity": "bash-tool", "ttl": "2d"})
    assert status == 400 and doc["error"] == "ttl_too_long"
    assert admin.post("/v1/tokens", {"identity": "bash-tool", "ttl": "soon"})[0] == 400
    assert admin.post("/v1/tokens", {"identity": "bash-tool", "ttl": -5})[0] == 400


def test_reload_api_unchanged(admin):
    v = admin.version()
    status, doc = admin.post("/v1/reload")
    assert status == 200
    assert doc["outcome"] == "unchanged" and doc["version"] == v and doc["trigger"] == "api"


def test_metrics_move_by_exactly_what_was_sent(admin, own_upstream):
    before = admin.metrics()
    for i in range(3):  # allowed, no secret
        r = curl(admin.proxy, "bash-tool", f"https://upstream.test/docs/m{i}")
        assert split_status(r.stdout)[1] == 200
    for _ in range(2):  # refused inside the tunnel: no rule
        r = curl(admin.proxy, "bash-tool", "https://upstream.test/page")
        assert split_status(r.stdout)[1] == 403
    r = curl(admin.proxy, "coding-agent", "https://upstream.test/admin/x")  # deny rule
    assert split_status(r.stdout)[1] == 403
    for _ in range(2):  # injected
        r = curl(admin.proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
        assert split_status(r.stdout)[1] == 200
    # exfiltration: the anthropic placeholder sent where no rule binds it
    r = curl(admin.proxy, "coding-agent", "https://upstream.test/page",
             "-H", "x-leak: sandgate-placeholder-anthropic")
    assert split_status(r.stdout)[1] == 403
    # reflected key scrubbed: a redaction
    r = curl(admin.proxy, "coding-agent", "https://api.anthropic.com/echo-key")
    assert split_status(r.stdout)[1] == 200 and ANTHROPIC_KEY not in r.stdout

    def settled():
        after = admin.metrics()
        n = delta(before, after, "sandgate_requests_total")
        return after if n >= 10 else None

    after = wait_for(settled, 5, "10 requests counted")
    d = lambda name, **kw: delta(before, after, name, **kw)  # noqa: E731
    assert d("sandgate_requests_total") == 10
    assert d("sandgate_requests_total", identity="bash-tool", rule="docs-only",
             decision="allow", code="none") == 3
    assert d("sandgate_requests_total", identity="bash-tool", rule="none", decision="deny",
             code="no_rule") == 2
    assert d("sandgate_requests_total", identity="coding-agent", rule="no-admin",
             decision="deny", code="denied_by_rule") == 1
    assert d("sandgate_requests_total", identity="coding-agent", rule="llm",
             decision="allow", code="none") == 2
    assert d("sandgate_requests_total", identity="coding-agent", code="exfiltration") == 1
    assert d("sandgate_injections_total", secret="anthropic") == 3  # 2 messages + echo-key
    assert d("sandgate_exfiltration_attempts_total", secret="anthropic") == 1
    assert d("sandgate_redactions_total") >= 1
    assert d("sandgate_upstream_responses_total", status_class="2xx") == 6
    assert d("sandgate_connects_total", decision="allow") == 10
    assert d("sandgate_request_duration_seconds_count") == 10
    assert d("sandgate_secret_cache_hits_total", secret="anthropic") \
        + d("sandgate_secret_cache_misses_total", secret="anthropic") == 3
    assert after[("sandgate_policy_info", (("version", admin.version()),))] == 1
    assert ("sandgate_open_client_connections", ()) in after
    assert ("sandgate_open_tunnels", ()) in after
    text = admin.get("/metrics")[1]
    assert_no_secret([text], [*SECRET_VALUES, ADMIN_TOKEN], "/metrics")
    assert "/docs/" not in text and "placeholder" not in text


def test_unknown_identity_is_one_label(admin):
    before = admin.metrics()
    tok = admin.proxy.token("ghost-identity-x")
    r = curl(admin.proxy, "ghost-identity-x", "https://upstream.test/docs/a", token=tok)
    assert split_status(r.stdout)[1] == 403
    after = wait_for(lambda: (m := admin.metrics()) and
                     delta(before, m, "sandgate_connects_total") >= 1 and m, 5, "connect")
    assert not any("ghost" in str(k) for k in after)


def test_secret_fetch_metrics_and_vault_latency(admin):
    before = admin.metrics()
    r = curl(admin.proxy, "coding-agent", "https://api.anthropic.com/missing-secret")
    assert split_status(r.stdout)[1] == 503
    after = wait_for(lambda: (m := admin.metrics()) and
                     delta(before, m, "sandgate_secret_fetches_total", secret="missing") and m,
                     5, "a fetch counted")
    assert delta(before, after, "sandgate_secret_fetches_total", secret="missing",
                 outcome="notfound") == 1
    assert delta(before, after, "sandgate_vault_request_duration_seconds_count") >= 1


# ------------------------------------------------------------------ start-up refusals

def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "SANDGATE_"))}
    e.update(env or {})
    return subprocess.run([*SANDGATE, "run", *args], capture_output=True, text=True, env=e,
                          timeout=60, cwd=str(HERE.parent.parent), check=False)


def test_admin_on_the_proxy_address_is_refused(tmp_path):
    port = free_port()
    r = _run("--policies", str(HERE / "policies"), "--confdir", str(tmp_path),
             "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{port}",
             env={"SANDGATE_ADMIN_TOKEN": "x", "VAULT_ADDR": "http://127.0.0.1:1",
                  "VAULT_TOKEN": "t"})
    assert r.returncode == 2 and "own port" in r.stderr


def test_admin_without_a_token_is_refused(tmp_path):
    r = _run("--policies", str(HERE / "policies"), "--confdir", str(tmp_path),
             "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
             env={"VAULT_ADDR": "http://127.0.0.1:1", "VAULT_TOKEN": "t"})
    assert r.returncode == 2 and "SANDGATE_ADMIN_TOKEN" in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = _run("--policies", str(HERE / "policies"), "--confdir", str(tmp_path),
             "--admin", f"127.0.0.1:{free_port()}", "--admin-token-file", str(empty),
             env={"VAULT_ADDR": "http://127.0.0.1:1", "VAULT_TOKEN": "t"})
    assert r.returncode == 2 and "empty" in r.stderr


def test_broken_policy_refused_before_anything_binds_or_prints(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "a.yaml").write_text("version: v1\nidentities:\n  x:\n    rules:\n      - name: r\n"
                              "        hostz: [a.example]\n")
    port = free_port()
    r = _run("--policies", str(d), "--confdir", str(tmp_path / "conf"),
             "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1
    assert r.stderr.startswith("sandgate: not starting: ")
    assert f"{d / 'a.yaml'}:6:" in r.stderr and "hostz" in r.stderr and "Fix:" in r.stderr
    assert "listening" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "conf").exists()  # nothing created, no dev Vault started


# ------------------------------------------------------------------ readiness follows Vault

@pytest.fixture
def own_vault():
    v = SeedableVault()
    v.start()
    v.put_kv2("llm/anthropic", {"api_key": ANTHROPIC_KEY})
    yield v
    v.stop()


def test_readyz_follows_vault_without_a_restart(tmp_path, own_vault, own_upstream, pki):
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), own_vault, pki)
    try:
        assert a.get("/readyz")[0] == 200
        own_vault.stop()
        _, body = wait_for(lambda: r if (r := a.get("/readyz"))[0] == 503 else None, 10,
                                "/readyz 503 with Vault down")
        assert body["ready"] is False
        assert any(r.startswith("vault: ") for r in body["reasons"]), body
        assert a.get("/healthz", token=None)[0] == 200
        own_vault.start()
        wait_for(lambda: a.get("/readyz")[0] == 200, 15, "/readyz 200 with Vault back")
        assert a.proxy.proc.poll() is None
    finally:
        stop_proxy(a.proxy)


@pytest.mark.parametrize("name,rdtype", [("upstream.test", "A"), ("upstream.test", "TXT"),
                                         ("data.attacker.example", "A")])
def test_explain_dns_matches_the_cli(admin, name, rdtype):
    status, doc = admin.post("/v1/explain", {"identity": "bash-tool", "dns": name,
                                             "type": rdtype})
    assert status == 200, doc
    r = subprocess.run([*SANDGATE, "explain", "--policies", str(admin.policies), "--identity",
                        "bash-tool", "--dns", name, "--type", rdtype], capture_output=True,
                       text=True, cwd=str(HERE.parent.parent), env=dict(os.environ), check=False)
    assert json.loads(r.stdout) == doc
    assert doc["decision"] == ("resolve" if (name, rdtype) == ("upstream.test", "A") else "refuse")
    assert admin.post("/v1/explain", {"identity": "bash-tool", "dns": name,
                                      "type": "NOPE"})[0] == 400


def test_wrong_tokens_are_audited_and_bounded_then_even_the_right_one_waits(admin):
    """Last in this module (it spends 127.0.0.1's budget of wrong tokens): each wrong token is
    an `admin_login` audit event without the token; past --admin-login-limit a minute the
    address is answered 429 with Retry-After, even with the right token."""
    wrong = 0
    for _ in range(LOGIN_LIMIT + 1):
        status, body = admin.get("/v1/policy", token="wrong-guess-7")
        if status == 429:
            break
        assert status == 401, body
        wrong += 1
    assert status == 429 and body["error"] == "too_many_failures", body
    assert 1 <= wrong <= LOGIN_LIMIT
    status, body = admin.get("/v1/policy")  # the right token, from the same address
    assert status == 429 and body["error"] == "too_many_failures"
    failed = [e for e in admin.proxy.audit() if e.get("event") == "admin_login"]
    assert len(failed) >= wrong and all(
        e["action"] == "failed" and e["via"] == "admin_api" and e["source"] == "127.0.0.1"
        for e in failed)
    assert "wrong-" not in admin.proxy.audit_file.read_text()
