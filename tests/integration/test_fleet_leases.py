"""One dynamic-secret lease per sandbox for the fleet (`--state-lease-kv`), revoked once.

Two replicas (A from test_fleet_secrets' `fleet_up`: PostgreSQL, OpenBao with its database
engine behind a relay, the login upstream; B a second `sandgate run` sharing A's confdir) on one
redis-server at 127.0.61.2 (run inside `unshare -n`). A sandbox served by both replicas gets ONE
PostgreSQL user: minted by the first replica to need it, relayed to the other through a KV v2
entry in OpenBao (Redis holds only the lease id, expiry and the entry's path). `DELETE` on one
replica ends the sandbox on both and the lease is revoked once: by one replica in OpenBao, the
other only dropping its copy; the relay entry is gone.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import hvac.exceptions
import pytest
import redis

from tests.integration.admin_support import ADMIN_TOKEN, Admin, wait_for
from tests.integration.conftest import Proxy, curl, free_port, split_status, start_proxy, stop_proxy
from tests.integration.test_fleet_secrets import ADMIN_IP, NAMES, UPSTREAM_IP, Fleet, fleet_up
from tests.support.redis import RedisServer
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

REDIS_IP = "127.0.61.2"
KV = "secret/sandgate-leases"


@dataclass
class Two:
    a: Fleet
    b: Proxy
    b_admin: Admin
    redis: RedisServer

    def login(self, proxy: Proxy, token: str) -> tuple[int, dict]:
        out = curl(proxy, "agent", "https://db.fleet.test/login", token=token)
        body, status = split_status(out.stdout)
        return status, json.loads(body) if body.startswith("{") else {"raw": body}

    def lease_events(self, proxy: Proxy, **match: object) -> list[dict]:
        return [e for e in proxy.audit() if e.get("event") == "lease"
                and all(e.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Two]:
    tmp = tmp_path_factory.mktemp("fleetleases")
    r = RedisServer(tmp / "redis", REDIS_IP, 6379).start()
    state = ["--state", r.url, "--state-prefix", "leasetest:", "--state-timeout", "2",
             "--state-lease-kv", KV]
    (tmp / "a").mkdir()
    with fleet_up(tmp / "a", *state) as a:
        (tmp / "b").mkdir()
        shutil.copytree(tmp / "a" / "conf", tmp / "b" / "conf")  # one CA and token key
        port = free_port()
        b = start_proxy(tmp / "b", a.admin.policies,
                        {"VAULT_ADDR": a.relay.addr, "VAULT_TOKEN": a.vault.root_token,
                         "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, a.pki,
                        *(f"--resolve={n}={UPSTREAM_IP}" for n in NAMES),
                        "--admin", f"{ADMIN_IP}:{port}", *state, start_timeout=120)
        b_admin = Admin(b, f"http://{ADMIN_IP}:{port}", a.admin.policies)
        try:
            wait_for(lambda: b_admin.get("/healthz", token=None)[0] == 200, 15, "B's admin")
            yield Two(a, b, b_admin, r)
        finally:
            stop_proxy(b)
            passwords = [p for _, p, _ in a.upstream.logins if p]
            assert_no_secret([b.logs(), b.audit_file.read_text(), a.proxy.logs(),
                              a.proxy.audit_file.read_text()], passwords, "logs or audit")
            keys = redis.Redis(host=REDIS_IP, port=6379, decode_responses=True)
            for k in keys.scan_iter("leasetest:lease:*"):  # Redis never holds a value
                assert not any(p in (keys.get(k) or "") for p in passwords)
    r.stop()


def open_leases(f: Fleet) -> list[str]:
    """The ids (last part) of the database leases OpenBao holds now."""
    try:
        resp = f.vault.client().sys.list_leases(prefix="database/creds/readonly/")
    except hvac.exceptions.InvalidPath:  # none left
        return []
    return list(resp["data"]["keys"])


def test_one_lease_for_the_fleet_revoked_once(two: Two) -> None:
    a, b = two.a, two.b
    token = a.token("shared-1")
    s1, d1 = two.login(a.proxy, token)
    s2, d2 = two.login(b, token)
    assert (s1, s2) == (200, 200), (d1, d2)
    user = d1["user"]
    assert d2["user"] == user and d1["login"] and d2["login"]  # one PostgreSQL user
    minted = two.lease_events(a.proxy, action="mint", outcome="ok", sandbox="shared-1")
    relayed = two.lease_events(b, action="mint", outcome="ok", sandbox="shared-1")
    assert [e["fleet"] for e in minted] == ["minted"]
    assert [e["fleet"] for e in relayed] == ["shared"]
    assert minted[0]["lease_id"] == relayed[0]["lease_id"]
    lease_id = minted[0]["lease_id"]
    assert lease_id.rpartition("/")[2] in open_leases(a)

    status, doc = two.b_admin.call("DELETE", "/v1/sandboxes/shared-1")
    assert status == 200 and doc["fleet"] is True, doc
    wait_for(lambda: two.lease_events(a.proxy, action="revoke", outcome="ok",
                                      sandbox="shared-1"), 10, "A dropping its copy")
    revokes = (two.lease_events(a.proxy, action="revoke", outcome="ok", sandbox="shared-1")
               + two.lease_events(b, action="revoke", outcome="ok", sandbox="shared-1"))
    assert sorted(e["fleet"] for e in revokes) == ["elsewhere", "here"], revokes
    assert not a.pg.can_login(user, a.password_of(user))  # revoked in OpenBao
    assert lease_id.rpartition("/")[2] not in open_leases(a)
    with pytest.raises(hvac.exceptions.InvalidPath):  # the relay entry went with it
        a.vault.client().secrets.kv.v2.list_secrets(path="sandgate-leases",
                                                    mount_point="secret")
    # the sandbox's tokens are refused on both replicas now
    for proxy in (a.proxy, b):
        before = len(a.upstream.logins)
        two.login(proxy, token)  # the CONNECT is refused (407): curl reports no status
        assert len(a.upstream.logins) == before
        ev = proxy.wait_audit(lambda e: e.get("sandbox") == "shared-1"
                              and e.get("code") == "auth_invalid")
        assert "has ended" in ev["reason"]
