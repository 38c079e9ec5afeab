"""mitm/speedups/sharedport.py: in a worker, mitmproxy's listeners bind with SO_REUSEPORT."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from mitmproxy.proxy import mode_servers

from sandgate.mitm.speedups import sharedport
from sandgate.workers import listen

CLASSES = (mode_servers.RegularInstance, mode_servers.Socks5Instance,
           mode_servers.ReverseInstance, mode_servers.TransparentInstance)


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """mitmproxy's own listen() on every class, restored after the test (install() patches
    classes for the whole process)."""
    for cls in CLASSES:
        monkeypatch.setattr(cls, "listen", mode_servers.AsyncioServerInstance.listen)
        monkeypatch.setattr(cls, sharedport._MARK, False, raising=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _listen_twice(spec: str, port: int) -> list[Any]:
    """Two instances of one mode listening on one port, as two workers would."""
    servers: list[Any] = []
    for _ in range(2):
        inst = mode_servers.ServerInstance.make(spec, manager=None)  # type: ignore[arg-type]
        servers += await inst.listen("127.0.0.1", port)
    return servers


async def test_workers_listen_on_one_port(unpatched: None) -> None:
    assert not sharedport.installed()
    sharedport.install()
    sharedport.install()  # idempotent
    assert sharedport.installed()
    for spec in ("regular", "socks5", "reverse:https://example.com"):
        port = _free_port()
        reserved = listen.reserve("127.0.0.1", port)  # the supervisor's bind, first
        servers = await _listen_twice(spec, port)
        try:
            assert len(servers) == 2, spec
            for s in servers:
                assert s.sockets[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT), spec
        finally:
            for s in servers:
                s.close()
            reserved.close()


async def test_without_it_a_second_listener_fails(unpatched: None) -> None:
    """What the patch is for: mitmproxy's own listen() cannot share a port."""
    port = _free_port()
    with pytest.raises(OSError):
        servers = await _listen_twice("regular", port)
        for s in servers:
            s.close()
