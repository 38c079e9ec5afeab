"""SecretBroker against a real OpenBao dev server (no mocks of hvac).

Secret values never appear in assertion output: values are compared through `fingerprint()` and
leak checks return fingerprints, never the values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import pytest

from sandgate.errors import Code, SecretError
from sandgate.secrets.devserver import DevVault
from sandgate.secrets.vault import SecretBroker, VaultConfig
from tests.support.bao import (
    dev_vault_fixture,
    dev_vaults_fixture,
    fingerprint,
    secret_ref,
    silent_server,
)

pytestmark = pytest.mark.integration

ANTHROPIC_V1 = "itest-anthropic-old-4b1d9e"
ANTHROPIC = "itest-anthropic-value-8c2f7a"
OPENAI = "itest-openai-value-5e9d01"
GITHUB = "itest-github-kv1-value-a17c3b"
NEWLINE = "itest-evil-value\r\nX-Injected: 1"
NOFIELD = "itest-nofield-value-77e2"
VALUES = (ANTHROPIC_V1, ANTHROPIC, OPENAI, GITHUB, NEWLINE, NOFIELD, "itest-evil-value")

READ_LLM = 'path "secret/data/llm/*" { capabilities = ["read"] }'

REFS = {
    "anthropic": secret_ref("anthropic", "llm/anthropic"),
    "openai": secret_ref("openai", "llm/openai"),
    "github": secret_ref("github", "ci/github", "token", mount="kv", kv_version=1),
    "missing": secret_ref("missing", "llm/nothing-here"),
    "nofield": secret_ref("nofield", "llm/nofield"),
    "newline": secret_ref("newline", "llm/newline"),
    "notstring": secret_ref("notstring", "llm/notstring"),
    "forbidden": secret_ref("forbidden", "other/thing"),
}


def seed(v: DevVault) -> None:
    v.put_kv2("llm/anthropic", {"api_key": ANTHROPIC_V1})
    v.put_kv2("llm/anthropic", {"api_key": ANTHROPIC})  # version 2
    v.put_kv2("llm/openai", {"api_key": OPENAI})
    v.put_kv2("llm/nofield", {"other": NOFIELD})
    v.put_kv2("llm/newline", {"api_key": NEWLINE})
    v.put_kv2("llm/notstring", {"api_key": 12345})
    v.put_kv2("other/thing", {"api_key": "itest-other"})
    v.enable_kv1("kv")
    v.put_kv1("ci/github", {"token": GITHUB})


bao = dev_vault_fixture(scope="module", seed=seed)
dev_vaults = dev_vaults_fixture()


def leaks(text: str, values: Iterable[str] = VALUES) -> list[str]:
    """Fingerprints of the values found in `text` (never the values themselves)."""
    return [fingerprint(v) for v in values if v in text]


def same(a: str, b: str) -> bool:
    return fingerprint(a) == fingerprint(b)


@pytest.fixture
async def brokers() -> AsyncIterator[Callable[..., SecretBroker]]:
    made: list[SecretBroker] = []

    def make(addr: str, *, token: str | None = None, role_id: str | None = None,
             secret_id: str | None = None, timeout: float = 2.0, ttl: float = 300.0,
             secrets: dict[str, Any] | None = None, **kw: Any) -> SecretBroker:
        cfg = VaultConfig(addr=addr, token=token, role_id=role_id, secret_id=secret_id,
                          cacert=None, namespace=None, timeout=timeout)
        b = SecretBroker(cfg, REFS if secrets is None else secrets, ttl=ttl, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        async with asyncio.timeout(5):  # aclose() must not hang, whatever the renewal task does
            await b.aclose()


@pytest.fixture(autouse=True)
def _vault_logs(caplog: pytest.LogCaptureFixture):
    """Every test: capture sandgate.vault at DEBUG and check no value reached a log record."""
    caplog.set_level(logging.DEBUG, logger="sandgate.vault")
    yield
    found = leaks(caplog.text)
    assert not found, f"secret value(s) {found} appeared in logs"


async def test_kv2_read_with_version(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    await b.start()
    sv = await b.get("anthropic")
    assert same(sv.value, ANTHROPIC), "value mismatch"
    assert sv.version == 2
    assert sv.name == "anthropic"
    assert not leaks(repr(sv))
    assert b.vault_reads == 1
    assert same(b.cached_values()["anthropic"], ANTHROPIC)


async def test_kv1_read(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    sv = await b.get("github")
    assert same(sv.value, GITHUB), "value mismatch"
    assert sv.version is None


async def test_token_auth_with_policy(bao, brokers):
    bao.create_policy("read-llm", READ_LLM)
    token = bao.create_token(["read-llm"], ttl="1h")
    b = brokers(bao.addr, token=token)
    await b.start()
    assert same((await b.get("openai")).value, OPENAI), "value mismatch"
    with pytest.raises(SecretError) as ei:
        await b.get("forbidden")
    msg = str(ei.value)
    assert "forbidden" in msg and "permission denied" in msg and "other/thing" in msg


async def test_approle_login_and_read(bao, brokers):
    role_id, secret_id = bao.create_approle("sandgate-test", READ_LLM)
    b = brokers(bao.addr, role_id=role_id, secret_id=secret_id)
    await b.start()
    assert b.logins == 1
    sv = await b.get("anthropic")
    assert same(sv.value, ANTHROPIC), "value mismatch"
    assert sv.version == 2


async def test_approle_relogin_once_on_403(bao, brokers):
    role_id, secret_id = bao.create_approle("sandgate-relogin", READ_LLM)
    b = brokers(bao.addr, role_id=role_id, secret_id=secret_id)
    await b.start()
    assert b.logins == 1
    bao.client().auth.token.revoke(b._client.token)  # the broker's token dies under it
    sv = await b.get("openai")
    assert same(sv.value, OPENAI), "value mismatch"
    assert b.logins == 2
    assert b.vault_reads == 2  # the denied read and the retry


async def test_approle_bad_secret_id(bao, brokers):
    role_id, _ = bao.create_approle("sandgate-bad", READ_LLM)
    b = brokers(bao.addr, role_id=role_id, secret_id="not-the-secret-id")
    with pytest.raises(SecretError) as ei:
        await b.start()
    assert "AppRole" in str(ei.value) and "secret_id" in str(ei.value)
    assert "not-the-secret-id" not in str(ei.value)
    with pytest.raises(SecretError):  # get() retries the login and fails closed
        await b.get("anthropic")


async def test_missing_path(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    with pytest.raises(SecretError) as ei:
        await b.get("missing")
    e = ei.value
    assert e.secret == "missing" and e.code is Code.SECRET_UNAVAILABLE
    assert "'missing'" in str(e) and "not found" in str(e) and "llm/nothing-here" in str(e)


async def test_field_missing(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    with pytest.raises(SecretError) as ei:
        await b.get("nofield")
    assert "field 'api_key' missing" in str(ei.value)
    assert not leaks(str(ei.value)) and not leaks(repr(ei.value))
    assert "nofield" not in b.cached_values()


async def test_value_with_newline_refused(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    with pytest.raises(SecretError) as ei:
        await b.get("newline")
    assert "control characters" in str(ei.value)
    assert not leaks(str(ei.value)) and not leaks(repr(ei.value))
    assert "newline" not in b.cached_values()


async def test_value_not_a_string(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    with pytest.raises(SecretError) as ei:
        await b.get("notstring")
    assert "not a string" in str(ei.value)
    assert "12345" not in str(ei.value)


async def test_vault_down_empty_cache_fails_fast(dev_vaults, brokers):
    v = dev_vaults(seed)
    b = brokers(v.addr, token=v.root_token)
    v.stop()
    t0 = time.monotonic()
    with pytest.raises(SecretError) as ei:
        await b.get("anthropic")
    assert time.monotonic() - t0 < 1.5
    assert "connection refused" in str(ei.value) and "anthropic" in str(ei.value)


async def test_vault_down_cache_served_until_ttl(dev_vaults, brokers):
    v = dev_vaults(seed)
    b = brokers(v.addr, token=v.root_token, ttl=1.0)
    first = await b.get("anthropic")
    v.stop()
    again = await b.get("anthropic")  # within TTL: no Vault contact
    assert same(again.value, first.value), "value mismatch"
    assert b.vault_reads == 1
    await asyncio.sleep(1.1)
    with pytest.raises(SecretError) as ei:  # expired and Vault down: no stale serving
        await b.get("anthropic")
    assert "connection refused" in str(ei.value)
    assert b.vault_reads == 2
    # still known for scrubbing / exfiltration checks
    assert same(b.cached_values()["anthropic"], ANTHROPIC)


async def test_single_flight(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    results = await asyncio.gather(*(b.get("openai") for _ in range(50)))
    assert b.vault_reads == 1
    assert all(same(r.value, OPENAI) for r in results), "value mismatch"
    await b.get("openai")
    assert b.vault_reads == 1  # cached


async def test_single_flight_failure_not_cached(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    results = await asyncio.gather(*(b.get("missing") for _ in range(50)),
                                   return_exceptions=True)
    assert all(isinstance(r, SecretError) for r in results)
    assert b.vault_reads == 1
    with pytest.raises(SecretError):
        await b.get("missing")
    assert b.vault_reads == 2  # failures are retried, not cached


async def test_slow_vault_times_out_without_blocking_loop(brokers):
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    with silent_server() as addr:
        b = brokers(addr, token="irrelevant", timeout=1.0)
        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        try:
            with pytest.raises(SecretError) as ei:
                await b.get("anthropic")
        finally:
            t.cancel()
        elapsed = time.monotonic() - t0
    assert "timed out" in str(ei.value)
    assert 0.8 < elapsed < 3.5
    assert ticks >= int(elapsed / 0.05 * 0.5), "the event loop was blocked"


async def test_token_expired(bao, brokers):
    bao.create_policy("read-llm", READ_LLM)
    token = bao.create_token(["read-llm"], ttl="2s")
    b = brokers(bao.addr, token=token, renew_interval=0.5)
    await b.start()
    await asyncio.sleep(2.5)
    with pytest.raises(SecretError) as ei:
        await b.get("anthropic")
    msg = str(ei.value).lower()
    assert "token" in msg and "permission" in msg


async def test_renewable_token_is_renewed(bao, brokers):
    bao.create_policy("read-llm", READ_LLM)
    token = bao.create_token(["read-llm"], ttl="3s", renewable=True)
    b = brokers(bao.addr, token=token, renew_interval=0.5)
    await b.start()
    await asyncio.sleep(4.0)
    sv = await b.get("anthropic")  # would be 403 had the renewal task not renewed it
    assert same(sv.value, ANTHROPIC), "value mismatch"


async def test_update_secrets_drops_changed_refs(bao, brokers):
    b = brokers(bao.addr, token=bao.root_token)
    await b.get("anthropic")
    await b.get("openai")
    assert set(b.cached_values()) == {"anthropic", "openai"}
    refs = dict(REFS)
    refs["anthropic"] = secret_ref("anthropic", "llm/openai")  # now points elsewhere
    refs["openai"] = secret_ref("openai", "llm/openai", placeholder="new-placeholder")
    b.update_secrets(refs)
    assert set(b.cached_values()) == {"openai"}  # placeholder change keeps the cache
    sv = await b.get("anthropic")
    assert same(sv.value, OPENAI), "value mismatch"
    assert b.vault_reads == 3
    del refs["openai"]
    b.update_secrets(refs)
    assert "openai" not in b.cached_values()
    with pytest.raises(SecretError) as ei:
        await b.get("openai")
    assert "not defined" in str(ei.value)


async def test_no_values_in_errors_reprs_or_logs(bao, brokers, caplog):
    b = brokers(bao.addr, token=bao.root_token)
    texts: list[str] = []
    for name in REFS:
        try:
            sv = await b.get(name)
            texts += [repr(sv), str(sv)]
        except SecretError as e:
            texts += [str(e), repr(e), str(e.args)]
    texts.append(repr(b.config))
    assert not leaks("\n".join(texts)), "a value leaked into an error or repr"
    assert bao.root_token not in repr(b.config) and bao.root_token not in caplog.text


async def test_approle_token_past_max_ttl_relogs_in(bao, brokers):
    role_id, secret_id = bao.create_approle("sandgate-short", READ_LLM, token_ttl="2s",
                                            token_max_ttl="3s")
    b = brokers(bao.addr, role_id=role_id, secret_id=secret_id, renew_interval=0.5)
    await b.start()
    await asyncio.sleep(4.0)  # past the first token's max TTL
    assert b.logins >= 2, "the renewal task did not log in again"
    sv = await b.get("openai")
    assert same(sv.value, OPENAI), "value mismatch"
    assert b.vault_reads == 1  # served by the fresh token, no 403 retry needed
