"""OAuth 2.0 secrets through a real `sandgate run`, against a real authorization server
(Authlib's server components on Flask, TLS on loopback, tests/support/oauth_server.py): tokens
minted with the client credentials from OpenBao, cached until near expiry and minted again,
single flight, a rotated refresh token written back to OpenBao (check-and-set), failures as 503
secret_unavailable naming the provider's error, and a reflected token scrubbed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import (
    SANDGATE,
    Proxy,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.bao import SeedableVault
from tests.support.pki import Pki, make_pki
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

AUTH_IP = "127.0.51.2"  # helper 11's loopback range: the authorization and resource server
DOWN_IP = "127.0.51.3"  # nothing listens here
SLOW_IP = "127.0.51.4"  # accepts and never answers
EXPIRES_IN = 4  # seconds: expiry is tested by waiting it out
ROOT = Path(__file__).parents[2]

CLIENTS = {  # obvious fakes
    "cc-client": {"secret": "test-cc-client-SECRET-1a2b"},
    "sf-client": {"secret": "test-sf-client-SECRET-3c4d"},
    "rt-client": {"secret": "test-rt-client-SECRET-5e6f",
                  "refresh_token": "test-rt-REFRESH-initial-7a8b"},
    "bad-client": {"secret": "test-bad-client-SECRET-9c0d"},
}
RECORDS = {
    "cc": {"client_id": "cc-client", "client_secret": CLIENTS["cc-client"]["secret"]},
    "sf": {"client_id": "sf-client", "client_secret": CLIENTS["sf-client"]["secret"]},
    "rt": {"client_id": "rt-client", "client_secret": CLIENTS["rt-client"]["secret"],
           "refresh_token": CLIENTS["rt-client"]["refresh_token"]},
    "bad": {"client_id": "bad-client", "client_secret": CLIENTS["bad-client"]["secret"],
            "refresh_token": "test-bad-REFRESH-unknown-1e2f"},
}
TOKEN_URL = "https://auth.creds.test/oauth/token"


def _api_rule(name: str) -> str:
    return f"""      - name: {name}-api
        hosts: [api.creds.test]
        paths: [/{name}/*]
        private_cidrs: [{AUTH_IP}/32]
        inject: {{headers: {{authorization: "Bearer {{{{ secrets.{name} }}}}"}}}}
"""


SECRETS = {  # name -> (client record, oauth2 settings)
    "cc": ("cc", f'token_url: "{TOKEN_URL}", grant: client_credentials'),
    "sf": ("sf", f'token_url: "{TOKEN_URL}", grant: client_credentials, scope: read'),
    "rt": ("rt", f'token_url: "{TOKEN_URL}", grant: refresh_token, client_auth: post'),
    "bad": ("bad", f'token_url: "{TOKEN_URL}", grant: refresh_token'),
    "down": ("cc", 'token_url: "https://down.creds.test/oauth/token", '
                   "grant: client_credentials, timeout: 3"),
    "slow": ("cc", 'token_url: "https://slow.creds.test/oauth/token", '
                   "grant: client_credentials, timeout: 1"),
    "vaultdown": ("sf", f'token_url: "{TOKEN_URL}", grant: client_credentials'),
    "norule": ("cc", 'token_url: "https://norule.creds.test/oauth/token", '
                     "grant: client_credentials"),
}
POLICY = "version: v1\nsecrets:\n" + "".join(
    f"  {n}: {{vault: secret/data/creds/{r}, oauth2: {{{o}}}}}\n"
    for n, (r, o) in SECRETS.items()) + f"""identities:
  agent:
    rules:
      - name: token-endpoints
        hosts: [auth.creds.test, down.creds.test, slow.creds.test]
        methods: [POST]
        paths: [/oauth/token]
        private_cidrs: [127.0.51.0/24]
{"".join(_api_rule(n) for n in SECRETS)}"""


@dataclass
class Stack:
    proxy: Proxy
    vault: SeedableVault
    pki: Pki

    def stats(self) -> dict:
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.check_hostname = False  # by address, from the test itself (not through Sandgate)
        with urllib.request.urlopen(f"https://{AUTH_IP}/stats", context=ctx, timeout=10) as r:
            return json.loads(r.read())

    def record(self, name: str) -> tuple[dict, int]:
        resp = self.vault.client().secrets.kv.v2.read_secret_version(
            path=f"creds/{name}", mount_point="secret", raise_on_deleted_version=True)
        return resp["data"]["data"], resp["data"]["metadata"]["version"]

    def call(self, name: str) -> tuple[str, int]:
        r = curl(self.proxy, "agent", f"https://api.creds.test/{name}/me")
        return split_status(r.stdout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("creds-oauth2")
    pki = make_pki(tmp / "pki", ["auth.creds.test", "api.creds.test", "down.creds.test"])
    env = {**os.environ, "OAUTH_EXPIRES_IN": str(EXPIRES_IN)}
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.oauth_server", AUTH_IP, "443", str(pki.cert),
         str(pki.key), json.dumps(CLIENTS)], cwd=ROOT, env=env,
        stdout=(tmp / "oauth.log").open("wb"), stderr=subprocess.STDOUT)
    silent = socket.create_server((SLOW_IP, 443))  # the kernel accepts; nobody answers
    vault = SeedableVault()
    vault.start()
    for name, rec in RECORDS.items():
        vault.put_kv2(f"creds/{name}", rec)
    (tmp / "policies").mkdir()
    (tmp / "policies" / "oauth.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        *(f"--resolve={h}={AUTH_IP}" for h in
                          ("auth.creds.test", "api.creds.test", "norule.creds.test")),
                        f"--resolve=down.creds.test={DOWN_IP}",
                        f"--resolve=slow.creds.test={SLOW_IP}")
    st = Stack(proxy, vault, pki)
    deadline = time.monotonic() + 30
    while True:
        try:
            st.stats()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError((tmp / "oauth.log").read_text()[-3000:]) from None
            time.sleep(0.2)
    try:
        yield st
    finally:
        tokens = st.stats()["tokens"]
        stop_proxy(proxy)
        server.terminate()
        server.wait(10)
        silent.close()
        logs = proxy.logs() + (proxy.audit_file.read_text() if proxy.audit_file.exists() else "")
        vault.stop()
        secrets = [*tokens, *(c["secret"] for c in CLIENTS.values()),
                   *(r.get("refresh_token", "") for r in RECORDS.values())]
        assert_no_secret([logs], [s for s in secrets if s], "the proxy's logs or audit")


def test_client_credentials_token_used_cached_and_reflection_scrubbed(stack):
    body, status = stack.call("cc")
    assert status == 200, body
    minted = stack.stats()["tokens"]
    assert stack.stats()["issued"]["cc-client"] == 1
    # the resource server accepted the token (Authlib's validator) and reflected it
    assert_no_secret([body], minted, "the reflected response")
    assert json.loads(body)["token"] != ""
    body, status = stack.call("cc")  # cached: no second token request
    assert status == 200
    assert stack.stats()["issued"]["cc-client"] == 1
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "cc-api" and e.get("injected"))
    assert ev["secrets"] == ["cc@1"]
    assert ev["injected"][0].startswith("cc@1: oauth2 client_credentials, expires in ")


def test_expired_token_is_minted_again(stack):
    assert stack.call("cc")[1] == 200
    before = stack.stats()["issued"]["cc-client"]
    time.sleep(EXPIRES_IN)  # past expires_in (less the margin)
    assert stack.call("cc")[1] == 200
    assert stack.stats()["issued"]["cc-client"] == before + 1


def test_single_flight(stack):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: stack.call("sf"), range(8)))
    assert [s for _, s in results] == [200] * 8
    assert stack.stats()["issued"]["sf-client"] == 1


def test_refresh_token_rotated_and_written_back(stack):
    assert stack.call("rt")[1] == 200, "first refresh"
    rec, version = stack.record("rt")
    first = rec["refresh_token"]
    assert first != CLIENTS["rt-client"]["refresh_token"]  # rotated...
    assert version == 2  # ...and written back over version 1 (check-and-set)
    assert rec["client_secret"] == CLIENTS["rt-client"]["secret"]
    time.sleep(EXPIRES_IN)
    # the old refresh token is revoked by the server: this works only with the written-back one
    assert stack.call("rt")[1] == 200, "second refresh"
    rec, version = stack.record("rt")
    assert version == 3 and rec["refresh_token"] != first
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "rt-api" and e.get("injected"))
    assert "refresh token rotated" in ev["injected"][0]


def test_refresh_failure_is_503_with_the_providers_error(stack):
    body, status = stack.call("bad")
    assert status == 503
    doc = json.loads(body)
    assert doc["code"] == "secret_unavailable"
    assert "answered 400 invalid_grant" in doc["reason"]
    assert stack.stats()["served"].get("bad", 0) == 0  # nothing forwarded


def test_token_endpoint_down_is_503(stack):
    body, status = stack.call("down")
    assert status == 503
    assert "cannot be reached" in json.loads(body)["reason"]


def test_token_endpoint_not_allowed_by_the_rules_is_503(stack):
    body, status = stack.call("norule")
    assert status == 503
    doc = json.loads(body)
    assert "do not allow POST https://norule.creds.test/oauth/token" in doc["reason"]
    assert stack.stats()["served"].get("norule", 0) == 0


def test_check_reports_the_unreachable_token_endpoint_the_proxy_refuses(stack, tmp_path):
    """issue 38: `check` passed this policy, and the proxy answers its norule-api rule 503
    (above). It now names that rule, and only it: the endpoints the other secrets use are
    allowed by token-endpoints, and their failures (down, slow) are not the policy's."""
    (tmp_path / "oauth.yaml").write_text(POLICY)
    res = subprocess.run([*SANDGATE, "check", "--format", "json", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    (u,) = json.loads(res.stdout)["prerequisites"]
    assert (u["identity"], u["rule"], u["secret"], u["token_endpoint"]) == (
        "agent", "norule-api", "norule", "https://norule.creds.test/oauth/token")
    assert "hosts: [norule.creds.test], methods: [POST]" in u["fix"]
    body, status = stack.call("norule")  # and the proxy does what check said
    assert status == 503 and json.loads(body)["code"] == "secret_unavailable"


def test_token_endpoint_that_never_answers_is_503_within_its_timeout(stack):
    body, status = stack.call("slow")
    assert status == 503
    assert "did not answer within 1s" in json.loads(body)["reason"]


def test_vault_down_is_503_and_nothing_forwarded(stack):  # last: it stops OpenBao
    stack.vault.stop()
    body, status = stack.call("vaultdown")
    assert status == 503
    assert json.loads(body)["code"] == "secret_unavailable"
    assert stack.stats()["served"].get("vaultdown", 0) == 0
