"""mode: report: what the rules would refuse goes out without credentials and is audited as
`report`; address, identity and exfiltration refusals stay."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.integration.admin_support import (
    Admin,
    copy_policies,
    delta,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
)
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SANDGATE,
    SECRET_VALUES,
    curl,
    split_status,
    stop_proxy,
)
from tests.support.netns import host_in_netns, listen_in_netns
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.integration

# Report mode checks addresses without any private_cidrs, so the would-be-refused requests need
# a public address to reach: an AS112 address on a test host of our own, in a network namespace
# made for this module (never on the host's interfaces, never routed off this machine).
PUBLIC_IP = "192.175.48.42"

AUDITOR = """\
version: v1
identities:
  auditor:
    mode: report
    rules:
      - name: docs
        hosts: [other.test]
        methods: [GET]
        paths: [/docs/**]
      - name: llm
        hosts: [other.test]
        methods: [POST]
        paths: [/v1/messages]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
      - name: no-admin
        action: deny
        hosts: [other.test]
        paths: [/admin/**]
      - name: inside
        hosts: [inside.test]
        methods: [GET]
        paths: [/allowed]
"""


@pytest.fixture(scope="module")
def public_upstream(pki) -> Iterator[UpstreamServer]:
    with host_in_netns(PUBLIC_IP) as ns:
        sock = listen_in_netns(ns, PUBLIC_IP, 443)
        server = UpstreamServer(PUBLIC_IP, 443, str(pki.cert), str(pki.key), sock=sock).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def admin(tmp_path_factory, vault, own_upstream, public_upstream, pki) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("report")
    a = start_admin_proxy(tmp, copy_policies(tmp, AUDITOR), vault, pki,
                          f"--resolve=other.test={PUBLIC_IP}",
                          f"--resolve=api.openai.com={PUBLIC_IP}")
    yield a
    stop_proxy(a.proxy)
    assert_no_secret([a.proxy.logs(), a.proxy.audit_file.read_text()], SECRET_VALUES, "logs")


def _event(admin: Admin, path: str) -> dict:
    return admin.proxy.wait_audit(lambda e: e["event"] == "request" and e.get("path") == path)


def test_allowed_request_still_injected(admin, public_upstream):
    before = len(public_upstream.seen)
    r = curl(admin.proxy, "auditor", "https://other.test/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200
    assert_secret_equal(public_upstream.seen[before].headers.get("x-api-key"), ANTHROPIC_KEY,
                        "upstream x-api-key")
    assert _event(admin, "/v1/messages")["decision"] == "allow"


@pytest.mark.parametrize(("method", "path", "code", "rule"), [
    ("POST", "/v1/complete", "no_rule", None),
    ("GET", "/page", "no_rule", None),
    ("GET", "/admin/users", "denied_by_rule", "no-admin"),
])
def test_would_be_refused_reaches_upstream_without_secret(admin, public_upstream, method, path,
                                                          code, rule):
    m0 = admin.metrics()
    before = len(public_upstream.seen)
    r = curl(admin.proxy, "auditor", f"https://other.test{path}", "-X", method,
             "-H", "authorization: Bearer whatever-the-client-had")
    _, status = split_status(r.stdout)
    assert status == 200, r.stdout + r.stderr
    seen = public_upstream.seen[before:]
    assert [s.path for s in seen] == [path]
    assert "x-api-key" not in seen[0].headers
    assert seen[0].headers.get("authorization") == "Bearer whatever-the-client-had"
    assert_no_secret([json.dumps(seen[0].headers)], SECRET_VALUES, "the upstream")
    ev = _event(admin, path)
    assert ev["decision"] == "report" and ev["code"] == code and ev["rule"] == rule
    assert ev["secrets"] == [] and ev["upstream_status"] == 200
    assert ev["dialed"] == f"{PUBLIC_IP}:443"
    assert delta(m0, admin.metrics(), "sandgate_requests_total", identity="auditor",
                 decision="report", code=code) == 1


def test_refused_connect_is_accepted_and_reported(admin, public_upstream):
    before = len(public_upstream.seen)
    r = curl(admin.proxy, "auditor", "https://api.openai.com/v1/models")
    assert split_status(r.stdout)[1] == 200
    assert [s.path for s in public_upstream.seen[before:]] == ["/v1/models"]
    connect = admin.proxy.wait_audit(lambda e: e["event"] == "connect" and
                                     e.get("host") == "api.openai.com")
    assert connect["decision"] == "report" and connect["code"] == "no_rule"
    assert _event(admin, "/v1/models")["decision"] == "report"


def test_internal_address_stays_refused(admin, own_upstream):
    # inside.test resolves to 10.1.2.3; upstream.test to a loopback address: no private_cidrs
    # apply to a reported request, so both stay refused
    for url, path in (("https://inside.test/x", "/x"), ("https://upstream.test/docs/a", "/docs/a")):
        before = len(own_upstream.seen)
        body, status = split_status(curl(admin.proxy, "auditor", url).stdout)
        assert status == 403, body
        assert json.loads(body)["code"] == "internal_address"
        assert len(own_upstream.seen) == before
        ev = admin.proxy.wait_audit(lambda e, p=path: e["event"] == "request" and
                                    e.get("path") == p and e.get("identity") == "auditor")
        assert ev["decision"] == "deny" and ev["code"] == "internal_address"


def test_exfiltration_stays_refused(admin, public_upstream):
    before = len(public_upstream.seen)
    r = curl(admin.proxy, "auditor", "https://other.test/page2",
             "-H", "x-api-key: sandgate-placeholder-anthropic")
    body, status = split_status(r.stdout)
    assert status == 403 and json.loads(body)["code"] == "exfiltration"
    assert len(public_upstream.seen) == before


def test_unknown_identity_stays_refused(admin):
    tok = admin.proxy.token("not-in-policy")
    body, status = split_status(curl(admin.proxy, "not-in-policy", "https://other.test/page",
                                     token=tok).stdout)
    assert status == 403 and json.loads(body)["code"] == "unknown_identity"


def test_check_and_explain_name_report_mode(admin):
    r = subprocess.run([*SANDGATE, "check", str(admin.policies)], capture_output=True,
                       text=True, cwd=str(HERE.parent.parent), check=False)
    assert "report mode" in r.stdout and "auditor" in r.stdout
    status, doc = admin.post("/v1/explain", {"identity": "auditor", "method": "GET",
                                              "url": "https://other.test/page"})
    assert status == 200
    assert doc["decision"] == "report" and doc["code"] == "no_rule" and doc["mode"] == "report"
    status, pol = admin.get("/v1/policy")
    assert pol["identities"]["auditor"]["mode"] == "report"
    assert pol["identities"]["bash-tool"]["mode"] == "enforce"
