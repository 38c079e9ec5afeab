"""GitHub App installation tokens (sandgate.secrets.github_app) with GitHub faked: the app JWT
verifies with the public key, the request body carries the rule's restrictions, the answer is
parsed strictly, tokens are per (sandbox, restrictions), cached, and revoked per sandbox.
tests/integration/test_creds_github_app.py runs them against a GitHub-shaped endpoint."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from sandgate.errors import SecretError
from sandgate.policy.model import GitHubAppRef, GitHubScope, SecretRef, Source
from sandgate.secrets import github_app
from sandgate.secrets.github_app import GitHubApps, app_jwt, parse_answer, request_body
from sandgate.secrets.tokenhttp import TokenFailure

pytestmark = pytest.mark.unit

KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
PEM = KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption()).decode()
NARROW = GitHubScope(("api",), (("contents", "read"),))
WIDE = GitHubScope(("api", "web"), (("contents", "write"),))
REF = SecretRef(name="gh", mount="secret", path="gh/app", field="private_key", kv_version=2,
                placeholder="sandgate-placeholder-gh", source=Source("p.yaml", 1),
                github_app=GitHubAppRef(42, 7, "https://gh.example"))


def test_app_jwt_verifies_with_the_public_key():
    claims = jwt.decode(app_jwt(42, PEM, 1_000_000.0), KEY.public_key(), algorithms=["RS256"],
                        issuer="42", options={"verify_exp": False, "verify_iat": False})
    assert claims["iat"] == 1_000_000 - 60 and claims["exp"] - claims["iat"] <= 600


def test_request_body_names_the_restrictions():
    assert request_body(NARROW) == {"repositories": ["api"], "permissions": {"contents": "read"}}
    assert request_body(None) == {}
    assert NARROW.describe() == "repo=api, contents=read"


@pytest.mark.parametrize(("status", "body", "why"), [
    (401, b'{"message": "Bad credentials"}', "GitHub answered 401"),
    (201, b"[]", "not a JSON object"),
    (201, b'{"expires_at": "2030-01-01T00:00:00Z"}', "no usable token"),
    (201, b'{"token": "a\\r\\nb", "expires_at": "2030-01-01T00:00:00Z"}', "no usable token"),
    (201, b'{"token": "t", "expires_at": "soon"}', "expires_at"),
    (201, b'{"token": "t", "expires_at": "2030-01-01T00:00:00"}', "expires_at"),  # no zone
    (201, b'{"token": "t", "expires_at": "2000-01-01T00:00:00Z"}', "already expired"),
])
def test_bad_answers_refused(status, body, why):
    with pytest.raises(TokenFailure, match=why):
        parse_answer(status, body, 1_800_000_000.0)


def test_answer_parsed():
    assert parse_answer(201, b'{"token": "t", "expires_at": "2027-01-15T09:00:00Z"}',
                        1_800_000_000.0) == ("t", 3600.0)


class Fake:
    def __init__(self) -> None:
        self.minted: list[dict[str, Any]] = []
        self.revoked: list[str] = []
        self.now = 100.0

    async def read(self, ref: SecretRef) -> tuple[Any, int | None]:
        return {"private_key": PEM}, 3

    async def call(self, method: str, url: str, address: Any, ctx: Any, timeout: float,
                   headers: dict[str, str], body: bytes | None, what: str) -> tuple[int, bytes]:
        if method == "DELETE":
            self.revoked.append(headers["authorization"][6:])
            return 204, b""
        jwt.decode(headers["authorization"][7:], KEY.public_key(), algorithms=["RS256"],
                   issuer="42")
        self.minted.append({"url": url, "body": body})
        n = len(self.minted)
        return 201, (b'{"token": "tok-%d", "expires_at": "2099-01-01T00:00:00Z"}' % n)


async def _dial(url: str) -> tuple[str, int]:
    return "192.0.2.9", 443


@pytest.fixture
def fake(monkeypatch) -> Fake:
    f = Fake()
    monkeypatch.setattr(github_app, "call", f.call)
    return f


async def test_per_sandbox_and_restriction_cached_and_revoked(fake):
    apps = GitHubApps(fake.read, clock=lambda: fake.now)
    a = await apps.get(REF, "sb1", NARROW, _dial)
    assert (await apps.get(REF, "sb1", NARROW, _dial)).value == a.value  # cached
    b = await apps.get(REF, "sb1", WIDE, _dial)  # another rule's restrictions: its own token
    c = await apps.get(REF, "sb2", NARROW, _dial)  # another sandbox: its own token
    assert len({a.value, b.value, c.value}) == 3 and len(fake.minted) == 3
    assert fake.minted[0]["url"] == "https://gh.example/app/installations/7/access_tokens"
    assert a.version == 3 and "installation 7 (repo=api, contents=read)" in a.note
    apps.end_sandbox("sb1")
    await asyncio.sleep(0.01)
    assert sorted(fake.revoked) == sorted([a.value, b.value])
    assert ("gh", a.value) in apps.values()  # revoked, still scrubbed
    await apps.aclose()
    assert c.value in fake.revoked


async def test_single_flight(fake):
    apps = GitHubApps(fake.read, clock=lambda: fake.now)
    got = await asyncio.gather(*(apps.get(REF, None, NARROW, _dial) for _ in range(8)))
    assert len({m.value for m in got}) == 1 and len(fake.minted) == 1


async def test_unusable_key_is_secret_unavailable(fake):
    async def read(ref: SecretRef) -> tuple[Any, int | None]:
        return {"private_key": "-----BEGIN PRIVATE KEY-----\nnot a key\n"}, 1

    apps = GitHubApps(read, clock=lambda: fake.now)
    with pytest.raises(SecretError, match="cannot sign an RS256 JWT"):
        await apps.get(REF, None, None, _dial)
    assert fake.minted == []


class ShortLived(Fake):
    """GitHub answering tokens that expire `life` seconds after the (fake) wall clock's now."""

    def __init__(self, life: float) -> None:
        super().__init__()
        self.life = life

    async def call(self, method: str, url: str, address: Any, ctx: Any, timeout: float,
                   headers: dict[str, str], body: bytes | None, what: str) -> tuple[int, bytes]:
        self.minted.append({"url": url, "body": body})
        when = dt.datetime.fromtimestamp(WALL + self.now + self.life, dt.UTC)
        return 201, json.dumps({"token": f"tok-{len(self.minted)}",
                                "expires_at": when.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()


WALL = 1_800_000_000.0  # the fake wall clock is WALL + the fake monotonic clock


async def test_a_token_is_never_used_within_five_minutes_of_its_expiry(monkeypatch):
    """docs/credentials.md: cached until five minutes before expires_at (not half the life)."""
    f = ShortLived(303)
    monkeypatch.setattr(github_app, "call", f.call)
    apps = GitHubApps(f.read, clock=lambda: f.now, wall=lambda: WALL + f.now)
    first = await apps.get(REF, None, None, _dial)
    f.now += 2.5  # 300.5 s left: still outside the margin
    assert (await apps.get(REF, None, None, _dial)).value == first.value
    f.now += 2.0  # 298.5 s left: inside it; a fresh token is minted
    again = await apps.get(REF, None, None, _dial)
    assert again.value != first.value and len(f.minted) == 2

    hour = ShortLived(3600)
    monkeypatch.setattr(github_app, "call", hour.call)
    apps = GitHubApps(hour.read, clock=lambda: hour.now, wall=lambda: WALL + hour.now)
    token = await apps.get(REF, None, None, _dial)
    hour.now += 3600 - 300 - 0.5  # an hour's token is used for 55 minutes
    assert (await apps.get(REF, None, None, _dial)).value == token.value
    hour.now += 1.0
    assert (await apps.get(REF, None, None, _dial)).value != token.value


async def test_a_token_minted_inside_the_margin_is_refused(monkeypatch):
    f = ShortLived(299)
    monkeypatch.setattr(github_app, "call", f.call)
    apps = GitHubApps(f.read, clock=lambda: f.now, wall=lambda: WALL + f.now)
    with pytest.raises(SecretError, match="within the 300s margin") as e:
        await apps.get(REF, None, None, _dial)
    assert "tok-" not in str(e.value)
