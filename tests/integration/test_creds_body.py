"""Body placeholders through a real `sandgate run`: a placeholder inside a JSON or form body
sent to a real JSON API (aiohttp, TLS on loopback) arrives as the value from OpenBao; one that
cannot be swapped is refused and nothing is forwarded; an API that echoes the body hands the
sandbox the placeholder's value scrubbed; the audit names the secret and how, never the value."""

from __future__ import annotations

import json
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest

from tests.integration.conftest import Proxy, curl, split_status, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.jsonapi import JsonApi
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration

API_IP = "127.0.51.1"  # helper 11's loopback range (127.0.51.x)
HOST = "json.creds.test"
KEY = "test-jsonapi-REAL-key-5c0ffee"
PH = "sandgate-placeholder-jsonapi"
URL = f"https://{HOST}/v1/call"

POLICY = f"""version: v1
secrets:
  jsonapi: {{vault: secret/data/creds/jsonapi, field: api_key, placeholder: {PH}}}
identities:
  agent:
    rules:
      - name: jsonapi-body
        hosts: [{HOST}]
        private_cidrs: [{API_IP}/32]
        paths: [/v1/*]
        substitute: [jsonapi]
        substitute_body: true
      - name: jsonapi-headers-only
        hosts: [{HOST}]
        private_cidrs: [{API_IP}/32]
        paths: [/headers/*]
        substitute: [jsonapi]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Proxy, JsonApi]]:
    tmp = tmp_path_factory.mktemp("creds-body")
    pki = make_pki(tmp / "pki", [HOST])
    api = JsonApi(API_IP, 443, str(pki.cert), str(pki.key)).start()
    vault = SeedableVault()
    vault.start()
    vault.put_kv2("creds/jsonapi", {"api_key": KEY})
    (tmp / "policies").mkdir()
    (tmp / "policies" / "creds.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve={HOST}={API_IP}")
    try:
        yield proxy, api
    finally:
        stop_proxy(proxy)
        logs = proxy.logs() + (proxy.audit_file.read_text() if proxy.audit_file.exists() else "")
        api.stop()
        vault.stop()
        assert_no_secret([logs], [KEY], "the proxy's logs or audit")


def post(proxy: Proxy, body: str, ctype: str, url: str = URL) -> tuple[str, int]:
    r = curl(proxy, "agent", url, "-H", f"content-type: {ctype}", "--data-binary", body)
    return split_status(r.stdout)


def test_json_body_placeholder_arrives_as_value_and_echo_is_scrubbed(stack):
    proxy, api = stack
    before = len(api.seen)
    body, status = post(proxy, json.dumps({"model": "m", "api_key": PH,
                                           "auth": {"h": f"Bearer {PH}"}}), "application/json")
    assert status == 200, body
    got = json.loads(api.seen[before].body)
    assert_secret_equal(got["api_key"], KEY, "the JSON value the API received")
    assert_secret_equal(got["auth"]["h"], f"Bearer {KEY}", "the partial JSON value")
    assert got["model"] == "m"
    # the API echoes what it got: the sandbox must not see the value
    assert_no_secret([body], [KEY], "the echoed response")
    assert json.loads(body)["received"]["model"] == "m"
    ev = proxy.wait_audit(lambda e: e.get("rule") == "jsonapi-body" and e.get("injected"))
    assert ev["injected"] == ["jsonapi@1: body json: 2 value(s)"]
    assert ev["secrets"] == ["jsonapi@1"]
    assert_no_secret([json.dumps(ev)], [KEY], "the audit event")


def test_form_body_placeholder_arrives_as_value(stack):
    proxy, api = stack
    before = len(api.seen)
    body, status = post(proxy, urlencode({"user": "u", "api_key": PH}),
                        "application/x-www-form-urlencoded")
    assert status == 200, body
    assert api.seen[before].body.startswith(b"user=u&api_key=")
    assert_secret_equal(api.seen[before].body.decode().partition("api_key=")[2], KEY,
                        "the form value the API received")
    assert_no_secret([body], [KEY], "the echoed response")


@pytest.mark.parametrize(("payload", "ctype", "why"), [
    (json.dumps({PH: "x"}), "application/json", "outside a string value"),
    ('{"k": "' + PH + '", "k": "y"}', "application/json", "does not parse"),
    (f"{PH}=1", "application/x-www-form-urlencoded", "outside a string value"),
    (f"key {PH}", "text/plain", "neither JSON nor a form"),
])
def test_unresolved_placeholder_refused_nothing_forwarded(stack, payload, ctype, why):
    proxy, api = stack
    before = len(api.seen)
    body, status = post(proxy, payload, ctype)
    assert status == 403, body
    doc = json.loads(body)
    assert doc["code"] == "exfiltration" and why in doc["reason"]
    assert len(api.seen) == before
    ev = proxy.wait_audit(lambda e: e.get("code") == "exfiltration" and why in e["reason"])
    assert ev["exfiltration"] == ["jsonapi:placeholder:body"]


def test_rule_without_substitute_body_leaves_body_alone(stack):
    proxy, api = stack
    before = len(api.seen)
    body, status = post(proxy, json.dumps({"api_key": PH}), "application/json",
                        url=f"https://{HOST}/headers/call")
    assert status == 200, body
    assert json.loads(api.seen[before].body) == {"api_key": PH}
