"""`--state redis://`: one fleet, one state, with a real redis-server and several Sandgate
processes (docs/fleet-state.md).

Replica A is `--workers 2` (two proxy processes behind one port), replica B a single process;
both share the confdir (CA, token key), the policy and the Redis at 127.0.61.1:6379 (run inside
`unshare -n`, like every non-Docker integration test). Requests go to both replicas, each on a
new connection (so A's kernel spreads them over its two workers).

What must hold: a secret budget of N calls gives exactly N successes across all processes under
concurrent load; an `rps` holds for the fleet (successes over a window at most burst + rps x
window + 1); `DELETE /v1/sandboxes/{id}` on one replica refuses the sandbox's tokens on every
replica within the stated bound; a reload through one replica's API reaches the other; and with
Redis killed under load nothing budget-bearing is forwarded (503 state_unavailable), rates fall
back to per-process counting, and everything recovers once Redis is back, without a restart.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.integration.admin_support import (
    OWN_IP,
    Admin,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
    wait_for,
)
from tests.integration.conftest import ANTHROPIC_KEY, SECRET_VALUES, stop_proxy
from tests.support.redis import RedisServer
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

REDIS_IP = "127.0.61.1"
BUDGET = 12
RPS, BURST = 3, 3
ENDED_BOUND = 2.0 + 1.0  # RECHECK (sandgate.state.fleet) + delivery and a request's time

POLICY = f"""version: v1
secrets:
  metered: {{vault: secret/data/llm/anthropic, field: api_key,
            budget: {{calls: {BUDGET}, per: 1h}}}}
identities:
  fleet-agent:
    rules:
      - name: metered
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.metered }}}}"}}}}
        private_cidrs: [{OWN_IP}/32]
      - name: plain
        hosts: [upstream.test]
        methods: [GET]
        paths: ["/fleet/**"]
        private_cidrs: [{OWN_IP}/32]
  fleet-rated:
    limits: {{rps: {RPS}, burst: {BURST}}}
    rules:
      - name: plain
        hosts: [upstream.test]
        methods: [GET]
        paths: ["/fleet/**"]
        private_cidrs: [{OWN_IP}/32]
"""


@dataclass
class Fleet:
    redis: RedisServer
    a: Admin  # --workers 2
    b: Admin  # one process
    policies: Path
    tokens: dict[tuple[str, str | None], str]

    @property
    def replicas(self) -> tuple[Admin, Admin]:
        return self.a, self.b

    def token(self, identity: str, sandbox: str | None = None) -> str:
        key = (identity, sandbox)
        if key not in self.tokens:
            self.tokens[key] = self.a.proxy.token(identity, sandbox=sandbox)
        return self.tokens[key]

    def send(self, via: Admin, identity: str, method: str, url: str,
             sandbox: str | None = None) -> requests.Response:
        """One request on a new connection."""
        proxy = f"http://{identity}:{self.token(identity, sandbox)}@{via.proxy.host}:" \
                f"{via.proxy.port}"
        with requests.Session() as s:
            s.trust_env = False
            s.proxies = {"https": proxy, "http": proxy}
            s.verify = str(via.proxy.ca)
            return s.request(method, url, json={} if method == "POST" else None, timeout=20)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vault, own_upstream, pki) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    redis = RedisServer(tmp / "redis", REDIS_IP, 6379).start()
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "fleet.yaml").write_text(POLICY)
    # --state-timeout 2: a machine shared with other test runs may be slower than 250 ms
    state = ["--state", redis.url, "--state-prefix", "fleettest:", "--state-timeout", "2",
             "--no-watch"]
    (tmp / "a").mkdir()
    a = start_admin_proxy(tmp / "a", policies, vault, pki, "--workers", "2", *state)
    wait_for(lambda: a.get("/readyz")[0] == 200, 120, "replica A's workers ready")
    (tmp / "b").mkdir()
    shutil.copytree(tmp / "a" / "conf", tmp / "b" / "conf")  # one CA and token key
    b = start_admin_proxy(tmp / "b", policies, vault, pki, *state)
    wait_for(lambda: b.get("/readyz")[0] == 200, 60, "replica B ready")
    f = Fleet(redis, a, b, policies, {})
    wait_for(lambda: b.get("/readyz")[1].get("fleet", {}).get("processes") == 3, 20,
             "three processes heartbeating")
    yield f
    for r in (a, b):
        if r.proxy.proc.poll() is None:
            stop_proxy(r.proxy)
    redis.stop()
    logs = [r.proxy.logs() + r.proxy.audit_file.read_text() for r in (a, b)]
    assert_no_secret(logs, SECRET_VALUES, "the replicas' logs or audit")


def _fire(fleet: Fleet, jobs: list[tuple[Admin, str, str, str, str | None]],
          threads: int = 12) -> list[requests.Response]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda j: fleet.send(*j), jobs))


def test_a_budget_of_n_calls_gives_exactly_n_across_the_fleet(fleet: Fleet,
                                                              own_upstream) -> None:
    before = len(own_upstream.seen)
    jobs = [(fleet.replicas[i % 2], "fleet-agent", "POST",
             f"https://api.anthropic.com/v1/messages?budget={i}", None)
            for i in range(BUDGET * 3)]
    out = _fire(fleet, jobs)
    codes = Counter(r.status_code for r in out)
    assert codes == {200: BUDGET, 429: BUDGET * 2}, codes
    refused = [r for r in out if r.status_code == 429]
    assert all(r.headers.get("x-sandgate-reason") == "budget_exhausted" for r in refused)
    seen = [s for s in own_upstream.seen[before:] if "budget=" in s.query]
    assert len(seen) == BUDGET and all(s.headers["x-api-key"] == ANTHROPIC_KEY for s in seen)
    # both replicas and both of A's workers served some of the N
    served = [e for r in fleet.replicas for e in r.proxy.audit()
              if e.get("event") == "request" and e.get("rule") == "metered"
              and e.get("decision") == "allow"]
    assert len(served) == BUDGET
    assert {e.get("worker") for e in fleet.a.proxy.audit() if e.get("rule") == "metered"
            and e.get("event") == "request"} == {0, 1}


def test_an_rps_holds_for_the_fleet(fleet: Fleet) -> None:
    """Three processes each allowing burst + rps x window would let ~3x through."""
    start = time.monotonic()
    ok = refused = 0
    i = 0
    while time.monotonic() - start < 3.0:
        jobs = [(fleet.replicas[(i + k) % 2], "fleet-rated", "GET",
                 f"https://upstream.test/fleet/rate?{i + k}", None) for k in range(6)]
        i += 6
        for r in _fire(fleet, jobs, threads=6):
            if r.status_code == 200:
                ok += 1
            else:
                assert r.status_code == 429 and r.headers["x-sandgate-reason"] == "rate_limited"
                refused += 1
    window = time.monotonic() - start
    assert BURST <= ok <= BURST + RPS * window + 1, (ok, refused, window)
    assert refused > 0


def test_delete_on_one_replica_ends_the_sandbox_on_all(fleet: Fleet) -> None:
    sandbox = "fleet-sb-1"
    for via in fleet.replicas:
        r = fleet.send(via, "fleet-agent", "GET", "https://upstream.test/fleet/sb", sandbox)
        assert r.status_code == 200, r.text
    status, body = fleet.b.call("DELETE", f"/v1/sandboxes/{sandbox}")
    assert status == 200 and body["fleet"] is True, body
    ended = time.monotonic()

    def refused(via: Admin) -> bool:
        try:
            fleet.send(via, "fleet-agent", "GET", "https://upstream.test/fleet/sb", sandbox)
        except requests.exceptions.ProxyError as e:  # the CONNECT is refused: 407
            return "407" in str(e)
        return False

    for via in fleet.replicas:  # every replica, and both of A's workers (new connections)
        for _ in range(4):
            wait_for(lambda v=via: refused(v), ENDED_BOUND, "the ended sandbox refused")
    assert time.monotonic() - ended < ENDED_BOUND * 2
    for via in fleet.replicas:
        ev = via.proxy.wait_audit(lambda e: e.get("sandbox") == sandbox
                                  and e.get("code") == "auth_invalid")
        assert "has ended" in ev["reason"]
    # another sandbox of the same identity is served as before
    r = fleet.send(fleet.a, "fleet-agent", "GET", "https://upstream.test/fleet/sb", "other-sb")
    assert r.status_code == 200


def test_a_reload_through_one_replica_reaches_the_other(fleet: Fleet) -> None:
    v0 = fleet.a.version()
    assert fleet.b.version() == v0
    (fleet.policies / "extra.yaml").write_text(
        "version: v1\nidentities:\n  fleet-late:\n    rules:\n      - name: p\n"
        f"        hosts: [upstream.test]\n        private_cidrs: [{OWN_IP}/32]\n")
    status, body = fleet.b.post("/v1/reload")
    assert status == 200 and body["outcome"] == "ok", body
    v1 = body["version"]
    assert v1 != v0
    wait_for(lambda: fleet.a.version() == v1, 10, "replica A serving the reloaded policy")
    ready = wait_for(lambda: (lambda b: b if b["fleet"]["policy_versions"] == [v1] else None)(
        fleet.b.get("/readyz")[1]), 10, "the fleet agreeing on the new version")
    assert ready["fleet"]["agree"] is True and ready["fleet"]["processes"] == 3


def test_redis_killed_and_restarted_under_load(fleet: Fleet, own_upstream) -> None:
    fleet.redis.kill()
    before = len(own_upstream.seen)
    wait_for(lambda: fleet.b.get("/readyz")[1]["fleet"]["available"] is False, 10,
             "the state seen down")
    jobs = [(fleet.replicas[i % 2], "fleet-agent", "POST",
             f"https://api.anthropic.com/v1/messages?down={i}", None) for i in range(12)]
    out = _fire(fleet, jobs, threads=6)
    assert {r.status_code for r in out} == {503}
    assert {r.headers["x-sandgate-reason"] for r in out} == {"state_unavailable"}
    assert not [s for s in own_upstream.seen[before:] if "down=" in s.query]  # none forwarded
    # rates fall back to each process's own bucket (--state-fail open): still served
    r = fleet.send(fleet.b, "fleet-rated", "GET", "https://upstream.test/fleet/down")
    assert r.status_code in (200, 429) and r.headers.get("x-sandgate-reason") != \
        "state_unavailable"
    status, body = fleet.b.get("/metrics")
    assert status == 200 and "sandgate_state_available 0.0" in body
    assert any(e.get("event") == "state" and e.get("available") is False
               for e in fleet.b.proxy.audit())

    fleet.redis.start()  # empty: the budget starts again (docs: persistence)
    wait_for(lambda: fleet.b.get("/readyz")[1]["fleet"]["available"] is True, 10,
             "the state back on B")

    def served() -> bool:
        rs = [fleet.send(v, "fleet-agent", "POST",
                         "https://api.anthropic.com/v1/messages?back=1", None)
              for v in (fleet.a, fleet.a, fleet.b)]
        return all(x.status_code == 200 for x in rs)

    wait_for(served, 10, "budget-bearing requests served again on every process", interval=0.5)
    assert any(e.get("event") == "state" and e.get("available") is True
               for e in fleet.a.proxy.audit())
