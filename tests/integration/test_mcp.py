"""MCP through Sandgate with the official SDKs: per-tool privilege on the JSON-RPC call.

A GitHub-like MCP server (the Python SDK's MCPServer, streamable HTTP, six tools) behind real
TLS; the policy (policies_mcp/) lets `agent` call list_issues, get_issue and get_me and
`bash-tool` list_issues and get_me; delete_repo is denied to both. The clients are the Python
SDK (the `clients` extra) and the TypeScript SDK (tests/mcp-ts, Node)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admin_support import ADMIN_TOKEN, Admin, wait_for
from tests.integration.conftest import (
    GITHUB_TOKEN,
    SECRET_VALUES,
    Proxy,
    curl,
    free_port,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.pki import make_pki
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
HERE = Path(__file__).parent
SUPPORT = ROOT / "tests" / "support" / "mcp"
TS_DIR = ROOT / "tests" / "mcp-ts"
# Fixed loopback addresses of this suite (run it in its own network namespace).
JSON_IP, SSE_IP = "127.0.45.1", "127.0.45.2"
JSON_URL, SSE_URL = "https://mcp.test/mcp", "https://mcp-sse.test/mcp"
ALL_TOOLS = ["create_issue", "delete_repo", "get_issue", "get_me", "list_issues",
             "search_code"]


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"MCP server exited:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"MCP server did not listen:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def mcp_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The MCP servers (JSON and SSE answers) behind real TLS; their PKI."""
    need_sdk("mcp")
    tmp = tmp_path_factory.mktemp("mcp-servers")
    pki = make_pki(tmp / "pki", ["mcp.test", "mcp-sse.test"])
    servers = []
    for ip, mode in ((JSON_IP, "json"), (SSE_IP, "sse")):
        log = tmp / f"server-{mode}.log"
        env = {**os.environ, "MCP_EXPECTED_TOKEN": GITHUB_TOKEN}
        proc = subprocess.Popen([str(CLIENT_PY), str(SUPPORT / "server.py"), ip, "443",
                                 str(pki.cert), str(pki.key), mode],
                                stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
        servers.append(proc)
        _wait_port(ip, 443, proc, log)
    yield pki
    for proc in servers:
        proc.terminate()
        proc.wait(10)


def _start(tmp: Path, vault: Any, pki: Any, *extra: str) -> Admin:
    admin_port = free_port()
    p = start_proxy(tmp, HERE / "policies_mcp", {"VAULT_ADDR": vault.addr,
                                                  "VAULT_TOKEN": vault.root_token,
                                                  "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, pki,
                    f"--resolve=mcp.test={JSON_IP}", f"--resolve=mcp-sse.test={SSE_IP}",
                    "--admin", f"127.0.0.1:{admin_port}", *extra)
    return Admin(p, f"http://127.0.0.1:{admin_port}", HERE / "policies_mcp")


def _stop(a: Admin) -> None:
    p = a.proxy
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")
    # no session id handed out (wrapped) in the logs or the audit
    assert not re.search(r"sgs1\.[A-Za-z0-9_-]+\.", logs)
    assert not [sid for sid in UPSTREAM_SIDS if sid in logs]


@pytest.fixture(scope="module")
def mcp_stack(tmp_path_factory: pytest.TempPathFactory, vault: Any, mcp_servers: Any
              ) -> Iterator[Admin]:
    """`sandgate run` (one process) with its admin listener (Admin.proxy: the proxy)."""
    a = _start(tmp_path_factory.mktemp("mcp"), vault, mcp_servers)
    yield a
    _stop(a)


@pytest.fixture(scope="module")
def mcp_workers(tmp_path_factory: pytest.TempPathFactory, vault: Any, mcp_servers: Any
                ) -> Iterator[Admin]:
    """`sandgate run --workers 2`: two processes on one port, the kernel picks per connection."""
    a = _start(tmp_path_factory.mktemp("mcp-workers"), vault, mcp_servers, "--workers", "2")
    wait_for(lambda: a.get("/readyz")[0] == 200, 120, "both workers ready")
    yield a
    _stop(a)


@pytest.fixture(scope="module")
def mcp_proxy(mcp_stack: Admin) -> Proxy:
    return mcp_stack.proxy


def _env(proxy: Proxy, identity: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and "TOKEN" not in k
           and not k.startswith("VAULT")}
    env.update({"HTTPS_PROXY": proxy.proxy_url(identity), "NO_PROXY": "",
                "SSL_CERT_FILE": str(proxy.ca), "NODE_EXTRA_CA_CERTS": str(proxy.ca)})
    return env


def _sdk(cmd: list[str], proxy: Proxy, identity: str, url: str, steps: list[list[Any]]
         ) -> list[dict[str, Any]]:
    """Run an SDK client script (client.py / client.mjs): one JSON line per step."""
    r = subprocess.run([*cmd, url, json.dumps(steps)], capture_output=True, text=True,
                       env=_env(proxy, identity), timeout=90)
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, f"the output of {cmd[-1]}")
    assert r.returncode == 0, r.stderr[-1500:] + json.dumps(proxy.audit()[-4:], indent=1)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def py_client(proxy: Proxy, identity: str, url: str, steps: list[list[Any]]
              ) -> list[dict[str, Any]]:
    return _sdk([str(CLIENT_PY), str(SUPPORT / "client.py")], proxy, identity, url, steps)


def ts_client(proxy: Proxy, identity: str, url: str, steps: list[list[Any]]
              ) -> list[dict[str, Any]]:
    assert (TS_DIR / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir(), (
        "run scripts/setup.sh --test: the TypeScript MCP SDK (tests/mcp-ts) is missing")
    return _sdk(["node", str(TS_DIR / "client.mjs")], proxy, identity, url, steps)


@pytest.mark.parametrize("url", [JSON_URL, SSE_URL], ids=["json", "sse"])
def test_python_sdk_tools_per_identity(mcp_proxy: Proxy, url: str) -> None:
    steps: list[list[Any]] = [["list"], ["call", "list_issues", {"repo": "acme/app"}],
                              ["call", "get_issue", {"repo": "acme/app", "number": 1}],
                              ["call", "delete_repo", {"repo": "acme/app"}],
                              ["call", "get_me", {}]]
    agent = py_client(mcp_proxy, "agent", url, steps)
    assert agent[0] == {"tools": ["get_issue", "get_me", "list_issues"], "pages": 1}
    assert agent[1]["text"] == "issues of acme/app: #1, #2"  # the injected bearer was right
    assert agent[2]["text"] == "acme/app#1: it is broken"
    assert agent[3]["code"] == -32003
    assert agent[3]["error"].startswith("tool delete_repo is not permitted for agent")
    assert agent[3]["data"]["sandgate"]["code"] == "denied_by_rule"
    # get_me reflects the injected bearer: scrubbed (assert_no_secret checks the output too)
    assert agent[4]["text"].startswith("you are octo, authorised with Bearer ")
    assert GITHUB_TOKEN not in agent[4]["text"]
    bash = py_client(mcp_proxy, "bash-tool", url, steps)
    assert bash[0] == {"tools": ["get_me", "list_issues"], "pages": 1}
    assert bash[1]["text"] == "issues of acme/app: #1, #2"
    assert bash[2]["error"].startswith("tool get_issue is not permitted for bash-tool")
    assert bash[2]["data"]["sandgate"]["code"] == "no_rule"
    assert bash[3]["data"]["sandgate"]["code"] == "denied_by_rule"
    ev = mcp_proxy.wait_audit(lambda e: any(c.get("tool") == "get_issue"
                                            and c.get("decision") == "deny"
                                            for c in e.get("rpc") or ()))
    assert ev["identity"] == "bash-tool" and ev["decision"] == "deny"
    call = ev["rpc"][0]
    assert call["method"] == "tools/call" and call["args_bytes"] > 0
    assert "acme/app" not in json.dumps(ev)  # arguments are never logged


@pytest.mark.parametrize("url", [JSON_URL, SSE_URL], ids=["json", "sse"])
def test_typescript_sdk_tools_per_identity(mcp_proxy: Proxy, url: str) -> None:
    steps: list[list[Any]] = [["list"], ["call", "list_issues", {"repo": "acme/app"}],
                              ["call", "create_issue", {"repo": "acme/app", "title": "x"}],
                              ["call", "get_me", {}]]
    bash = ts_client(mcp_proxy, "bash-tool", url, steps)
    assert bash[0] == {"tools": ["get_me", "list_issues"]}
    assert bash[1]["text"] == "issues of acme/app: #1, #2"
    assert bash[2]["code"] == -32003
    assert "tool create_issue is not permitted for bash-tool" in bash[2]["error"]
    assert bash[2]["data"]["sandgate"]["code"] == "no_rule"
    assert bash[3]["text"].startswith("you are octo, authorised with Bearer ")
    agent = ts_client(mcp_proxy, "agent", url, [["list"]])
    assert agent[0] == {"tools": ["get_issue", "get_me", "list_issues"]}


def _post(proxy: Proxy, identity: str, body: Any, *headers: str,
          url: str = JSON_URL, token: str | None = None) -> tuple[str, int, str]:
    """A raw POST through the proxy (curl): (body, status, response head)."""
    data = body if isinstance(body, str) else json.dumps(body)
    args = ["-X", "POST", "--data-binary", data, "-H", "content-type: application/json",
            "-D", "-"]
    for h in headers or ("accept: application/json, text/event-stream",):
        args += ["-H", h]
    r = curl(proxy, identity, url, *args, token=token)
    out, status = split_status(r.stdout)
    head, _, payload = out.partition("\n\n")  # (text mode: CRLF read as LF)
    if "connection established" in head.lower():  # the CONNECT's answer comes first
        head, _, payload = payload.partition("\n\n")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "curl's output")
    return payload, status, head.lower()


def _tool(i: int, name: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": i, "method": "tools/call",
            "params": {"name": name, "arguments": {"repo": "acme/app"}}}


def test_batch_with_one_denied_call_is_refused_whole(mcp_proxy: Proxy) -> None:
    payload, status, head = _post(mcp_proxy, "agent",
                                  [_tool(1, "list_issues"), _tool(2, "delete_repo")])
    assert status == 200 and "x-sandgate-reason: denied_by_rule" in head, (head, payload)
    answers = json.loads(payload)
    assert [a["id"] for a in answers] == [1, 2]
    assert all(a["error"]["code"] == -32003 for a in answers)
    assert "tool delete_repo is not permitted for agent" in answers[0]["error"]["message"]
    ev = mcp_proxy.wait_audit(lambda e: [c.get("id") for c in e.get("rpc") or ()] == [1, 2])
    assert [c["decision"] for c in ev["rpc"]] == ["batch", "deny"]
    assert ev["upstream_status"] is None and ev["secrets"] == []  # never forwarded


def test_refusal_as_an_sse_event_when_the_client_accepts_only_sse(mcp_proxy: Proxy) -> None:
    payload, status, head = _post(mcp_proxy, "bash-tool", _tool(7, "create_issue"),
                                  "accept: text/event-stream")
    assert status == 200 and "content-type: text/event-stream" in head
    assert payload.startswith("event: message\ndata: ")
    doc = json.loads(payload.split("data: ", 1)[1])
    assert doc["id"] == 7 and doc["error"]["data"]["sandgate"]["code"] == "no_rule"


@pytest.mark.parametrize(("body", "code"), [
    ('{"jsonrpc":"2.0","id":1,"method":"ping","method":"tools/call"}', "bad_request"),
    ('{"jsonrpc":"1.0","id":1,"method":"ping"}', "bad_request"),
    ('{"jsonrpc":"2.0","id":1,"method":"ping"', "bad_request"),
    ('{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get_me",'
     '"arguments":{"pad":"' + "x" * 70000 + '"}}}', "too_large"),
], ids=["duplicate-key", "not-2.0", "invalid-json", "over-64k"])
def test_what_is_not_a_well_formed_call_is_refused_over_http(mcp_proxy: Proxy, body: str,
                                                              code: str) -> None:
    before = len(mcp_proxy.audit())
    _, status, head = _post(mcp_proxy, "agent", body)
    if code == "too_large":  # refused at the head (declared length); a large body is not read
        ev = mcp_proxy.wait_audit(lambda e: e.get("code") == "too_large")
        assert status in (0, 413) and mcp_proxy.audit().index(ev) >= before
        assert "rule allowing it accepts" in ev["reason"]
    else:
        assert status == 400 and f"x-sandgate-reason: {code}" in head


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "curl", "version": "1"}}}
LISTING = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
ACCEPT = "accept: application/json, text/event-stream"
UPSTREAM_SIDS: list[str] = []  # the upstream's own ids (never logged: checked by _stop)


def _open_session(proxy: Proxy, identity: str, url: str = JSON_URL,
                  token: str | None = None) -> str:
    """initialize through the proxy: the session id the client is given."""
    r = curl(proxy, identity, url, "-X", "POST", "--data-binary", json.dumps(INIT),
             "-H", "content-type: application/json", "-H", ACCEPT, "-D", "-", token=token)
    out, status = split_status(r.stdout)
    assert status == 200, out
    sid = next(line.split(":", 1)[1].strip() for line in out.splitlines()
               if line.lower().startswith("mcp-session-id:"))
    if sid.startswith("sgs1."):
        body = sid.split(".")[1]
        UPSTREAM_SIDS.append(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode())
    return sid


def _delete(proxy: Proxy, identity: str, sid: str) -> tuple[int, str]:
    r = curl(proxy, identity, JSON_URL, "-X", "DELETE", "-D", "-",
             "-H", f"mcp-session-id: {sid}")
    out, status = split_status(r.stdout)
    return status, out.lower()


def test_session_id_replayed_by_another_identity_is_refused(mcp_proxy: Proxy) -> None:
    sid = _open_session(mcp_proxy, "agent")
    # the client holds a wrapped id (visible ASCII), bound to agent and mcp.test:443
    assert sid.startswith("sgs1.") and all(0x21 <= ord(c) <= 0x7E for c in sid)
    payload, status, head = _post(mcp_proxy, "bash-tool", LISTING, ACCEPT,
                                  f"mcp-session-id: {sid}")
    assert status == 403 and "x-sandgate-reason: session_mismatch" in head, payload
    assert "not issued through Sandgate to bash-tool" in payload
    ev = mcp_proxy.wait_audit(lambda e: e.get("code") == "session_mismatch")
    assert ev["identity"] == "bash-tool" and ev["upstream_status"] is None  # never forwarded
    payload, status, _ = _post(mcp_proxy, "agent", LISTING, ACCEPT, f"mcp-session-id: {sid}")
    assert status == 200 and "list_issues" in payload  # the upstream knew its own id
    # the same id for another server (mcp-sse.test): bound to mcp.test, refused
    _, status, head = _post(mcp_proxy, "agent", LISTING, ACCEPT, f"mcp-session-id: {sid}",
                            url=SSE_URL)
    assert status == 403 and "x-sandgate-reason: session_mismatch" in head
    # the DELETE that ends the session is unwrapped the same way: refused for bash-tool,
    # and ends agent's session (the upstream answers a second DELETE: session not found)
    status, out = _delete(mcp_proxy, "bash-tool", sid)
    assert status == 403 and "x-sandgate-reason: session_mismatch" in out
    status, out = _delete(mcp_proxy, "agent", sid)
    assert status == 200, out
    status, out = _delete(mcp_proxy, "agent", sid)
    assert status == 404 and "x-sandgate-reason" not in out, out


def test_a_session_id_not_issued_through_sandgate_is_refused(mcp_proxy: Proxy) -> None:
    """An id the agent got some other way (the upstream's own, a guess, a forgery) is never
    forwarded: there is no "unknown, so let it through" any more."""
    sid = _open_session(mcp_proxy, "agent")
    _, body, mac = sid.split(".")
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
    forged = f"sgs1.{body}.{'A' * len(mac)}"
    for value in (raw, forged, "not-a-session"):
        payload, status, head = _post(mcp_proxy, "agent", LISTING, ACCEPT,
                                      f"mcp-session-id: {value}")
        assert status == 403 and "x-sandgate-reason: session_mismatch" in head, payload
        assert raw not in payload
        doc = json.loads(payload)
        assert "initialize without Mcp-Session-Id" in doc["hint"]


def test_session_binding_holds_across_workers(mcp_workers: Admin) -> None:
    """With --workers 2 each connection lands on either worker (nothing shared but the key):
    bash-tool replaying agent's id is refused on both (before agent has used the session on
    the other worker: no process may have to have seen it opened), and agent's own requests
    work on both."""
    proxy = mcp_workers.proxy
    tokens = {i: proxy.token(i) for i in ("agent", "bash-tool")}
    sid = _open_session(proxy, "agent", token=tokens["agent"])
    for attempt in range(40):  # each curl a new connection; every one of them is checked
        payload, status, head = _post(proxy, "bash-tool", LISTING, ACCEPT,
                                      f"mcp-session-id: {sid}", token=tokens["bash-tool"])
        assert status == 403 and "x-sandgate-reason: session_mismatch" in head, (attempt,
                                                                                 payload)
        if attempt >= 4 and _workers_seen(proxy)[0] == {0, 1}:
            break
    for attempt in range(40):
        payload, status, _ = _post(proxy, "agent", {**LISTING, "id": 100 + attempt}, ACCEPT,
                                   f"mcp-session-id: {sid}", token=tokens["agent"])
        assert status == 200 and "list_issues" in payload, (attempt, payload)
        if attempt >= 4 and _workers_seen(proxy)[1] == {0, 1}:
            break
    # both outcomes seen on both workers (all 40 connections on one worker: 2^-39)
    wait_for(lambda: _workers_seen(proxy) == ({0, 1}, {0, 1}), 10, "both workers")


def test_session_binding_holds_across_replicas_and_restarts(
        tmp_path: Path, vault: Any, mcp_servers: Any, mcp_proxy: Proxy) -> None:
    """A second `sandgate run` with the same confdir key (a replica, or the same proxy after a
    restart) has never seen the session opened: it still serves agent's id and refuses
    bash-tool's replay of it."""
    sid = _open_session(mcp_proxy, "agent")
    shutil.copytree(mcp_proxy.confdir, tmp_path / "conf")  # the key replicas share
    replica = _start(tmp_path, vault, mcp_servers)
    try:
        payload, status, head = _post(replica.proxy, "bash-tool", LISTING, ACCEPT,
                                      f"mcp-session-id: {sid}")
        assert status == 403 and "x-sandgate-reason: session_mismatch" in head, payload
        payload, status, _ = _post(replica.proxy, "agent", LISTING, ACCEPT,
                                   f"mcp-session-id: {sid}")
        assert status == 200 and "list_issues" in payload, payload
    finally:
        _stop(replica)


def _workers_seen(proxy: Proxy) -> tuple[set[int], set[int]]:
    """The workers that refused bash-tool's replay, and those that served agent's session."""
    events = [e for e in proxy.audit() if e.get("event") == "request"]
    refused = {e["worker"] for e in events if e.get("identity") == "bash-tool"
               and e.get("code") == "session_mismatch"}
    served = {e["worker"] for e in events if e.get("identity") == "agent"
              and e.get("upstream_status") == 200
              and any(c.get("method") == "tools/list" for c in e.get("rpc") or ())}
    return refused, served


def test_calls_are_counted_and_explained_by_the_admin_api(mcp_stack: Admin) -> None:
    admin, mcp_proxy = mcp_stack, mcp_stack.proxy
    labels = (("decision", "deny"), ("identity", "bash-tool"), ("method", "tools/call"),
              ("tool", "delete_repo"))
    key = ("sandgate_rpc_calls_total", labels)
    before = wait_for(lambda: admin.metrics() or None, 10, "metrics").get(key, 0)
    _, status, _ = _post(mcp_proxy, "bash-tool", _tool(5, "delete_repo"))
    assert status == 200
    wait_for(lambda: admin.metrics().get(key, 0) == before + 1, 10, "the call counted")
    status, doc = admin.post("/v1/explain", {"identity": "bash-tool", "method": "POST",
                                             "url": JSON_URL, "mcp_tool": "delete_repo"})
    assert status == 200 and doc["code"] == "denied_by_rule" and doc["call"] == "tool delete_repo"
