"""Issue 38: an `mcp:` on an `action: ask` rule holds the tool calls, not the session.

A real `sandgate run` with OpenBao and approvers, the Python SDK's MCP server behind real TLS
and the SDK as client: the session opens (initialize, notifications/initialized, the GET
stream) and lists its tools without anyone approving; the tool call waits until an approver
approves it, then reaches the server with the injected bearer. With `ask_housekeeping: true`
the session's first request waits too."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admin_support import Admin, wait_for
from tests.integration.conftest import (
    GITHUB_TOKEN,
    SECRET_VALUES,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.support.pki import make_pki
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
SUPPORT = ROOT / "tests" / "support" / "mcp"
SERVER_IP = "127.0.46.1"  # fixed loopback address of this module (its own network namespace)
ADMIN_TOKEN = "test-admin-token-mcp-ask-1"
ALICE = "test-alice-token-mcp-ask-2"
POLICY = f"""
version: v1
secrets:
  gh: {{mount: kv, path: ci/github, field: token, kv_version: 1}}
identities:
  asker:
    rules:
      - {{name: gh-ask, action: ask, hosts: [mcp.test], methods: [GET, POST, DELETE],
         paths: [/mcp], private_cidrs: [{SERVER_IP}/32],
         mcp: {{tools: [list_issues, get_me]}}, approval: {{timeout: 60}},
         inject: {{headers: {{authorization: "Bearer {{{{ secrets.gh }}}}"}}}}}}
  strict:
    rules:
      - {{name: gh-ask-all, action: ask, hosts: [mcp.test], methods: [GET, POST, DELETE],
         paths: [/mcp], private_cidrs: [{SERVER_IP}/32],
         mcp: {{tools: [list_issues], ask_housekeeping: true}}, approval: {{timeout: 60}},
         inject: {{headers: {{authorization: "Bearer {{{{ secrets.gh }}}}"}}}}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, vault: Any) -> Iterator[Admin]:
    need_sdk("mcp")
    tmp = tmp_path_factory.mktemp("mcp-ask")
    pki = make_pki(tmp / "pki", ["mcp.test"])
    log = tmp / "server.log"
    server = subprocess.Popen(
        [str(CLIENT_PY), str(SUPPORT / "server.py"), SERVER_IP, "443", str(pki.cert),
         str(pki.key), "json"], stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "MCP_EXPECTED_TOKEN": GITHUB_TOKEN})
    from tests.integration.test_mcp import _wait_port

    _wait_port(SERVER_IP, 443, server, log)
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "mcp.yaml").write_text(POLICY)
    users = tmp / "users.yaml"
    users.write_text(f"users:\n  alice: {{role: approver, token_sha256: "
                     f"{hashlib.sha256(ALICE.encode()).hexdigest()}}}\n")
    aport = free_port()
    p = start_proxy(tmp, pol, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                               "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, pki,
                    f"--resolve=mcp.test={SERVER_IP}", "--admin", f"127.0.0.1:{aport}",
                    "--admin-users", str(users))
    admin = Admin(p, f"http://127.0.0.1:{aport}", pol)
    wait_for(lambda: admin.get("/healthz", token=None, timeout=2)[0] == 200, 30, "admin")
    yield admin
    stop_proxy(p)
    assert_no_secret([p.logs(), p.audit_file.read_text()], [*SECRET_VALUES, ADMIN_TOKEN, ALICE],
                     "the proxy's logs or audit")
    server.terminate()
    server.wait(10)


def client(admin: Admin, identity: str, steps: list[list[Any]]) -> subprocess.Popen[str]:
    p = admin.proxy
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and "TOKEN" not in k
           and not k.startswith("VAULT")}
    env.update({"HTTPS_PROXY": p.proxy_url(identity), "NO_PROXY": "",
                "SSL_CERT_FILE": str(p.ca)})
    return subprocess.Popen([str(CLIENT_PY), str(SUPPORT / "client.py"), "https://mcp.test/mcp",
                             json.dumps(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def pending(admin: Admin, identity: str) -> list[dict[str, Any]]:
    status, doc = admin.get("/v1/approvals", token=ALICE)
    assert status == 200, doc
    return [a for a in doc["approvals"] if a["identity"] == identity
            and a.get("state", "pending") == "pending"]


def approve(admin: Admin, ap: dict[str, Any]) -> None:
    status, doc = admin.post(f"/v1/approvals/{ap['id']}", {"decision": "approve"}, token=ALICE)
    assert status == 200 and doc["state"] == "approved", doc


def test_the_session_opens_and_lists_without_approval_the_call_waits(stack: Admin) -> None:
    c = client(stack, "asker", [["list"], ["call", "list_issues", {"repo": "acme/app"}]])
    try:
        # the first (and only) request held is the tool call: initialize, the initialized
        # notification, the GET stream and tools/list passed without anyone deciding
        first = wait_for(lambda: pending(stack, "asker") or None, 45, "a held request")
        assert [a["tool"] for a in first] == ["list_issues"], first
        approve(stack, first[0])
        out, err = c.communicate(timeout=60)
    finally:
        c.kill()
    assert c.returncode == 0, err[-1500:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines[0]["tools"] == ["get_me", "list_issues"]  # filtered, not held
    assert lines[1]["text"] == "issues of acme/app: #1, #2"  # approved, bearer injected
    assert_no_secret([out, err], SECRET_VALUES, "the client's output")
    assert pending(stack, "asker") == []  # the DELETE ending the session was not held either
    # the audit: initialize allowed by the ask rule, not held
    init = stack.proxy.wait_audit(lambda e: e.get("identity") == "asker" and any(
        c.get("method") == "initialize" for c in e.get("rpc") or ()))
    assert init["decision"] == "allow" and init["rule"] == "gh-ask", init


def test_ask_housekeeping_holds_the_session_too(stack: Admin) -> None:
    c = client(stack, "strict", [["list"]])
    try:
        first = wait_for(lambda: pending(stack, "strict") or None, 45, "a held request")
        assert [a["tool"] for a in first] == ["initialize"], first
    finally:
        c.kill()
        c.communicate(timeout=30)
