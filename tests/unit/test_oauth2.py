"""OAuth 2.0 tokens (sandgate.secrets.oauth2) with the token endpoint and Vault faked: parsing
the answer, caching to near expiry, single flight, rotation written back with check-and-set,
and failures that never carry a token. tests/integration/test_creds_oauth2.py runs the same
against Authlib's authorization server, OpenBao and `sandgate run`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sandgate.errors import Code, SecretError
from sandgate.policy.model import OAuth2Ref, SecretRef, Source
from sandgate.secrets import oauth2
from sandgate.secrets.oauth2 import OAuth2Tokens, answer, parse_token
from sandgate.secrets.tokenhttp import TokenFailure

pytestmark = pytest.mark.unit

TOKEN = "test-minted-ACCESS-token-1"
RT0, RT1 = "test-refresh-ZERO-0001", "test-refresh-ONE-0002"


def ref(grant: str = "refresh_token") -> SecretRef:
    return SecretRef(name="crm", mount="secret", path="oauth/crm", field="client_id",
                     kv_version=2, placeholder="sandgate-placeholder-crm",
                     source=Source("p.yaml", 1),
                     oauth2=OAuth2Ref("https://auth.example/token", grant))  # type: ignore[arg-type]


@pytest.mark.parametrize(("doc", "why"), [
    ({}, "no usable access_token"),
    ({"access_token": "", "token_type": "bearer", "expires_in": 60}, "access_token"),
    ({"access_token": "a b", "token_type": "bearer", "expires_in": 60}, "access_token"),
    ({"access_token": "x\r\nset-cookie: y", "token_type": "Bearer", "expires_in": 60},
     "access_token"),
    ({"access_token": "t", "token_type": "mac", "expires_in": 60}, "not a bearer"),
    ({"access_token": "t", "token_type": "Bearer"}, "expires_in"),
    ({"access_token": "t", "token_type": "Bearer", "expires_in": 0}, "expires_in"),
    ({"access_token": "t", "token_type": "Bearer", "expires_in": True}, "expires_in"),
    ({"access_token": "t", "token_type": "Bearer", "expires_in": "soon"}, "expires_in"),
])
def test_malformed_token_answer_refused(doc, why):
    with pytest.raises(TokenFailure, match=why) as ei:
        parse_token(doc)
    assert "x\r\n" not in str(ei.value)


def test_token_answer_parsed():
    assert parse_token({"access_token": "t", "token_type": "Bearer", "expires_in": "90"}) == (
        "t", 90)


@pytest.mark.parametrize(("status", "body", "said"), [
    (400, b'{"error": "invalid_grant"}', "answered 400 invalid_grant"),
    (401, b'{"error": "invalid_client", "error_description": "x"}', "401 invalid_client"),
    (400, json.dumps({"error": 'bad "' + TOKEN + '"'}).encode(), "answered 400"),  # not echoed
    (503, b"<html>down</html>", "answered 503"),
    (200, b"[1]", "not a JSON object"),
    (200, b"not json", "not a JSON object"),
])
def test_error_answers_name_the_code_only(status, body, said):
    with pytest.raises(TokenFailure) as ei:
        answer(status, body)
    assert str(ei.value).endswith(said) or said in str(ei.value)
    assert TOKEN not in str(ei.value)


class Fake:
    def __init__(self, expires_in: int = 100, rotate: bool = True) -> None:
        self.record: dict[str, Any] = {"client_id": "c", "client_secret": "test-client-SECRET",
                                       "refresh_token": RT0}
        self.version = 1
        self.calls = 0
        self.expires_in = expires_in
        self.rotate = rotate
        self.now = 1000.0
        self.fail_write = False
        self.gate: asyncio.Event | None = None

    async def read(self, r: SecretRef) -> tuple[Any, int | None]:
        return dict(self.record), self.version

    async def write(self, r: SecretRef, data: dict[str, Any], version: int) -> None:
        if self.fail_write or version != self.version:
            raise SecretError("crm", "check-and-set failed")
        self.record, self.version = data, self.version + 1

    async def request(self, o: Any, record: Any, dial: Any, ctx: Any) -> dict[str, Any]:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        doc = {"access_token": f"{TOKEN}-{self.calls}", "token_type": "Bearer",
               "expires_in": self.expires_in}
        if self.rotate:
            doc["refresh_token"] = f"{RT1}-{self.calls}"
        return doc


async def _dial(url: str) -> tuple[str, int]:
    return "192.0.2.1", 443


@pytest.fixture
def fake(monkeypatch) -> Fake:
    f = Fake()
    monkeypatch.setattr(oauth2, "request_token", f.request)
    return f


async def test_cached_until_near_expiry_then_minted_again(fake):
    toks = OAuth2Tokens(fake.read, fake.write, clock=lambda: fake.now)
    a = await toks.get(ref(), _dial)
    fake.now += 100 - 11  # inside the margin (a tenth of 100s): still cached
    assert (await toks.get(ref(), _dial)).value == a.value and fake.calls == 1
    fake.now += 2  # past expires_in minus the margin
    b = await toks.get(ref(), _dial)
    assert b.value != a.value and fake.calls == 2
    # the retired token is still scrubbed
    assert ("crm", a.value) in toks.values() and ("crm", b.value) in toks.values()


async def test_single_flight(fake):
    fake.gate = asyncio.Event()
    toks = OAuth2Tokens(fake.read, fake.write, clock=lambda: fake.now)
    waiters = [asyncio.create_task(toks.get(ref(), _dial)) for _ in range(10)]
    await asyncio.sleep(0)
    fake.gate.set()
    got = await asyncio.gather(*waiters)
    assert fake.calls == 1 and len({t.value for t in got}) == 1


async def test_rotation_written_back_with_check_and_set(fake):
    toks = OAuth2Tokens(fake.read, fake.write, clock=lambda: fake.now)
    t = await toks.get(ref(), _dial)
    assert fake.record["refresh_token"] == f"{RT1}-1" and fake.version == 2
    assert "refresh token rotated" in t.note and t.version == 2
    # the client secret and both refresh tokens are scrubbed too
    held = {v for _, v in toks.values()}
    assert {"test-client-SECRET", RT0, f"{RT1}-1"} <= held


async def test_lost_check_and_set_keeps_the_token(fake):
    fake.fail_write = True
    toks = OAuth2Tokens(fake.read, fake.write, clock=lambda: fake.now)
    t = await toks.get(ref(), _dial)
    assert t.value == f"{TOKEN}-1" and "NOT written back" in t.note
    assert fake.record["refresh_token"] == RT0


async def test_failure_is_secret_unavailable_without_a_token(fake, monkeypatch):
    async def refuse(*a: Any) -> dict[str, Any]:
        raise TokenFailure("the token endpoint answered 400 invalid_grant")

    monkeypatch.setattr(oauth2, "request_token", refuse)
    toks = OAuth2Tokens(fake.read, fake.write, clock=lambda: fake.now)
    with pytest.raises(SecretError) as ei:
        await toks.get(ref(), _dial)
    assert ei.value.code == Code.SECRET_UNAVAILABLE
    assert "invalid_grant" in ei.value.reason and RT0 not in ei.value.reason


def test_describe_names_the_grant_and_endpoint():
    from sandgate.secrets.describe import describe

    assert describe(ref()) == ("oauth2 refresh_token: access token from "
                               "https://auth.example/token (client record secret/oauth/crm), "
                               "minted by Sandgate and cached until near expiry")
