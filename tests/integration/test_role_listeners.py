"""Sandgate's side of pattern 1's split, without Docker: the real process with role listeners,
a sandbox known by address (--identity-cidr), real curl from that address, OpenBao and the TLS
upstream. One process and `--workers 2` (the role listeners shared with SO_REUSEPORT).

The sandbox's own rules, which decide which listener a connection reaches, are Docker's part:
tests/integration/docker/test_pattern1.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SECRET_VALUES,
    Proxy,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.support.secrets import assert_no_secret, assert_secret_equal

SANDBOX_IP = "127.0.46.1"  # the split sandbox's address (identity coding-agent, sandbox sbx-46)
STRANGER_IP = "127.0.46.2"  # no sandbox


@pytest.fixture(scope="module", params=["one", "workers"])
def split_proxy(request, tmp_path_factory, vault, upstream, pki) -> Iterator[tuple[Proxy, int,
                                                                                 int]]:
    tool, other = free_port(), free_port()
    workers = ["--workers", "2"] if request.param == "workers" else []
    p = start_proxy(tmp_path_factory.mktemp("roles"), HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    f"--identity-cidr={SANDBOX_IP}/32=coding-agent/sbx-46",
                    f"--role-listen=tool=127.0.0.1:{tool}",
                    f"--role-listen=other=127.0.0.1:{other}",
                    "--tool-identity=coding-agent=bash-tool", *workers)
    yield p, tool, other
    stop_proxy(p)
    assert_no_secret([p.logs() + p.audit_file.read_text()], SECRET_VALUES, "the proxy logs")


def _curl(proxy: Proxy, port: int, url: str, *args: str, source: str = SANDBOX_IP,
          user: str | None = None) -> tuple[int, str]:
    cmd = ["curl", "-sS", "--max-time", "15", "--interface", source,
           "--proxy", f"http://127.0.0.1:{port}", "--cacert", str(proxy.ca),
           "-w", "\n%{http_code}", url, *args]
    if user:
        cmd[1:1] = ["--proxy-user", user]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    body, _, code = r.stdout.rpartition("\n")
    return int(code or 0), body + r.stderr


def test_one_address_two_identities_by_listener(split_proxy, upstream) -> None:
    proxy, tool, _ = split_proxy
    before = len(upstream.seen)
    code, _ = _curl(proxy, proxy.port, "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert code == 200
    assert_secret_equal(upstream.seen[before].headers.get("x-api-key"), ANTHROPIC_KEY, "key")
    code, body = _curl(proxy, tool, "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert code == 403 and json.loads(body)["identity"] == "bash-tool", body
    code, _ = _curl(proxy, tool, "https://upstream.test/docs/x")
    assert code == 200
    assert [s.path for s in upstream.seen[before:]] == ["/v1/messages", "/docs/x"]
    a = proxy.wait_audit(lambda e: e.get("sandbox") == "sbx-46" and e.get("rule") == "llm")
    t = proxy.wait_audit(lambda e: e.get("sandbox") == "sbx-46" and e.get("rule") == "docs-only")
    assert (a["identity"], a["identity_source"]) == ("coding-agent", "cidr")
    assert (t["identity"], t["identity_source"]) == ("bash-tool", "cidr/tool")


def test_the_agents_token_on_the_tool_listener_is_refused(split_proxy, upstream) -> None:
    proxy, tool, _ = split_proxy
    token = proxy.token("coding-agent", sandbox="sbx-46")
    before = len(upstream.seen)
    code, body = _curl(proxy, tool, "http://upstream.test/docs/x",
                       user=f"coding-agent:{token}")
    assert code == 407 and "disagrees" in body, body
    assert token not in body
    assert len(upstream.seen) == before
    # the tool's own token (same sandbox) is accepted there
    ok, body = _curl(proxy, tool, "https://upstream.test/docs/x",
                     user=f"bash-tool:{proxy.token('bash-tool', sandbox='sbx-46')}")
    assert ok == 200, body
    assert [s.path for s in upstream.seen[before:]] == ["/docs/x"]


def test_the_other_listener_and_strangers_are_refused_and_audited(split_proxy, upstream) -> None:
    proxy, tool, other = split_proxy
    before = len(upstream.seen)
    code, body = _curl(proxy, other, "http://upstream.test/docs/x")
    assert code == 407 and "neither the agent nor its bash tool" in body, body
    code, body = _curl(proxy, tool, "http://upstream.test/docs/x", source=STRANGER_IP)
    assert code == 407 and "no sandbox is known" in body, body
    ev = proxy.wait_audit(lambda e: "neither the agent" in (e.get("reason") or ""))
    assert ev["decision"] == "deny" and ev["code"] == "auth_invalid"
    assert ev["client"].startswith(SANDBOX_IP + ":")
    assert len(upstream.seen) == before
