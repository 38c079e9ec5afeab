"""The flow owns its secrets, end to end: real OpenBao, a real `sandgate run --secret-ttl 1
--admin`, curl, and a slow TLS upstream that reflects the injected header once released.

(1) The value injected into a request is rotated in Vault and another request refreshes the
cache while the first one waits for its upstream: the first response must not carry the old
value in clear, and the old value must still be refused as exfiltration.
(2) A per-sandbox value whose sandbox ends while its request is in flight (DELETE
/v1/sandboxes/{id}, token expiry): the response must not carry it either.

Addresses: 127.0.43.2 the upstream, 127.0.43.1 the admin listener (run inside `unshare -n`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.integration.admin_support import ADMIN_TOKEN, Admin, wait_for
from tests.integration.conftest import Proxy, curl, free_port, split_status, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret
from tests.support.upstream import AppThread

pytestmark = pytest.mark.integration

UPSTREAM_IP, ADMIN_IP = "127.0.43.2", "127.0.43.1"
NAMES = ["slow.flow.test", "sb.flow.test"]
OLD = "test-flow-rotating-OLD-value-3b7e"
NEW = "test-flow-rotating-NEW-value-81c4"
SB_VALUES = {f"x{i}": f"test-flow-sandbox-x{i}-value-{i}d2a" for i in range(1, 4)}

POLICY = f"""
version: v1
secrets:
  api:
    vault: secret/data/flow/api
    field: token
  sb:
    vault: "secret/data/flow/sandboxes/{{{{ sandbox }}}}"
    field: token
identities:
  agent:
    rules:
      - name: api
        hosts: [slow.flow.test]
        private_cidrs: [{UPSTREAM_IP}/32]
        inject: {{headers: {{authorization: "Bearer {{{{ secrets.api }}}}"}}}}
      - name: sb
        hosts: [sb.flow.test]
        private_cidrs: [{UPSTREAM_IP}/32]
        inject: {{headers: {{authorization: "Bearer {{{{ secrets.sb }}}}"}}}}
"""


@dataclass
class SlowEcho:
    """`/slow`: waits until released, then reflects the Authorization it got (body, and a
    header); `/fast`: reflects it at once."""

    arrived: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    async def handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        self.arrived.append(auth)
        if request.path == "/slow":
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.release.wait, 20)
        return web.Response(text=f"you sent {auth}\n", headers={"x-echo": auth})


@dataclass
class Setup:
    proxy: Proxy
    admin: Admin
    vault: SeedableVault
    upstream: SlowEcho


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("flowsecrets")
    pki = make_pki(tmp / "pki", NAMES)
    vault = SeedableVault()
    vault.start()
    server: AppThread | None = None
    proxy: Proxy | None = None
    try:
        vault.put_kv2("flow/api", {"token": OLD})
        for sandbox, value in SB_VALUES.items():
            vault.put_kv2(f"flow/sandboxes/{sandbox}", {"token": value})
        upstream = SlowEcho()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        server = AppThread(app, pki.cert, pki.key, UPSTREAM_IP).start()
        policies = tmp / "policies"
        policies.mkdir()
        (policies / "flow.yaml").write_text(POLICY)
        aport = free_port()
        proxy = start_proxy(
            tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                            "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, pki,
            *(f"--resolve={n}={UPSTREAM_IP}" for n in NAMES), "--secret-ttl", "1",
            "--admin", f"{ADMIN_IP}:{aport}")
        admin = Admin(proxy, f"http://{ADMIN_IP}:{aport}", policies)
        wait_for(lambda: admin.get("/healthz", token=None)[0] == 200, 15, "the admin listener")
        yield Setup(proxy, admin, vault, upstream)
    finally:
        if proxy is not None:
            stop_proxy(proxy)
            logs = proxy.logs() + proxy.audit_file.read_text()
            assert_no_secret([logs], [OLD, NEW, *SB_VALUES.values()], "the proxy's logs")
        if server is not None:
            server.stop()
        vault.stop()


def _in_flight(s: Setup, url: str, token: str) -> Future[subprocess.CompletedProcess[str]]:
    """Start curl on `url` (a /slow path) and return once the upstream holds the request."""
    s.upstream.release.clear()
    before = len(s.upstream.arrived)
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(curl, s.proxy, "agent", url, "-D", "-", token=token)
    pool.shutdown(wait=False)
    wait_for(lambda: len(s.upstream.arrived) > before, 15, "the request at the upstream")
    return fut


def _answer(fut: Future[subprocess.CompletedProcess[str]]) -> tuple[str, int]:
    out = fut.result(30)
    body, status = split_status(out.stdout)
    return body + out.stderr, status


def test_a_rotated_value_never_comes_back_in_clear(setup: Setup) -> None:
    token = setup.proxy.token("agent")
    fut = _in_flight(setup, "https://slow.flow.test/slow", token)
    assert setup.upstream.arrived[-1] == f"Bearer {OLD}"
    # Vault rotates; the cache runs out (--secret-ttl 1) and another request refreshes it
    setup.vault.put_kv2("flow/api", {"token": NEW})
    time.sleep(1.5)
    out = curl(setup.proxy, "agent", "https://slow.flow.test/fast", token=token)
    assert split_status(out.stdout)[1] == 200 and setup.upstream.arrived[-1] == f"Bearer {NEW}"
    setup.upstream.release.set()
    text, status = _answer(fut)
    assert status == 200
    assert "[REDACTED:api]" in text  # reflected in the body and in the x-echo header
    assert_no_secret([text], [OLD, NEW], "the in-flight response")
    # the old value is retired, not forgotten: a sandbox sending it is still refused
    out = curl(setup.proxy, "agent", "https://slow.flow.test/fast", "-d", f"k={OLD}",
               token=token)
    body, status = split_status(out.stdout)
    assert status == 403 and json.loads(body)["code"] == "exfiltration"


@pytest.mark.parametrize("how", ["delete", "token_expiry"])
def test_a_per_sandbox_value_whose_sandbox_ends_in_flight(setup: Setup, how: str) -> None:
    sandbox = "x1" if how == "delete" else "x2"
    value = SB_VALUES[sandbox]
    token = setup.proxy.token("agent", sandbox=sandbox, ttl="4s" if how == "token_expiry"
                              else "1h")
    fut = _in_flight(setup, "https://sb.flow.test/slow", token)
    assert setup.upstream.arrived[-1] == f"Bearer {value}"
    if how == "delete":
        status, doc = setup.admin.call("DELETE", f"/v1/sandboxes/{sandbox}")
        assert status == 200, doc
    else:
        wait_for(lambda: any(e.get("event") == "lease" and e.get("action") == "sandbox_end"
                             and e.get("sandbox") == sandbox for e in setup.proxy.audit()),
                 15, "the end of the sandbox at its token's expiry")
    setup.upstream.release.set()
    text, status = _answer(fut)
    assert status == 200
    assert "[REDACTED:sb]" in text
    assert_no_secret([text], list(SB_VALUES.values()), "the in-flight response")
    # another sandbox of the same identity cannot send it either
    other = setup.proxy.token("agent", sandbox="x3")
    out = curl(setup.proxy, "agent", "https://sb.flow.test/fast", "-d", f"k={value}",
               token=other)
    body, status = split_status(out.stdout)
    assert status == 403 and json.loads(body)["code"] == "exfiltration"
