"""Test support for the secrets layer: real OpenBao dev servers, a silent "Vault", SecretRefs.

Fixture builders return a pytest fixture; bind it to a name in a test module or conftest:

    from tests.support.bao import dev_vault_fixture, dev_vaults_fixture

    vault = dev_vault_fixture(scope="module", seed=lambda v: v.put_kv2("a/b", {"k": "v"}))
    dev_vaults = dev_vaults_fixture()      # factory: dev_vaults() -> a started DevVault

    def test_x(vault, dev_vaults): ...

Every DevVault started through these is stopped at fixture teardown (and at interpreter exit).
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sandgate.policy.model import SecretRef, Source
from sandgate.secrets.devserver import DevVault


class SeedableVault(DevVault):
    """A dev server with the admin calls tests need to set up mounts, policies and AppRole."""

    def enable_kv1(self, mount: str = "kv") -> None:
        c = self.client()
        if f"{mount.strip('/')}/" in c.sys.list_mounted_secrets_engines()["data"]:
            return
        c.sys.enable_secrets_engine("kv", path=mount, options={"version": "1"})

    def put_kv1(self, path: str, data: dict[str, Any], mount: str = "kv") -> None:
        self.client().secrets.kv.v1.create_or_update_secret(path=path, secret=data,
                                                            mount_point=mount)

    def create_policy(self, name: str, policy_hcl: str) -> None:
        self.client().sys.create_or_update_policy(name=name, policy=policy_hcl)

    def create_approle(self, role: str, policy_hcl: str, *, token_ttl: str | None = None,
                       token_max_ttl: str | None = None) -> tuple[str, str]:
        """Enable AppRole if needed, create `role` with a policy of the same name.

        Returns (role_id, secret_id).
        """
        c = self.client()
        if "approle/" not in c.sys.list_auth_methods()["data"]:
            c.sys.enable_auth_method("approle")
        c.sys.create_or_update_policy(name=role, policy=policy_hcl)
        c.auth.approle.create_or_update_approle(role_name=role, token_policies=[role],
                                                token_ttl=token_ttl, token_max_ttl=token_max_ttl)
        role_id = c.auth.approle.read_role_id(role_name=role)["data"]["role_id"]
        secret_id = c.auth.approle.generate_secret_id(role_name=role)["data"]["secret_id"]
        return str(role_id), str(secret_id)

    def create_token(self, policies: list[str], ttl: str, *, renewable: bool = False) -> str:
        """A child token of root with `policies` (plus `default`).

        Not renewable unless asked: a token created with ttl="2s" really expires after 2 s even
        while a SecretBroker's renewal task is running.
        """
        resp = self.client().auth.token.create(policies=policies, ttl=ttl, renewable=renewable)
        return str(resp["auth"]["client_token"])


Seed = Callable[[SeedableVault], None]


def start_dev_vault(seed: Seed | None = None, **kwargs: Any) -> SeedableVault:
    v = SeedableVault(**kwargs)
    v.start()
    try:
        if seed is not None:
            seed(v)
    except BaseException:
        v.stop()
        raise
    return v


def dev_vault_fixture(*, scope: str = "function", seed: Seed | None = None) -> Any:
    """A fixture yielding one started, optionally seeded DevVault; stopped at teardown."""

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def _dev_vault() -> Iterator[DevVault]:
        v = start_dev_vault(seed)
        try:
            yield v
        finally:
            v.stop()

    return _dev_vault


def dev_vaults_fixture(*, scope: str = "function") -> Any:
    """A factory fixture: call it (optionally with seed=..., port=..., root_token=...) to get a
    started DevVault; all of them are stopped at teardown."""

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def _dev_vaults() -> Iterator[Callable[..., DevVault]]:
        started: list[DevVault] = []

        def make(seed: Seed | None = None, **kwargs: Any) -> DevVault:
            v = start_dev_vault(seed, **kwargs)
            started.append(v)
            return v

        try:
            yield make
        finally:
            for v in started:
                v.stop()

    return _dev_vaults


@contextmanager
def silent_server() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers: a hung Vault.

    Yields its http:// address.
    """
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(100)
    srv.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, name="silent-vault", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        srv.close()
        for c in held:
            c.close()


def secret_ref(name: str, path: str, field: str = "api_key", *, mount: str = "secret",
               kv_version: int = 2, placeholder: str | None = None) -> SecretRef:
    return SecretRef(name=name, mount=mount, path=path, field=field,
                     kv_version=kv_version,  # type: ignore[arg-type]
                     placeholder=placeholder or f"sandgate-placeholder-{name}",
                     source=Source("test", 1))


def fingerprint(value: str) -> str:
    """A short hash to name a value in assertion messages without showing it."""
    return hashlib.sha256(value.encode()).hexdigest()[:12]
