"""Unit tests of the secret broker that need no Vault: config, reprs, validation, caching logic.

Cache and single-flight behaviour is exercised by replacing the broker's `_read` step (the one
Vault read), not hvac; the real thing is in tests/integration/test_vault.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hvac.exceptions
import pytest
import requests

from sandgate.errors import Code
from sandgate.secrets.values import check_value
from sandgate.secrets.vault import (
    SecretBroker,
    SecretError,
    SecretValue,
    VaultConfig,
    _classify,
)
from tests.support.bao import fingerprint, secret_ref

VALUE = "unit-fake-value-3e8a1f"
OTHER = "unit-fake-other-9b7c2d"


def same(a: str, b: str) -> bool:
    return fingerprint(a) == fingerprint(b)


# ---------------------------------------------------------------------------- VaultConfig


def test_from_env_token():
    c = VaultConfig.from_env({"VAULT_ADDR": "https://vault:8200", "VAULT_TOKEN": "t0k",
                              "VAULT_CACERT": "/ca.pem", "VAULT_NAMESPACE": "team"})
    assert (c.addr, c.token, c.role_id, c.cacert, c.namespace) == (
        "https://vault:8200", "t0k", None, "/ca.pem", "team")
    assert c.timeout == 5.0
    assert "t0k" not in repr(c)


def test_from_env_approle():
    c = VaultConfig.from_env({"VAULT_ADDR": "http://v", "VAULT_ROLE_ID": "r",
                              "VAULT_SECRET_ID": "s-secret"})
    assert c.role_id == "r" and c.secret_id == "s-secret" and c.token is None
    assert "s-secret" not in repr(c)


def test_from_env_approle_wins_over_token():
    c = VaultConfig.from_env({"VAULT_ADDR": "http://v", "VAULT_TOKEN": "t", "VAULT_ROLE_ID": "r",
                              "VAULT_SECRET_ID": "s"})
    assert c.role_id == "r" and c.token is None


@pytest.mark.parametrize("spec, seconds", [("2", 2.0), ("0.5s", 0.5), (" 30s ", 30.0)])
def test_from_env_client_timeout(spec, seconds):
    c = VaultConfig.from_env({"VAULT_ADDR": "http://v", "VAULT_TOKEN": "t",
                              "VAULT_CLIENT_TIMEOUT": spec})
    assert c.timeout == seconds


@pytest.mark.parametrize("env, words", [
    ({"VAULT_ADDR": "http://v", "VAULT_TOKEN": "t", "VAULT_CLIENT_TIMEOUT": "0"},
     ["VAULT_CLIENT_TIMEOUT", "seconds"]),
    ({"VAULT_ADDR": "http://v", "VAULT_TOKEN": "t", "VAULT_CLIENT_TIMEOUT": "1m"},
     ["VAULT_CLIENT_TIMEOUT", "seconds"]),
    ({"VAULT_ADDR": "http://v"}, ["VAULT_TOKEN", "VAULT_ROLE_ID"]),
    ({"VAULT_ADDR": "http://v", "VAULT_ROLE_ID": "r"}, ["VAULT_SECRET_ID"]),
    ({"VAULT_ADDR": "http://v", "VAULT_SECRET_ID": "s"}, ["VAULT_ROLE_ID"]),
    ({}, ["VAULT_ADDR"]),
])
def test_from_env_errors(env, words):
    with pytest.raises(ValueError) as ei:
        VaultConfig.from_env(env)
    assert all(w in str(ei.value) for w in words)


# ---------------------------------------------------------------------------- values, errors


def test_secret_value_repr_hides_value():
    sv = SecretValue("anthropic", VALUE, 3)
    assert VALUE not in repr(sv) and VALUE not in str(sv)
    assert "anthropic" in repr(sv) and "3" in repr(sv)


def test_secret_error_fields():
    e = SecretError("anthropic", "secret 'anthropic' unavailable: Vault timed out")
    assert e.code is Code.SECRET_UNAVAILABLE
    assert e.secret == "anthropic"
    assert str(e) == "secret 'anthropic' unavailable: Vault timed out"


@pytest.mark.parametrize("value, words", [
    (VALUE + "\n", "control characters"),
    ("a\rb", "control characters"),
    ("a\0b", "control characters"),
    (42, "not a string"),
    (None, "not a string"),
    ("", "empty"),
], ids=["lf", "cr", "nul", "int", "none", "empty"])  # ids: never put a value in a test id
def test_check_value_refuses(value, words):
    with pytest.raises(SecretError) as ei:
        check_value("s", value)
    assert words in str(ei.value)
    assert VALUE not in str(ei.value)


def test_check_value_accepts():
    assert same(check_value("s", VALUE), VALUE)


@pytest.mark.parametrize("exc, kind, words", [
    (hvac.exceptions.Forbidden(VALUE, text=VALUE), "denied", "permission denied"),
    (hvac.exceptions.InvalidPath(VALUE, text=VALUE), "notfound", "404"),
    (hvac.exceptions.VaultDown(VALUE, text=VALUE), "server", "sealed"),
    (hvac.exceptions.InternalServerError(VALUE, text=VALUE), "server", "5xx"),
    (requests.exceptions.ConnectionError(f"[Errno 111] Connection refused {VALUE}"),
     "unreachable", "connection refused"),
    (requests.exceptions.ReadTimeout(VALUE), "timeout", "timed out"),
    (requests.exceptions.ConnectTimeout(VALUE), "timeout", "timed out"),
    (RuntimeError(VALUE), "other", "RuntimeError"),
], ids=["403", "404", "503", "500", "refused", "read-timeout", "connect-timeout", "other"])
def test_classify_never_echoes_exception_text(exc, kind, words):
    f = _classify(exc)
    assert f.kind == kind
    assert words in f.detail
    assert VALUE not in f.detail and VALUE not in str(f)


# ---------------------------------------------------------------------------- broker logic


class FakeReadBroker(SecretBroker):
    """Replaces the single Vault read with an in-memory table; counts reads like the real one."""

    def __init__(self, table: dict[str, Any], **kw: Any) -> None:
        refs = {n: secret_ref(n, f"p/{n}") for n in ("a", "b")}
        super().__init__(VaultConfig(addr="http://127.0.0.1:9", token="t"), refs, **kw)
        self.table = table
        self.delay = 0.05
        self.now = 1000.0
        self._clock = lambda: self.now

    async def _read(self, ref):  # type: ignore[override]
        self.vault_reads += 1
        await asyncio.sleep(self.delay)
        v = self.table[ref.path]
        if isinstance(v, BaseException):
            raise v
        return {"api_key": v}, 7


async def test_single_flight_and_ttl():
    b = FakeReadBroker({"p/a": VALUE}, ttl=10)
    try:
        res = await asyncio.gather(*(b.get("a") for _ in range(20)))
        assert b.vault_reads == 1
        assert all(same(r.value, VALUE) for r in res)
        b.now += 9
        await b.get("a")
        assert b.vault_reads == 1
        b.now += 2  # expired: read again
        b.table["p/a"] = OTHER
        assert same((await b.get("a")).value, OTHER)
        assert b.vault_reads == 2
    finally:
        await b.aclose()


async def test_expired_value_not_served_but_kept_for_scrubbing():
    from sandgate.secrets.vault import _VaultFailure

    b = FakeReadBroker({"p/a": VALUE}, ttl=10)
    try:
        await b.get("a")
        b.now += 11
        b.table["p/a"] = _VaultFailure("unreachable", "Vault is unreachable (connection refused)")
        with pytest.raises(SecretError) as ei:
            await b.get("a")
        assert "connection refused" in str(ei.value)
        assert same(b.cached_values()["a"], VALUE)
    finally:
        await b.aclose()


async def test_cancelled_waiter_does_not_cancel_shared_read():
    b = FakeReadBroker({"p/a": VALUE}, ttl=10)
    b.delay = 0.2
    try:
        first = asyncio.create_task(b.get("a"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(b.get("a"))
        await asyncio.sleep(0.01)
        first.cancel()
        sv = await second
        assert same(sv.value, VALUE)
        assert b.vault_reads == 1
    finally:
        await b.aclose()


async def test_policy_reload_during_read_does_not_cache_stale_location():
    b = FakeReadBroker({"p/a": VALUE, "p/other": OTHER}, ttl=10)
    b.delay = 0.1
    try:
        pending = asyncio.create_task(b.get("a"))
        await asyncio.sleep(0.02)
        b.update_secrets({"a": secret_ref("a", "p/other")})
        await pending  # the caller that asked before the reload gets its answer
        assert "a" not in b.cached_values()  # but it is not cached under the new location
        assert same((await b.get("a")).value, OTHER)
    finally:
        await b.aclose()


async def test_unknown_secret():
    b = FakeReadBroker({})
    try:
        with pytest.raises(SecretError) as ei:
            await b.get("zzz")
        assert "'zzz'" in str(ei.value) and "not defined" in str(ei.value)
        assert b.vault_reads == 0
    finally:
        await b.aclose()


async def test_closed_broker_refuses():
    b = FakeReadBroker({"p/a": VALUE})
    await b.aclose()
    assert b.cached_values() == {}
    b2 = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="t"),
                      {"a": secret_ref("a", "p/a")})
    await b2.aclose()
    with pytest.raises(SecretError) as ei:
        await b2.get("a")
    assert "closed" in str(ei.value)
