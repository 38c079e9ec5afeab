"""`explain --batch` takes every input the proxy judges: a differential test of the body.

tests/integration/test_differential.py covers requests by their head. Here the same kind of
differential covers what the proxy judges besides the head, each written as an `explain
--batch` JSON line: the caller's sandbox, a JSON-RPC body (inline, from a file, or as
`mcp_tool`/`mcp_args`, `rpc_method`, `mcp_resource`), a JSON-RPC batch, bodies the call stage
refuses (not JSON-RPC, a batch reusing an id, larger than `max_body`), MCP headers that must
agree with the body, and policy DNS names and types (tests/integration/
policies_differential_calls). A running `sandgate run` (real OpenBao, a real TLS upstream,
`--dns` with `--identity-cidr` for the DNS clients, proxy tokens for the HTTP clients) serves
each request as a client sends it; what it did is observed from outside (its refusal's
X-Sandgate-Reason, or the request the upstream got, its credentials, and the audit's decision;
the DNS answer's rcode). Every input must come out the same.

Addresses: 127.0.48.0/24 (the upstream at .2, the policy DNS at .1, the recording resolver at
.53, the DNS clients at .10 and .11). Run it in its own network namespace.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import dns.rcode
import pytest

from tests.integration.conftest import (
    HERE,
    SANDGATE,
    Proxy,
    start_proxy,
    stop_proxy,
)
from tests.support.dnsrecorder import RecordingResolver
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.integration

POLICIES = HERE / "policies_differential_calls"
UPSTREAM_IP, DNS_IP, RESOLVER_IP = "127.0.48.2", "127.0.48.1", "127.0.48.53"
DNS_CLIENTS = {"agent": "127.0.48.10", "tool": "127.0.48.11"}
NAMES = ["mcp.dc.test", "rpc.dc.test", "api.dc.test"]
RESOLVE = [f"--resolve={n}={UPSTREAM_IP}" for n in NAMES]
MCP_KEY, BOX_KEY = "dc-mcp-REAL-value-48a1", "dc-box-REAL-value-48b2"
SECRETS = {"mcp": MCP_KEY, "box": BOX_KEY}
ZONE = {"api.dc.test": {"A": ["5.6.7.8"], "AAAA": ["2606:4700::6810:1"], "TXT": ['"t"']},
        "txt.dc.test": {"A": ["5.6.7.9"], "TXT": ['"hello"']},
        "mcp.dc.test": {"A": ["5.6.7.10"]}}

MCP, RPC, API = "https://mcp.dc.test/mcp", "https://rpc.dc.test/rpc", "https://api.dc.test"


def rpc(method: str, params: dict[str, Any] | None = None, id: int | None = 1
        ) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        msg["params"] = params
    if id is not None:
        msg["id"] = id
    return msg


def tool(name: str, args: dict[str, Any] | None = None, id: int = 1) -> dict[str, Any]:
    return rpc("tools/call", {"name": name, "arguments": args or {}}, id)


# --- the inputs: one explain --batch JSON line each ------------------------------------------

# (a label, the line without identity/sandbox). `body`: sent as is (str) or as JSON; the
# `mcp_tool`, `rpc_method`, `mcp_resource` forms are sent as the one-message body they stand for.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("tool allowed", {"url": MCP, "body": tool("get_issue", {"repo": "acme/x"})}),
    ("tool, argument outside its glob", {"url": MCP,
                                         "body": tool("list_issues", {"repo": "other/x"})}),
    ("tool, argument missing", {"url": MCP, "body": tool("list_issues")}),
    ("tool not listed", {"url": MCP, "body": tool("create_issue", {"repo": "acme/x"})}),
    ("tool denied", {"url": MCP, "body": tool("delete_repo", {"repo": "acme/x"})}),
    ("mcp_tool form", {"url": MCP, "mcp_tool": "list_issues", "mcp_args": {"repo": "acme/y"}}),
    ("mcp_tool form, denied", {"url": MCP, "mcp_tool": "delete_repo",
                               "mcp_args": {"repo": "acme/y"}}),
    ("resource allowed", {"url": MCP, "mcp_resource": "file:///projects/a"}),
    ("resource outside", {"url": MCP, "body": rpc("resources/read",
                                                  {"uri": "file:///etc/passwd"})}),
    ("housekeeping", {"url": MCP, "body": rpc("ping")}),
    ("notification only", {"url": MCP, "body": rpc("notifications/initialized", id=None)}),
    ("batch allowed", {"url": MCP, "body": [tool("get_issue", {"repo": "acme/x"}, 1),
                                            tool("list_issues", {"repo": "acme/y"}, 2)]}),
    ("batch with a denied call", {"url": MCP, "body": [tool("get_issue", {"repo": "acme/x"}, 1),
                                                       tool("delete_repo", {"repo": "acme/x"},
                                                            2)]}),
    ("batch reusing an id", {"url": MCP, "body": [rpc("ping", id=7), rpc("ping", id=7)]}),
    ("not JSON-RPC", {"url": MCP, "body": "{\"hello\": 1}"}),
    ("not JSON", {"url": MCP, "body": "tools/call delete_repo"}),
    ("larger than max_body", {"url": MCP, "body": tool("get_issue", {"repo": "acme/x",
                                                                      "pad": "x" * 500})}),
    ("body from a file", {"url": MCP, "body_file": "delete.json"}),
    ("Mcp-Method agrees", {"url": MCP, "body": tool("get_issue", {"repo": "acme/x"}),
                           "headers": {"Mcp-Method": "tools/call", "Mcp-Name": "get_issue"}}),
    ("Mcp-Method disagrees", {"url": MCP, "body": tool("get_issue", {"repo": "acme/x"}),
                              "headers": {"Mcp-Method": "tools/list"}}),
    ("Mcp-Name disagrees", {"url": MCP, "body": tool("get_issue", {"repo": "acme/x"}),
                            "headers": {"Mcp-Name": "delete_repo"}}),
    ("rpc method allowed", {"url": RPC, "rpc_method": "eth_blockNumber"}),
    ("rpc method by glob", {"url": RPC, "body": rpc("eth_getBalance", {"a": "0x0"})}),
    ("rpc method denied", {"url": RPC, "body": rpc("eth_sendTransaction", {})}),
    ("rpc method not listed", {"url": RPC, "body": rpc("net_version")}),
    ("rpc batch", {"url": RPC, "body": [rpc("eth_blockNumber", id=1),
                                        rpc("eth_getCode", {}, id=2)]}),
    ("rpc batch, one denied", {"url": RPC, "body": [rpc("eth_blockNumber", id=1),
                                                    rpc("eth_sendTransaction", {}, id=2)]}),
    ("plain body, no call rule", {"url": f"{API}/v1/x", "body": "anything at all"}),
]
DNS_CASES = [("api.dc.test", "A"), ("api.dc.test", "AAAA"), ("api.dc.test", "TXT"),
             ("txt.dc.test", "TXT"), ("mcp.dc.test", "A"), ("nothing.dc.test", "A")]
SANDBOXES: list[str | None] = [None, "sb-1"]
DELETE_BODY = json.dumps(tool("delete_repo", {"repo": "acme/x"})).encode()


@dataclass
class Line:
    n: int
    label: str
    doc: dict[str, Any]  # the explain --batch line
    body: bytes = b""  # what the client sends
    headers: dict[str, str] = field(default_factory=dict)


def lines() -> list[Line]:
    out: list[Line] = []
    for identity in ("agent", "tool"):
        for sandbox in SANDBOXES:
            for label, case in CASES:
                n = len(out)
                doc = {"identity": identity, "sandbox": sandbox, "method": "POST",
                       **case, "url": f"{case['url']}?dcid{n}=1"}
                out.append(Line(n, label, doc, _wire_body(case), dict(case.get("headers", {}))))
    for identity in DNS_CLIENTS:
        for name, qtype in DNS_CASES:
            out.append(Line(len(out), f"dns {name} {qtype}",
                            {"identity": identity, "dns": name, "type": qtype}))
    return out


def _wire_body(case: dict[str, Any]) -> bytes:
    if "body_file" in case:
        return DELETE_BODY
    if "mcp_tool" in case:
        return json.dumps(tool(case["mcp_tool"], case.get("mcp_args"))).encode()
    if "rpc_method" in case:
        return json.dumps(rpc(case["rpc_method"])).encode()
    if "mcp_resource" in case:
        return json.dumps(rpc("resources/read", {"uri": case["mcp_resource"]})).encode()
    body = case.get("body", "")
    return body.encode() if isinstance(body, str) else json.dumps(body).encode()


@dataclass(frozen=True)
class Outcome:
    decision: str  # allow / deny / resolve / refuse
    code: str | None
    secrets: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.decision} {self.code or ''} {','.join(self.secrets)}".strip()


# --- the proxy ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dc_pki(tmp_path_factory: pytest.TempPathFactory):
    return make_pki(tmp_path_factory.mktemp("dc-pki"), NAMES, [UPSTREAM_IP])


@pytest.fixture(scope="module")
def dc_upstream(dc_pki) -> Iterator[UpstreamServer]:
    server = UpstreamServer(UPSTREAM_IP, 443, str(dc_pki.cert), str(dc_pki.key)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def resolver() -> Iterator[RecordingResolver]:
    r = RecordingResolver(RESOLVER_IP, 53, ZONE, default="5.6.7.99")
    yield r
    r.close()


@pytest.fixture(scope="module")
def running(tmp_path_factory, vault, dc_upstream, dc_pki, resolver) -> Iterator[Proxy]:
    vault.put_kv2("dc/mcp", {"token": MCP_KEY})
    vault.put_kv2("dc/sandboxes/sb-1/box", {"token": BOX_KEY})
    cidrs = [f"--identity-cidr={ip}/32={who}" for who, ip in DNS_CLIENTS.items()]
    p = start_proxy(tmp_path_factory.mktemp("dc"), POLICIES,
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, dc_pki,
                    "--dns", f"{DNS_IP}:53", "--dns-upstream", f"{RESOLVER_IP}:53",
                    *cidrs, *RESOLVE)
    yield p
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], tuple(SECRETS.values()), "the proxy's logs or audit")


def _send(proxy: Proxy, auth: str, url: str, body: bytes, headers: dict[str, str]
          ) -> dict[str, str]:
    """POST `body` to `url` through the proxy (CONNECT, then TLS with the proxy's CA): the
    response's headers (lower-case)."""
    host = url.split("://", 1)[1].split("/", 1)[0]
    target = "/" + url.split("://", 1)[1].split("/", 1)[1]
    s = socket.create_connection((proxy.host, proxy.port), timeout=15)
    with s:
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n"
                  f"Proxy-Authorization: {auth}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        status, got = _head(head)
        if status != 200:
            return got
        ctx = ssl.create_default_context(cafile=str(proxy.ca))
        with ctx.wrap_socket(s, server_hostname=host) as t:
            lines = [f"POST {target} HTTP/1.1", f"Host: {host}", "Connection: close",
                     "Content-Type: application/json",
                     "Accept: application/json, text/event-stream",
                     f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
            t.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            data = b""
            while True:
                try:
                    chunk = t.recv(65536)
                except (TimeoutError, ssl.SSLError, ConnectionResetError):
                    break
                if not chunk:
                    break
                data += chunk
            return _head(data)[1]


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    parts = head[0].split(" ")
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return status, {k.strip().lower(): v.strip() for k, _, v in
                    (line.partition(":") for line in head[1:])}


def observed(proxy: Proxy, upstream: UpstreamServer, todo: list[Line]) -> dict[int, Outcome]:
    tokens: dict[tuple[str, str | None], str] = {}
    reasons: dict[int, str | None] = {}
    out: dict[int, Outcome] = {}
    for ln in todo:
        d = ln.doc
        if "dns" in d:
            q = dns.message.make_query(d["dns"], d["type"])
            answer = dns.query.udp(q, DNS_IP, timeout=5, source=DNS_CLIENTS[d["identity"]])
            ok = answer.rcode() == dns.rcode.NOERROR
            out[ln.n] = Outcome("resolve" if ok else "refuse", None)
            continue
        key = (d["identity"], d["sandbox"])
        if key not in tokens:
            tokens[key] = proxy.token(d["identity"], sandbox=d["sandbox"])
        auth = "Basic " + base64.b64encode(f"{key[0]}:{tokens[key]}".encode()).decode()
        reasons[ln.n] = _send(proxy, auth, d["url"], ln.body, ln.headers).get(
            "x-sandgate-reason")
    time.sleep(0.5)  # the last audit events
    audit = {int(name[4:]): ev for ev in proxy.audit() if ev.get("event") == "request"
             for name in [p.partition("=")[0] for p in
                          (ev.get("path") or "").partition("?")[2].split("&")]
             if name.startswith("dcid") and name[4:].isdigit()}
    seen = {int(name[4:]): s for s in upstream.seen
            for name in [p.partition("=")[0] for p in s.query.split("&")]
            if name.startswith("dcid") and name[4:].isdigit()}
    for n, reason in reasons.items():
        if reason is not None:
            out[n] = Outcome("deny", reason)
        elif n in seen and n in audit:
            blob = " ".join(seen[n].headers.values())
            out[n] = Outcome(audit[n]["decision"], None,
                             tuple(sorted(k for k, v in SECRETS.items() if v in blob)))
        else:
            out[n] = Outcome("unobserved", None)
    return out


# --- explain --batch ------------------------------------------------------------------------


def explained(todo: list[Line], tmp: Path) -> dict[int, Outcome]:
    (tmp / "delete.json").write_bytes(DELETE_BODY)  # body_file is relative to the batch file
    batch = tmp / "batch.jsonl"
    batch.write_text("".join(json.dumps(ln.doc) + "\n" for ln in todo))
    res = subprocess.run([*SANDGATE, "explain", "--policies", str(POLICIES), "--batch",
                          str(batch), *RESOLVE], capture_output=True, text=True, timeout=120)
    docs = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(docs) == len(todo), res.stderr
    out: dict[int, Outcome] = {}
    for ln, doc in zip(todo, docs, strict=True):
        assert "error" not in doc, doc
        decision = doc["decision"]
        secrets = tuple(sorted(doc.get("placeholders_honoured") or ())) \
            if decision == "allow" else ()
        out[ln.n] = Outcome(decision, doc["code"] if decision == "deny" else None, secrets)
    return out


def test_explain_batch_agrees_with_the_proxy_on_every_input(running, dc_upstream, tmp_path):
    todo = lines()
    proxy = observed(running, dc_upstream, todo)
    model = explained(todo, tmp_path)
    wrong = [f"#{ln.n} {ln.label}: {json.dumps(ln.doc)}: explain says {model[ln.n]}, the "
             f"proxy did {proxy[ln.n]}" for ln in todo if model[ln.n] != proxy[ln.n]]
    assert not wrong, f"{len(wrong)} of {len(todo)}:\n" + "\n".join(wrong)
    # every kind of answer occurs (a differential that only ever agrees on `deny` shows little)
    codes = {o.code for o in proxy.values() if o.decision == "deny"}
    assert {o.decision for o in proxy.values()} == {"allow", "deny", "resolve", "refuse"}
    assert {"no_rule", "denied_by_rule", "bad_request", "too_large", "header_mismatch",
            "sandbox_required"} <= codes, codes
    assert {s for o in proxy.values() for s in o.secrets} == set(SECRETS)


def test_the_policy_checks_and_lints_clean():
    for args in (["check", *RESOLVE], ["lint", "--strict"]):
        res = subprocess.run([*SANDGATE, *args, str(POLICIES)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
