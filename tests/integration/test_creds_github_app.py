"""GitHub App installation tokens through a real `sandgate run`: the app's key in OpenBao,
Sandgate signs the app JWT, a GitHub-shaped endpoint verifies it with the PUBLIC key and mints
tokens restricted as each identity's rule says; tokens are cached, scrubbed when reflected,
revoked when the sandbox ends; a wrong key is 503 and nothing is forwarded."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.integration.conftest import Proxy, curl, split_status, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.github_app_server import GitHubApp
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

GH_IP = "127.0.51.5"  # helper 11's loopback range
HOST = "gh.creds.test"
APP_ID, INSTALLATION = 4242, 777


def _pem(key: rsa.RSAPrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


POLICY = f"""version: v1
secrets:
  gh:
    vault: secret/data/creds/gh-app
    github_app: {{app_id: {APP_ID}, installation_id: {INSTALLATION}, api_url: "https://{HOST}"}}
  gh-wrongkey:
    vault: secret/data/creds/gh-wrongkey
    github_app: {{app_id: {APP_ID}, installation_id: {INSTALLATION}, api_url: "https://{HOST}"}}
identities:
  agent:
    rules:
      - name: gh-mint
        hosts: [{HOST}]
        methods: [POST]
        paths: ["/app/installations/*/access_tokens"]
        private_cidrs: [{GH_IP}/32]
      - name: gh-wide
        hosts: [{HOST}]
        methods: [GET]
        paths: ["/repos/**"]
        private_cidrs: [{GH_IP}/32]
        inject: {{headers: {{authorization: "token {{{{ secrets.gh }}}}"}}}}
        github_app:
          repositories: [acme/api, acme/web]
          permissions: {{contents: write, pull_requests: write}}
  bash-tool:
    rules:
      - name: gh-mint
        hosts: [{HOST}]
        methods: [POST]
        paths: ["/app/installations/*/access_tokens"]
        private_cidrs: [{GH_IP}/32]
      - name: gh-narrow
        hosts: [{HOST}]
        methods: [GET]
        paths: ["/repos/acme/api/**"]
        private_cidrs: [{GH_IP}/32]
        inject: {{headers: {{authorization: "token {{{{ secrets.gh }}}}"}}}}
        github_app: {{repositories: [acme/api], permissions: {{contents: read}}}}
      - name: gh-wrongkey
        hosts: [{HOST}]
        methods: [GET]
        paths: ["/repos/acme/web/**"]
        private_cidrs: [{GH_IP}/32]
        inject: {{headers: {{authorization: "token {{{{ secrets.gh-wrongkey }}}}"}}}}
"""


@dataclass
class Stack:
    proxy: Proxy
    gh: GitHubApp
    pem: str  # the app's private key, as in OpenBao

    def call(self, identity: str, path: str, token: str | None = None) -> tuple[str, int]:
        r = curl(self.proxy, identity, f"https://{HOST}{path}", token=token)
        return split_status(r.stdout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("creds-gh")
    pki = make_pki(tmp / "pki", [HOST])
    app_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = app_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    gh = GitHubApp(GH_IP, 443, str(pki.cert), str(pki.key), APP_ID, INSTALLATION,
                   public).start()
    vault = SeedableVault()
    vault.start()
    vault.put_kv2("creds/gh-app", {"private_key": _pem(app_key)})
    vault.put_kv2("creds/gh-wrongkey", {"private_key": _pem(other_key)})
    (tmp / "policies").mkdir()
    (tmp / "policies" / "gh.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve={HOST}={GH_IP}")
    try:
        yield Stack(proxy, gh, _pem(app_key))
    finally:
        stop_proxy(proxy)
        logs = proxy.logs() + (proxy.audit_file.read_text() if proxy.audit_file.exists() else "")
        gh.stop()
        vault.stop()
        assert_no_secret([logs], [i.token for i in gh.issued] + [_pem(app_key)],
                         "the proxy's logs or audit")


def test_tokens_restricted_per_identity_verified_jwt_and_scrubbed(stack):
    body, status = stack.call("agent", "/repos/acme/web/contents/README.md")
    assert status == 200, body
    wide = stack.gh.issued[-1]
    assert wide.repositories == ["api", "web"]
    assert wide.permissions == {"contents": "write", "pull_requests": "write"}
    assert_no_secret([body], [wide.token], "the reflected response")
    body, status = stack.call("bash-tool", "/repos/acme/api/contents/README.md")
    assert status == 200, body
    narrow = stack.gh.issued[-1]
    assert narrow is not wide
    assert narrow.repositories == ["api"] and narrow.permissions == {"contents": "read"}
    assert_no_secret([body], [narrow.token], "the reflected response")
    assert stack.gh.rejected_jwts == 0
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "gh-narrow" and e.get("injected"))
    assert ev["injected"][0].startswith(
        f"gh@1: github-app installation {INSTALLATION} (repo=api, contents=read), expires ")


def test_token_cached(stack):
    assert stack.call("agent", "/repos/acme/api/contents/x")[1] == 200
    n = len(stack.gh.issued)
    assert stack.call("agent", "/repos/acme/api/contents/y")[1] == 200
    assert len(stack.gh.issued) == n


def test_wrong_key_is_503_and_nothing_forwarded(stack):
    served, rejected = stack.gh.served, stack.gh.rejected_jwts
    body, status = stack.call("bash-tool", "/repos/acme/web/contents/x")
    assert status == 503
    doc = json.loads(body)
    assert doc["code"] == "secret_unavailable" and "GitHub answered 401" in doc["reason"]
    assert stack.gh.rejected_jwts == rejected + 1  # the endpoint checked the signature
    assert stack.gh.served == served


def test_token_revoked_when_the_sandbox_ends(stack):
    token = stack.proxy.token("bash-tool", ttl="3s", sandbox="sb-gh-1")
    body, status = stack.call("bash-tool", "/repos/acme/api/contents/x", token=token)
    assert status == 200, body
    mine = stack.gh.issued[-1]
    assert not mine.revoked
    deadline = time.monotonic() + 15  # the token expires after 3s: the sandbox ends
    while not mine.revoked and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mine.revoked


def _lines(pem: str) -> list[str]:
    return pem.strip().splitlines()[1:-1]


def _wrap(text: str, width: int) -> str:
    return "\n".join(text[i:i + width] for i in range(0, len(text), width))


def test_the_app_private_key_is_refused_in_requests(stack, tmp_path):
    """The key is a credential Sandgate holds (read to mint): a sandbox sending it anywhere,
    whole, in a JSON string or as its base64 lines at any width, is refused (issue 34)."""
    assert stack.call("agent", "/repos/acme/api/contents/pem")[1] == 200  # key read, token minted
    body = "".join(_lines(stack.pem))
    forms = {"pem": (stack.pem, "text/plain"),
             "json": (json.dumps({"note": "x", "key": stack.pem}), "application/json"),
             "lines": ("\n".join(_lines(stack.pem)), "text/plain"),
             "lines-76": (_wrap(body, 76), "text/plain"),
             "one-line": (json.dumps({"k": body}), "application/json"),
             "second-half": (_wrap(body[len(body) // 2:], 70), "text/plain")}
    rejected, minted = stack.gh.rejected_jwts, len(stack.gh.issued)
    for name, (data, ctype) in forms.items():
        f = tmp_path / name
        f.write_text(data)
        r = curl(stack.proxy, "agent",
                 f"https://{HOST}/app/installations/{INSTALLATION}/access_tokens",
                 "-X", "POST", "--data-binary", f"@{f}", "-H", f"content-type: {ctype}")
        out, status = split_status(r.stdout)
        assert status == 403, (name, status)
        doc = json.loads(out)
        assert doc["code"] == "exfiltration" and "gh" in doc["reason"], name
        assert_no_secret([out], [*_lines(stack.pem)], "the refusal")
    assert stack.gh.rejected_jwts == rejected and len(stack.gh.issued) == minted  # none sent
    ev = stack.proxy.wait_audit(lambda e: any(x.startswith("gh:value:body")
                                              for x in e.get("exfiltration") or []))
    assert ev["decision"] == "deny"


def test_an_answer_holding_the_app_private_key_is_scrubbed(stack):
    """An upstream answering with the key (JSON-escaped, its base64 lines at any width, the
    PEM as text) reaches the sandbox without it."""
    body = "".join(_lines(stack.pem))
    pieces = [*_lines(stack.pem), body[:60], body[-200:-140]]
    try:
        stack.gh.also = {"key": stack.pem, "one_line": body}
        out, status = stack.call("agent", "/repos/acme/api/contents/leak")
        assert status == 200, out
        assert "[REDACTED:gh]" in out
        assert_no_secret([out, json.loads(out)["key"]], pieces, "the JSON answer")
        stack.gh.also = {}
        for text in (stack.pem, _wrap(body, 76), "key:\n" + _wrap(body, 50) + "\nend\n"):
            stack.gh.text = text
            out, status = stack.call("agent", "/repos/acme/api/contents/leak")
            assert status == 200, out
            assert "[REDACTED:gh]" in out
            assert_no_secret([out, out.replace("\n", "")], pieces, "the text answer")
    finally:
        stack.gh.also, stack.gh.text = {}, None
