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

from proxy.policy.model import SecretRef, Source
from proxy.secrets.devserver import DevVault

Seed = Callable[[DevVault], None]


def start_dev_vault(seed: Seed | None = None, **kwargs: Any) -> DevVault:
    v = DevVault(**kwargs)
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
