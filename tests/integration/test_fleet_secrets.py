"""Per-sandbox secrets and dynamic secrets with leases, end to end with real parts.

A real `sandgate run` (with --admin), a real OpenBao dev server with KV values per sandbox and
its database secrets engine minting PostgreSQL users, a real PostgreSQL cluster (Debian's
package) and an HTTPS upstream that accepts a request only if the injected Basic pair logs in to
PostgreSQL. OpenBao sits behind a relay that the tests switch off to make it "down" without
losing its in-memory leases.

Addresses: 127.0.17.2 PostgreSQL, 127.0.17.3 the relay to OpenBao, 127.0.17.4 the upstream,
127.0.17.1 the admin listener (run inside `unshare -n`, like every non-Docker integration test).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.integration.admin_support import ADMIN_TOKEN, Admin, wait_for
from tests.integration.conftest import Proxy, curl, free_port, split_status, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.pki import make_pki
from tests.support.postgres import PostgresCluster
from tests.support.relay import Relay
from tests.support.secrets import assert_no_secret
from tests.support.upstream import AppThread

pytestmark = pytest.mark.integration

PG_IP, RELAY_IP, UPSTREAM_IP, ADMIN_IP = "127.0.17.2", "127.0.17.3", "127.0.17.4", "127.0.17.1"
NAMES = ["db.fleet.test", "gh.fleet.test"]
GH_S1 = "test-fleet-gh-S1-value-4c2e81"
GH_S2 = "test-fleet-gh-S2-value-9a7d03"
DB_TTL, DB_MAX_TTL = 10, 120  # renewal (at half the grant) is seen within seconds

POLICY = f"""
version: v1
secrets:
  gh:
    vault: "secret/data/sandboxes/{{{{ sandbox }}}}/github"
    field: token
  db:
    dynamic: {{path: database/creds/readonly, field: password, username_field: username}}
identities:
  agent:
    rules:
      - name: gh
        hosts: [gh.fleet.test]
        private_cidrs: [{UPSTREAM_IP}/32]
        inject:
          headers: {{authorization: "Bearer {{{{ secrets.gh }}}}"}}
      - name: db
        hosts: [db.fleet.test]
        private_cidrs: [{UPSTREAM_IP}/32]
        inject:
          basic: {{username: "{{{{ secrets.db.username }}}}", password: "{{{{ secrets.db }}}}"}}
"""


@dataclass
class LoginUpstream:
    """db.fleet.test/login: 200 only if the Basic pair logs in to PostgreSQL.
    gh.fleet.test/echo: answers with the Authorization it got, plus `leak` (a leaky API)."""

    pg: PostgresCluster
    logins: list[tuple[str, str, bool]] = field(default_factory=list)  # user, password, ok
    auth_seen: list[str] = field(default_factory=list)
    leak: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        if request.host.startswith("gh.fleet.test"):
            self.auth_seen.append(auth)
            return web.Response(text=f"you sent {auth}; also {self.leak}\n")
        user = password = ""
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        loop = asyncio.get_running_loop()
        ok = bool(user) and await loop.run_in_executor(None, self.pg.can_login, user, password)
        self.logins.append((user, password, ok))
        return web.json_response({"user": user, "login": ok}, status=200 if ok else 401)


@dataclass
class Fleet:
    proxy: Proxy
    admin: Admin
    pg: PostgresCluster
    vault: SeedableVault
    relay: Relay
    upstream: LoginUpstream
    pki: Any = None  # the upstream's PKI (a second replica trusts it too)

    def token(self, sandbox: str | None, ttl: str = "1h") -> str:
        return self.proxy.token("agent", ttl=ttl, sandbox=sandbox)

    def login(self, token: str) -> tuple[int, dict[str, Any]]:
        out = curl(self.proxy, "agent", "https://db.fleet.test/login", token=token)
        body, status = split_status(out.stdout)
        return status, json.loads(body) if body.startswith("{") else {"raw": body}

    def password_of(self, user: str) -> str:
        return next(p for u, p, _ in self.upstream.logins if u == user)

    def lease_events(self, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.proxy.audit() if e.get("event") == "lease"
                and all(e.get(k) == v for k, v in match.items())]


def _seed(v: SeedableVault, pg: PostgresCluster) -> None:
    v.put_kv2("sandboxes/s1/github", {"token": GH_S1})
    v.put_kv2("sandboxes/s2/github", {"token": GH_S2})
    c = v.client()
    c.sys.enable_secrets_engine("database")
    c.secrets.database.configure(
        name="pg", plugin_name="postgresql-database-plugin", allowed_roles=["readonly"],
        connection_url=pg.admin_url, username=pg.admin, password=pg.admin_password)
    c.secrets.database.create_role(
        name="readonly", db_name="pg", default_ttl=f"{DB_TTL}s", max_ttl=f"{DB_MAX_TTL}s",
        creation_statements=["CREATE ROLE \"{{name}}\" WITH LOGIN PASSWORD '{{password}}' "
                             "VALID UNTIL '{{expiration}}';"])


@contextmanager
def fleet_up(tmp: Path, *proxy_args: str, listen_host: str = "127.0.0.1",
             admin_ip: str = ADMIN_IP) -> Iterator[Fleet]:
    """PostgreSQL, OpenBao (behind a relay) with the database engine, the upstream and a
    `sandgate run --admin` with POLICY; everything stopped at exit."""
    pki = make_pki(tmp / "pki", NAMES)
    pg = PostgresCluster(PG_IP).start()
    vault = SeedableVault()
    upstream_srv: AppThread | None = None
    proxy: Proxy | None = None
    try:
        vault.start()
        _seed(vault, pg)
        relay = Relay(RELAY_IP, ("127.0.0.1", vault.port)).start()
        upstream = LoginUpstream(pg)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", upstream.handle)
        upstream_srv = AppThread(app, pki.cert, pki.key, UPSTREAM_IP).start()
        policies = tmp / "policies"
        policies.mkdir()
        (policies / "fleet.yaml").write_text(POLICY)
        aport = free_port()
        proxy = start_proxy(
            tmp, policies, {"VAULT_ADDR": relay.addr, "VAULT_TOKEN": vault.root_token,
                            "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, pki,
            *(f"--resolve={n}={UPSTREAM_IP}" for n in NAMES), "--admin", f"{admin_ip}:{aport}",
            *proxy_args, listen_host=listen_host, start_timeout=120)
        admin = Admin(proxy, f"http://{admin_ip}:{aport}", policies)
        wait_for(lambda: admin.get("/healthz", token=None)[0] == 200, 15, "the admin listener")
        yield Fleet(proxy, admin, pg, vault, relay, upstream, pki)
    finally:
        if proxy is not None:
            stop_proxy(proxy)
        if upstream_srv is not None:
            upstream_srv.stop()
        vault.stop()
        pg.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet_up(tmp_path_factory.mktemp("fleet")) as f:
        yield f


def no_values_in_logs(fleet: Fleet) -> None:
    passwords = [p for _, p, _ in fleet.upstream.logins if p]
    logs = fleet.proxy.logs() + fleet.proxy.audit_file.read_text()
    assert_no_secret([logs], [GH_S1, GH_S2, *passwords], "the proxy's logs or audit")


# ------------------------------------------------------------------------ per-sandbox KV


def test_two_sandboxes_of_one_identity_get_their_own_kv_values(fleet: Fleet) -> None:
    t1, t2 = fleet.token("s1"), fleet.token("s2")
    seen = fleet.upstream.auth_seen
    for token, mine, other in ((t1, GH_S1, GH_S2), (t2, GH_S2, GH_S1)):
        out = curl(fleet.proxy, "agent", "https://gh.fleet.test/echo", token=token)
        body, status = split_status(out.stdout)
        assert status == 200, out.stderr
        assert seen[-1] == f"Bearer {mine}"  # the upstream got this sandbox's value
        assert "[REDACTED:gh]" in body
        assert_no_secret([body, out.stderr], [mine, other], "the sandbox's response")
    ev = fleet.proxy.wait_audit(lambda e: e.get("rule") == "gh" and e.get("sandbox") == "s2")
    assert ev["secrets"] == ["gh@1"] and ev["decision"] == "allow"
    no_values_in_logs(fleet)


def test_a_sandbox_less_token_is_refused_for_a_per_sandbox_secret(fleet: Fleet) -> None:
    before = len(fleet.upstream.auth_seen)
    out = curl(fleet.proxy, "agent", "https://gh.fleet.test/echo", token=fleet.token(None))
    body, status = split_status(out.stdout)
    assert status == 403
    doc = json.loads(body)
    assert doc["code"] == "sandbox_required" and "'gh'" in doc["reason"]
    assert "--sandbox" in doc["hint"]
    assert len(fleet.upstream.auth_seen) == before  # nothing was forwarded
    ev = fleet.proxy.wait_audit(lambda e: e.get("code") == "sandbox_required")
    assert ev["sandbox"] is None and ev["rule"] == "gh"


def test_no_value_crosses_sandboxes(fleet: Fleet) -> None:
    t1 = fleet.token("s1")
    # an upstream that hands sandbox s1 the value of sandbox s2: scrubbed
    fleet.upstream.leak = GH_S2
    try:
        out = curl(fleet.proxy, "agent", "https://gh.fleet.test/echo", token=t1)
    finally:
        fleet.upstream.leak = ""
    body, status = split_status(out.stdout)
    assert status == 200 and body.count("[REDACTED:gh]") == 2
    assert_no_secret([body], [GH_S1, GH_S2], "the sandbox's response")
    # sandbox s1 sending sandbox s2's value anywhere: exfiltration
    out = curl(fleet.proxy, "agent", "https://gh.fleet.test/echo", "-d", f"x={GH_S2}",
               token=t1)
    body, status = split_status(out.stdout)
    assert status == 403 and json.loads(body)["code"] == "exfiltration"
    ev = fleet.proxy.wait_audit(lambda e: e.get("code") == "exfiltration")
    assert ev["sandbox"] == "s1" and ev["exfiltration"] == ["gh:value:body"]
    no_values_in_logs(fleet)


# ------------------------------------------------------------------------ dynamic secrets


def test_two_sandboxes_get_different_postgres_users_renewed_and_revoked(fleet: Fleet) -> None:
    t1, t2 = fleet.token("d1"), fleet.token("d2")
    (s1, doc1), (s2, doc2) = fleet.login(t1), fleet.login(t2)
    assert (s1, s2) == (200, 200), (doc1, doc2)
    u1, u2 = doc1["user"], doc2["user"]
    assert u1 != u2 and doc1["login"] and doc2["login"]
    assert fleet.login(t1)[1]["user"] == u1  # cached for the sandbox: minted once
    minted = fleet.lease_events(action="mint", outcome="ok")
    assert {e["sandbox"] for e in minted} >= {"d1", "d2"}
    assert all(e["secret"] == "db" and e["lease_id"].startswith("database/creds/readonly/")
               for e in minted)

    # renewed before expiry: still valid after more than one grant (DB_TTL) has passed
    wait_for(lambda: fleet.lease_events(action="renew", outcome="ok", sandbox="d1"),
             DB_TTL, "a renewal of d1's lease")
    time.sleep(DB_TTL / 2 + 1)
    assert fleet.pg.can_login(u1, fleet.password_of(u1))
    assert fleet.login(t1)[1]["user"] == u1

    # a fleet controller ends sandbox d1: its user is gone, d2's still logs in
    status, doc = fleet.admin.call("DELETE", "/v1/sandboxes/d1")
    assert (status, doc) == (200, {"sandbox": "d1", "revoked": 1, "pending": 0})
    assert not fleet.pg.can_login(u1, fleet.password_of(u1))
    assert fleet.pg.can_login(u2, fleet.password_of(u2))
    ev = fleet.lease_events(action="revoke", outcome="ok", sandbox="d1")[-1]
    assert ev["secret"] == "db" and ev["reason"] == "admin_api"
    fleet.admin.call("DELETE", "/v1/sandboxes/d2")
    assert not fleet.pg.can_login(u2, fleet.password_of(u2))
    no_values_in_logs(fleet)


def test_a_sandbox_less_token_is_refused_for_a_dynamic_secret(fleet: Fleet) -> None:
    before = len(fleet.upstream.logins)
    status, doc = fleet.login(fleet.token(None))
    assert status == 403 and doc.get("code") == "sandbox_required", doc
    assert len(fleet.upstream.logins) == before


def test_token_expiry_revokes_the_sandbox_credential(fleet: Fleet) -> None:
    token = fleet.token("e1", ttl="3s")
    status, doc = fleet.login(token)
    assert status == 200, doc
    user = doc["user"]
    assert fleet.pg.can_login(user, fleet.password_of(user))
    ev = wait_for(lambda: fleet.lease_events(action="sandbox_end", sandbox="e1"), 10,
                  "the end of sandbox e1 at its token's expiry")[-1]
    assert ev["reason"] == "token_expired" and ev["revoked"] == 1
    assert not fleet.pg.can_login(user, fleet.password_of(user))


def test_openbao_down_during_revocation_is_retried_and_audited(fleet: Fleet) -> None:
    status, doc = fleet.login(fleet.token("f1"))
    assert status == 200, doc
    user = doc["user"]
    fleet.relay.stop()
    try:
        status, body = fleet.admin.call("DELETE", "/v1/sandboxes/f1")
        assert (status, body) == (202, {"sandbox": "f1", "revoked": 0, "pending": 1})
        failed = fleet.lease_events(action="revoke", outcome="failed", sandbox="f1")
        assert failed and failed[0]["attempt"] == 1 and failed[0]["secret"] == "db"
        assert "unreachable" in failed[0]["error"]
        # still valid: nothing revoked it yet
        assert fleet.pg.can_login(user, fleet.password_of(user))
        wait_for(lambda: len(fleet.lease_events(action="revoke", outcome="failed",
                                                sandbox="f1")) >= 2, 5, "a retry")
    finally:
        fleet.relay.start()
    ok = wait_for(lambda: fleet.lease_events(action="revoke", outcome="ok", sandbox="f1"),
                  15, "the retried revocation")[-1]
    assert ok["attempt"] >= 3 and ok["reason"] == "admin_api"
    assert not fleet.pg.can_login(user, fleet.password_of(user))
    no_values_in_logs(fleet)


def test_shutdown_revokes_what_it_holds(fleet: Fleet) -> None:
    status, doc = fleet.login(fleet.token("g1"))
    assert status == 200, doc
    user = doc["user"]
    stop_proxy(fleet.proxy)
    assert fleet.proxy.proc.returncode is not None
    assert not fleet.pg.can_login(user, fleet.password_of(user))
    ev = fleet.lease_events(action="revoke", sandbox="g1")[-1]
    assert (ev["outcome"], ev["reason"]) == ("ok", "shutdown")
    no_values_in_logs(fleet)
