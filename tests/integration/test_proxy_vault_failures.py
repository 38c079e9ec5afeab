"""Vault down, slow, token expired, secret missing: a clear 503 and nothing forwarded."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.bao import SeedableVault
from tests.support.proxy_stack import refusal_doc
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration


@pytest.fixture
def own_vault():
    v = SeedableVault()
    v.start()
    v.put_kv2("llm/anthropic", {"api_key": ANTHROPIC_KEY})
    yield v
    v.stop()


def _llm(proxy):
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    return split_status(r.stdout)


def test_vault_down_before_first_use(tmp_path, own_vault, upstream, pki):
    p = start_proxy(tmp_path, HERE / "policies",
                    {"VAULT_ADDR": own_vault.addr, "VAULT_TOKEN": own_vault.root_token}, pki)
    try:
        own_vault.stop()
        before = len(upstream.seen)
        body, status = _llm(p)
        assert status == 503
        doc = refusal_doc(body)
        assert doc["code"] == "secret_unavailable"
        assert "anthropic" in doc["reason"]
        assert len(upstream.seen) == before
    finally:
        stop_proxy(p)
    assert_no_secret([p.logs()], [ANTHROPIC_KEY], "the proxy logs")


def test_vault_down_after_cache_serves_until_ttl(tmp_path, own_vault, upstream, pki):
    p = start_proxy(tmp_path, HERE / "policies",
                    {"VAULT_ADDR": own_vault.addr, "VAULT_TOKEN": own_vault.root_token}, pki,
                    "--secret-ttl", "3")
    try:
        assert _llm(p)[1] == 200
        own_vault.stop()
        assert _llm(p)[1] == 200  # cached value still valid
        time.sleep(3.5)
        before = len(upstream.seen)
        assert _llm(p)[1] == 503  # expired and Vault is down: fail closed
        assert len(upstream.seen) == before
    finally:
        stop_proxy(p)


def test_vault_slow_gives_503_not_a_hang(tmp_path, upstream, pki):
    # A Vault that accepts connections and never answers.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(50)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    addr = f"http://127.0.0.1:{srv.getsockname()[1]}"
    p = start_proxy(tmp_path, HERE / "policies", {"VAULT_ADDR": addr, "VAULT_TOKEN": "x"}, pki)
    try:
        before = len(upstream.seen)
        t0 = time.monotonic()
        body, status = _llm(p)
        assert status == 503
        assert time.monotonic() - t0 < 14
        assert "timed out" in refusal_doc(body)["reason"]
        assert len(upstream.seen) == before
        # other requests are not blocked behind the slow Vault
        r = curl(p, "bash-tool", "https://upstream.test/docs/x")
        assert split_status(r.stdout)[1] == 200
    finally:
        stop_proxy(p)
        stop.set()
        srv.close()


def test_vault_token_expired(tmp_path, own_vault, upstream, pki):
    own_vault.client().sys.create_or_update_policy(
        "read-llm", 'path "secret/data/llm/*" { capabilities = ["read"] }')
    token = own_vault.create_token(["read-llm"], ttl="2s")
    p = start_proxy(tmp_path, HERE / "policies",
                    {"VAULT_ADDR": own_vault.addr, "VAULT_TOKEN": token}, pki)
    try:
        time.sleep(3)
        before = len(upstream.seen)
        body, status = _llm(p)
        assert status == 503
        reason = refusal_doc(body)["reason"].lower()
        assert "token" in reason or "permission" in reason or "denied" in reason
        assert len(upstream.seen) == before
    finally:
        stop_proxy(p)


def test_approle_login(tmp_path, own_vault, upstream, pki):
    role_id, secret_id = own_vault.create_approle(
        "sandgate", 'path "secret/data/llm/*" { capabilities = ["read"] }')
    p = start_proxy(tmp_path, HERE / "policies",
                    {"VAULT_ADDR": own_vault.addr, "VAULT_ROLE_ID": role_id,
                     "VAULT_SECRET_ID": secret_id}, pki)
    try:
        before = len(upstream.seen)
        assert _llm(p)[1] == 200
        assert_secret_equal(upstream.seen[before].headers.get("x-api-key"), ANTHROPIC_KEY,
                            "upstream x-api-key")
    finally:
        stop_proxy(p)
    assert_no_secret([p.logs()], [secret_id], "the proxy logs")
