"""Dynamic secrets of a launched sandbox are revoked when its container dies.

The sandbox is identified by its Docker labels (no token); the proxy follows the Docker event
stream, and the container's `die` ends the sandbox: its PostgreSQL user stops logging in while
another sandbox's still does. The rest of the setup is tests/integration/test_fleet_secrets.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from sandgate.sandbox import Sandbox
from tests.integration.docker.conftest import SESSION
from tests.integration.test_fleet_secrets import Fleet, fleet_up, no_values_in_logs

# 60 s: the first request of a new container waits for its Docker labels and a fresh database
# user; on a loaded 2-core CI machine 20 s was not always enough (CI of 2026-11-24)
CURL = "curl -sS --max-time 60 -w '\\n%{http_code}' https://db.fleet.test/login"


@pytest.fixture(scope="module")
def docker_fleet(tmp_path_factory, sandbox_network) -> Iterator[Fleet]:
    with fleet_up(tmp_path_factory.mktemp("fleet-docker"), "--docker-network",
                  sandbox_network.name, listen_host=sandbox_network.gateway) as f:
        yield f


def _login(sbx: Sandbox) -> dict:
    r = sbx.exec(CURL, timeout=90)
    body, _, status = r.stdout.rpartition("\n")
    assert status == "200", (status, body, r.stderr[-1000:])
    return json.loads(body)


def test_container_death_revokes_its_credential(docker_client, make_spec, docker_fleet):
    fleet = docker_fleet
    made: list[Sandbox] = []
    try:
        for suffix in ("a", "b"):
            spec = make_spec(identity="agent", image="sandgate-bash-tool:dev", token=None,
                             proxy_url=fleet.proxy.url, ca_pem=fleet.proxy.ca.read_text(),
                             sandbox_id=f"fleetsecrets-{SESSION}-{suffix}")
            made.append(Sandbox.create(docker_client, spec))
        a, b = made
        doc_a, doc_b = _login(a), _login(b)
        user_a, user_b = doc_a["user"], doc_b["user"]
        assert user_a != user_b and doc_a["login"] and doc_b["login"]
        minted = fleet.lease_events(action="mint", outcome="ok")
        assert {e["sandbox"] for e in minted} == {a.id, b.id}

        a.close()  # the container dies: Docker's event stream ends sandbox a
        ev = fleet.proxy.wait_audit(
            lambda e: e.get("event") == "lease" and e.get("action") == "sandbox_end"
            and e.get("sandbox") == a.id, timeout=20)
        assert ev["reason"] in ("container_die", "container_destroy") and ev["revoked"] == 1
        assert not fleet.pg.can_login(user_a, fleet.password_of(user_a))
        assert fleet.pg.can_login(user_b, fleet.password_of(user_b))
    finally:
        for s in made:
            s.close()
    no_values_in_logs(fleet)
