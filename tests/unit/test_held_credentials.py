"""Every credential Sandgate holds is scrubbed and detected (issue 34): a private key in every
form a client could reassemble (sandgate.secrets.keyforms), the GitHub App key once read, the
audit signing key, and an aws secret's session token after a rotation.

Keys are generated per run; nothing here is shaped like a real provider key.
"""

from __future__ import annotations

import base64
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate import confdir
from sandgate.audit.chain import Chain
from sandgate.audit.events import AuditLog
from sandgate.policy.loader import load_policy_dir
from sandgate.runner.build import own_keys
from sandgate.scrub.flowsecrets import ScrubSets
from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.unwrap import scrub_unwrapped, unwrapped_view
from sandgate.secrets import github_app
from sandgate.secrets.github_app import GitHubApps
from sandgate.secrets.keyforms import PrivateKey, pem_values
from sandgate.secrets.vault import SecretBroker, VaultConfig
from tests.unit.test_fleet_secrets import FakeClock
from tests.unit.test_github_app import REF, Fake, _dial

RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KEYS: dict[str, PrivateKey] = {"rsa": RSA, "ec": ec.generate_private_key(ec.SECP256R1()),
                               "ed25519": ed25519.Ed25519PrivateKey.generate()}


def pem(key: PrivateKey, fmt: serialization.PrivateFormat) -> str:
    return key.private_bytes(serialization.Encoding.PEM, fmt,
                             serialization.NoEncryption()).decode()


PEMS = {f"{name}-pkcs8": pem(k, serialization.PrivateFormat.PKCS8) for name, k in KEYS.items()}
PEMS["rsa-pkcs1"] = pem(RSA, serialization.PrivateFormat.TraditionalOpenSSL)
SETS = {name: SecretSet([("key", v) for v in pem_values(text)]) for name, text in PEMS.items()}


def body_of(text: str) -> str:
    return "".join(text.strip().splitlines()[1:-1])


def wrap(text: str, width: int, sep: str = "\n") -> str:
    return sep.join(text[i:i + width] for i in range(0, len(text), width))


def leaks(s: SecretSet, data: bytes) -> bool:
    return bool(s.find(data) or s.find(unwrapped_view(data)))


def assert_leaks(s: SecretSet, data: bytes, what: str) -> None:
    """Detected; a failure names `what`, never the key material."""
    if not leaks(s, data):
        raise AssertionError(f"{what}: not detected")


def pieces(text: str) -> list[str]:
    """What must not survive a scrub: every 24 characters of the body (18 key bytes)."""
    body = body_of(text)
    return [body[i:i + 24] for i in range(0, len(body) - 24, 12)]


def assert_gone(s: SecretSet, text: str, data: str) -> None:
    out, n = scrub_unwrapped(s, data.encode())
    assert n >= 1 and b"[REDACTED:key]" in out
    flat = out.replace(b"\r", b"").replace(b"\n", b"").replace(b"\\n", b"").replace(b"\\r", b"")
    left = sum(p.encode() in flat for p in pieces(text))
    assert left == 0, f"{left} pieces of the key survived the scrub"
    assert_leaks(s, data.encode(), "the key")


@pytest.mark.parametrize("name", sorted(PEMS))
def test_a_pem_key_is_scrubbed_and_detected_whole_escaped_and_bare(name):
    text, s = PEMS[name], SETS[name]
    body = body_of(text)
    for data in (text, "said: " + text.strip() + " (end)", json.dumps({"key": text}),
                 json.dumps({"key": text.strip()}), json.dumps({"b": body}),
                 json.dumps({"lines": "\n".join(text.strip().splitlines()[1:-1])}),
                 "\r\n".join(text.strip().splitlines()[1:-1]),
                 base64.urlsafe_b64encode(base64.b64decode(body)).decode()):
        assert_gone(s, text, data)


@settings(max_examples=40)
@given(name=st.sampled_from(sorted(PEMS)), width=st.integers(min_value=4, max_value=120),
       sep=st.sampled_from(["\n", "\r\n"]), lead=st.text("ab =:\n", max_size=8))
def test_the_base64_body_wrapped_at_any_width_is_scrubbed_and_detected(name, width, sep, lead):
    text = PEMS[name]
    assert_gone(SETS[name], text, lead + "x" + sep + wrap(body_of(text), width, sep) + sep)


def test_a_partial_rsa_leak_without_the_header_is_caught():
    """The second half of the body (the primes and CRT values) is the key; so is one prime."""
    text, s = PEMS["rsa-pkcs1"], SETS["rsa-pkcs1"]
    body = body_of(text)
    assert_leaks(s, wrap(body[len(body) // 2:], 64).encode(), "the body's second half")
    p = RSA.private_numbers().p
    assert_leaks(s, b"p = " + hex(p)[2:].encode(), "a prime in hex")
    assert_leaks(s, base64.b64encode(b"prefix" + p.to_bytes(128, "big") + b"suffix"),
                 "a prime inside a base64 blob")


def test_an_unreadable_pem_still_gives_its_text_and_body():
    junk = "-----BEGIN PRIVATE KEY-----\nZmFrZS1ub3QtYS1rZXktYnV0LXN0aWxsLWhlbGQ=\n" \
           "-----END PRIVATE KEY-----\n"
    s = SecretSet([("key", v) for v in pem_values(junk)])
    assert_leaks(s, b"fake-not-a-key-but-still-held", "its DER, raw")
    assert_leaks(s, json.dumps(junk).encode(), "the text JSON-escaped")


async def test_the_github_app_key_is_held_once_read(monkeypatch):
    """Found: the App's PEM was not a secret to the scrubber. Reading it to mint holds it."""
    fake = Fake()
    monkeypatch.setattr(github_app, "call", fake.call)
    apps = GitHubApps(fake.read, clock=lambda: fake.now)
    assert apps.values() == []
    g0 = apps.generation
    await apps.get(REF, None, None, _dial)
    s = SecretSet(apps.values())
    key = (await fake.read(REF))[0]["private_key"]
    assert apps.generation > g0
    assert_leaks(s, json.dumps({"k": key}).encode(), "the PEM JSON-escaped")
    assert_leaks(s, wrap(body_of(key), 76).encode(), "the body wrapped at 76")
    assert {h.name for h in s.find(key.encode())} == {"gh"}


def _confdir(tmp_path: Path) -> Path:
    conf = confdir.ensure_confdir(tmp_path / "conf")
    confdir.ensure_ca(conf)
    return conf


def test_the_audit_signing_key_is_scrubbed_and_detected(tmp_path: Path):
    key = ed25519.Ed25519PrivateKey.generate()
    sink = AuditLog(tmp_path / "audit.jsonl", chain=Chain(key))
    try:
        own = own_keys(sink, _confdir(tmp_path), None)
    finally:
        sink.close()
    assert {n for n, _ in own} == {"audit-signing-key", "ca-private-key", "proxy-token-key"}
    s = SecretSet([(n, v) for n, v in own if n == "audit-signing-key"])
    text = pem(key, serialization.PrivateFormat.PKCS8)
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    for data in (text.encode(), seed.hex().encode(), base64.b64encode(seed),
                 json.dumps({"k": text}).encode()):
        assert_leaks(s, data, "the audit signing key")


def test_the_ca_key_token_key_and_admin_token_are_scrubbed_and_detected(tmp_path: Path):
    """Issue 34: every credential Sandgate holds. The CA's private key signs every certificate
    a sandbox trusts; the token key mints any identity's proxy token; the admin token runs the
    admin API. The CA certificate beside the key is public: never refused."""
    conf = _confdir(tmp_path)
    own = own_keys(AuditLog(None), conf, "admin-token-for-this-test-31")
    assert {n for n, _ in own} == {"ca-private-key", "proxy-token-key", "admin-token"}
    s = SecretSet(list(own))
    ca_file = (conf / confdir.CA_KEY_FILE).read_text()
    ca_key = serialization.load_pem_private_key(ca_file.encode(), None)
    key_pem = pem(ca_key, serialization.PrivateFormat.PKCS8)
    key_file_pem = ca_file[:ca_file.index("-----END")]  # the key block as the file holds it
    token_key = confdir.token_key(conf)
    for data, what in ((key_pem.encode(), "the CA key"),
                       (json.dumps({"k": key_file_pem}).encode(), "the CA key JSON-escaped"),
                       (wrap(body_of(key_pem), 64).encode(), "the CA key's body"),
                       (base64.b64encode(token_key), "the token key as stored"),
                       (token_key.hex().encode(), "the token key in hex"),
                       (b"x-admin: admin-token-for-this-test-31", "the admin token")):
        assert_leaks(s, data, what)
    cert = (conf / confdir.CA_CERT_FILE).read_bytes()
    assert s.find(cert) == []


def test_no_audit_chain_no_admin_token(tmp_path: Path):
    own = own_keys(AuditLog(None), _confdir(tmp_path), None)
    assert {n for n, _ in own} == {"ca-private-key", "proxy-token-key"}


AWS_POLICY = """
version: v1
secrets:
  aws: {vault: secret/data/creds/aws, aws: {region: us-east-1, service: s3}}
identities:
  agent:
    rules:
      - name: s3
        hosts: [s3.test]
        inject: {sign: aws}
"""


class AwsBroker(SecretBroker):
    """The real broker over one aws record in a fake Vault, rotated on demand."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "p.yaml").write_text(textwrap.dedent(AWS_POLICY).lstrip())
        self.policy = load_policy_dir(tmp)
        super().__init__(VaultConfig(addr="http://127.0.0.1:9", token="t"),
                         self.policy.secrets, ttl=1)
        self.clock = FakeClock()
        self._clock = lambda: self.clock.now
        self.n = 0

    async def _read(self, ref: Any) -> tuple[Any, int | None]:
        self.vault_reads += 1
        return {"secret_access_key": f"fake-aws-secret-{self.n}-0123456789",
                "access_key_id": "FAKEKEYID", "session_token": f"fake-session-{self.n}-abcdef"
                }, self.n


async def test_an_aws_session_token_stays_held_after_rotation(tmp_path: Path):
    b = AwsBroker(tmp_path)
    try:
        await b.get("aws")
        b.n += 1
        b.clock.advance(5)  # the cached value expired: the next get reads the rotated record
        await b.get("aws")
        values = {v for _, v in b.cached_pairs()}
        assert {"fake-session-0-abcdef", "fake-aws-secret-0-0123456789",
                "fake-session-1-abcdef", "fake-aws-secret-1-0123456789"} <= values
        s = ScrubSets().current(b, {}, b.policy)
        assert_leaks(s, b"X-Amz-Security-Token: fake-session-0-abcdef", "the old session token")
    finally:
        await b.aclose()
