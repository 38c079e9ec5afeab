"""Both MCP revisions through Sandgate (issue 34): the 2026-07-28 stateless revision's metadata
headers (Mcp-Method, Mcp-Name, MCP-Protocol-Version) must agree with the body, and list answers
are filtered on every page and cached by their caller only.

The server is the Python SDK's MCPServer (tests/support/mcp/server.py), which speaks both eras,
here answering tools/list in pages of two tools marked `cacheScope: public`, behind real TLS,
JSON and SSE answers. The clients: the Python SDK in a 2025 session
(initialize) and in the stateless revision (server/discover, then per-request metadata: the
SDK sends the headers itself), and curl for requests written exactly as the spec shows, to
make the headers disagree with the body. Policy: policies_mcp_stateless/."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admin_support import ADMIN_TOKEN
from tests.integration.conftest import (
    GITHUB_TOKEN,
    SECRET_VALUES,
    Proxy,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.integration.test_mcp import CLIENT_PY, SUPPORT, _post, _wait_port, py_client
from tests.support.pki import make_pki
from tests.support.sdk import need_sdk
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
# Fixed loopback addresses (test_mcp.py has .1 and .2; run in its own network namespace)
JSON_IP, SSE_IP = "127.0.45.3", "127.0.45.4"
JSON_URL, SSE_URL = "https://mcp-paged.test/mcp", "https://mcp-paged-sse.test/mcp"
MODERN = "2026-07-28"
ACCEPT = "accept: application/json, text/event-stream"
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": {"name": "curl", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {}}


@pytest.fixture(scope="module")
def paged_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The SDK server twice (JSON and SSE answers), tools/list two tools a page."""
    need_sdk("mcp")
    tmp = tmp_path_factory.mktemp("mcp-paged")
    pki = make_pki(tmp / "pki", ["mcp-paged.test", "mcp-paged-sse.test"])
    procs = []
    for ip, mode in ((JSON_IP, "json"), (SSE_IP, "sse")):
        log = tmp / f"server-{mode}.log"
        env = {**os.environ, "MCP_EXPECTED_TOKEN": GITHUB_TOKEN}
        proc = subprocess.Popen([str(CLIENT_PY), str(SUPPORT / "server.py"), ip, "443",
                                 str(pki.cert), str(pki.key), mode, "2"],
                                stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        _wait_port(ip, 443, proc, log)
    yield pki
    for proc in procs:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, vault: Any, paged_servers: Any
          ) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("mcp-stateless"), HERE / "policies_mcp_stateless",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                     "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, paged_servers,
                    f"--resolve=mcp-paged.test={JSON_IP}",
                    f"--resolve=mcp-paged-sse.test={SSE_IP}")
    yield p
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


def modern(method: str, i: int, **params: Any) -> tuple[dict[str, Any], list[str]]:
    """A request of the stateless revision as the spec writes it: the version in
    params._meta, mirrored in MCP-Protocol-Version; Mcp-Method; Mcp-Name for named methods."""
    body = {"jsonrpc": "2.0", "id": i, "method": method, "params": {**params, "_meta": META}}
    headers = [ACCEPT, f"mcp-protocol-version: {MODERN}", f"mcp-method: {method}"]
    if "name" in params:
        headers.append(f"mcp-name: {params['name']}")
    return body, headers


def answer(payload: str) -> dict[str, Any]:
    """The JSON-RPC answer in a JSON body or the last SSE event carrying data."""
    if payload.lstrip().startswith("{"):
        return dict(json.loads(payload))
    data = [ln[5:].strip() for ln in payload.splitlines() if ln.startswith("data:")]
    return dict(json.loads(data[-1]))


@pytest.mark.parametrize("url", [JSON_URL, SSE_URL], ids=["json", "sse"])
@pytest.mark.parametrize("era", ["2025-session", "2026-07-28"])
def test_python_sdk_in_both_revisions_lists_and_calls_per_identity(proxy: Proxy, url: str,
                                                                   era: str) -> None:
    """The SDK follows nextCursor over three pages; every page is filtered (the third keeps
    nothing for either identity), calls are judged as ever. In the stateless revision the SDK
    sends Mcp-Method / Mcp-Name / MCP-Protocol-Version with every request: they agree, so
    nothing is refused for them."""
    first = [["discover"]] if era == MODERN else []
    steps: list[list[Any]] = [*first, ["list"], ["call", "list_issues", {"repo": "acme/app"}],
                              ["call", "get_issue", {"repo": "acme/app", "number": 1}],
                              ["call", "delete_repo", {"repo": "acme/app"}]]
    agent = py_client(proxy, "agent", url, steps)
    if era == MODERN:
        assert MODERN in agent.pop(0)["version"]
    assert agent[0] == {"tools": ["get_issue", "get_me", "list_issues"], "pages": 3}
    assert agent[1]["text"] == "issues of acme/app: #1, #2"  # the injected bearer was right
    assert agent[2]["text"] == "acme/app#1: it is broken"
    assert agent[3]["code"] == -32003 and agent[3]["data"]["sandgate"]["code"] == \
        "denied_by_rule"
    bash = py_client(proxy, "bash-tool", url, steps)
    if era == MODERN:
        bash.pop(0)
    assert bash[0] == {"tools": ["get_me", "list_issues"], "pages": 3}
    assert bash[2]["data"]["sandgate"]["code"] == "no_rule"
    host = url.split("/")[2]
    events = [e for e in proxy.audit() if e.get("event") == "request" and e.get("host") == host]
    assert not [e for e in events if e.get("code") == "header_mismatch"]
    pages = [e for e in events if e.get("upstream_status") == 200
             and any(c.get("method") == "tools/list" for c in e.get("rpc") or ())]
    assert len(pages) >= 6  # three pages for each identity, each answer read by the filter


@pytest.mark.parametrize("url", [JSON_URL, SSE_URL], ids=["json", "sse"])
def test_a_header_naming_another_tool_than_the_body_is_refused(proxy: Proxy, url: str
                                                               ) -> None:
    """The found item: the body calls get_issue, Mcp-Name says get_me. agent may call both,
    so only the disagreement refuses it: 400, MCP's HeaderMismatch, nothing forwarded. The
    same request with agreeing headers reaches the server (the request is the spec's)."""
    body, headers = modern("tools/call", 11, name="get_issue",
                           arguments={"repo": "acme/app", "number": 1})
    payload, status, head = _post(proxy, "agent", body, *headers, url=url)
    assert status == 200, payload
    assert answer(payload)["result"]["content"][0]["text"] == "acme/app#1: it is broken"

    lying = [h for h in headers if not h.startswith("mcp-name:")] + ["mcp-name: get_me"]
    payload, status, head = _post(proxy, "agent", body, *lying, url=url)
    assert status == 400 and "x-sandgate-reason: header_mismatch" in head, (head, payload)
    doc = json.loads(payload)
    assert doc["id"] == 11 and doc["error"]["code"] == -32020
    assert "Mcp-Name 'get_me' does not match the params.name of the body's tools/call, " \
        "'get_issue'" in doc["error"]["message"]
    assert doc["error"]["data"]["sandgate"]["code"] == "header_mismatch"
    ev = proxy.wait_audit(lambda e: e.get("code") == "header_mismatch"
                          and any(c.get("id") == 11 for c in e.get("rpc") or ()))
    assert ev["identity"] == "agent" and ev["decision"] == "deny"
    assert ev["upstream_status"] is None and ev["secrets"] == []  # never forwarded
    assert ev["rpc"][0]["tool"] == "get_issue"


@pytest.mark.parametrize(("change", "says"), [
    (lambda h: [x for x in h if not x.startswith("mcp-method:")] + ["mcp-method: tools/list"],
     "Mcp-Method 'tools/list' does not match the body's method 'tools/call'"),
    (lambda h: [*h, "mcp-name: list_issues"], "the Mcp-Name header is given 2 times"),
    (lambda h: [x for x in h if not x.startswith("mcp-protocol-version:")]
     + ["mcp-protocol-version: 2025-06-18"], "does not match the body's"),
    (lambda h: [x for x in h if not x.startswith("mcp-name:")],
     "requires the Mcp-Name header on tools/call"),
    (lambda h: [x for x in h if not x.startswith("mcp-protocol-version:")]
     + ["mcp-protocol-version: 2099-01-01"], "not a protocol revision Sandgate knows"),
], ids=["method", "name-twice", "version-vs-meta", "name-missing", "unknown-version"])
def test_stateless_headers_that_disagree_are_refused(proxy: Proxy, change: Any,
                                                     says: str) -> None:
    body, headers = modern("tools/call", 12, name="list_issues",
                           arguments={"repo": "acme/app"})
    payload, status, head = _post(proxy, "bash-tool", body, *change(headers), url=JSON_URL)
    assert status == 400 and "x-sandgate-reason: header_mismatch" in head, payload
    assert says in json.loads(payload)["error"]["message"]


@pytest.mark.parametrize("url", [JSON_URL, SSE_URL], ids=["json", "sse"])
def test_each_stateless_page_is_filtered_and_cacheable_by_its_caller_only(proxy: Proxy,
                                                                          url: str) -> None:
    """The server marks its tools/list public for an hour... for a minute: every caller would
    share one cached list. Filtered for bash-tool, it is bash-tool's: cacheScope private (ttlMs
    kept); the cursor's page is filtered like the first."""
    cursor, pages = None, []
    for i in range(1, 5):
        body, headers = modern("tools/list", 20 + i, **({"cursor": cursor} if cursor else {}))
        payload, status, _ = _post(proxy, "bash-tool", body, *headers, url=url)
        assert status == 200, payload
        result = answer(payload)["result"]
        assert result["cacheScope"] == "private" and result["ttlMs"] == 60000, result
        pages.append([t["name"] for t in result["tools"]])
        cursor = result.get("nextCursor")
        if not cursor:
            break
    assert pages == [["list_issues"], ["get_me"], []]


def _session(proxy: Proxy, identity: str, version: str) -> tuple[str, str]:
    """A 2025 session opened through Sandgate: (the id handed out, the version answered)."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": version, "capabilities": {},
                       "clientInfo": {"name": "curl", "version": "1"}}}
    r = curl(proxy, identity, JSON_URL, "-X", "POST", "--data-binary", json.dumps(init),
             "-H", "content-type: application/json", "-H", ACCEPT, "-D", "-")
    out, status = split_status(r.stdout)
    assert status == 200, out
    head, _, payload = out.partition("\n\n")
    if "connection established" in head.lower():  # the CONNECT's answer comes first
        head, _, payload = payload.partition("\n\n")
    sid = next(line.split(":", 1)[1].strip() for line in head.splitlines()
               if line.lower().startswith("mcp-session-id:"))
    assert "transfer-encoding" not in head.lower()
    return sid, answer(payload)["result"]["protocolVersion"]


def test_a_2025_session_is_held_to_its_negotiated_version(proxy: Proxy) -> None:
    """The session's version is read from the server's initialize answer and bound into the
    id Sandgate hands out: a request of that session naming another revision (or the
    stateless one) is refused; the negotiated one, or none, goes through."""
    sid, version = _session(proxy, "agent", "2025-06-18")
    assert version == "2025-06-18"
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    for other in ("2025-11-25", MODERN):
        payload, status, head = _post(proxy, "agent", listing, ACCEPT,
                                      f"mcp-session-id: {sid}",
                                      f"mcp-protocol-version: {other}", url=JSON_URL)
        assert status == 400 and "x-sandgate-reason: header_mismatch" in head, payload
        assert "not the version negotiated for this session (2025-06-18)" in payload
    for extra in ([f"mcp-protocol-version: {version}"], [], ["mcp-method: tools/list"]):
        payload, status, _ = _post(proxy, "agent", listing, ACCEPT, f"mcp-session-id: {sid}",
                                   *extra, url=JSON_URL)
        assert status == 200 and "list_issues" in payload, payload
    # a header naming a tool on a method that names nothing
    payload, status, head = _post(proxy, "agent", listing, ACCEPT, f"mcp-session-id: {sid}",
                                  "mcp-name: delete_repo", url=JSON_URL)
    assert status == 400 and "names nothing" in payload
