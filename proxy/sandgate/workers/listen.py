"""One proxy port for every worker: SO_REUSEPORT, and how many workers by default.

mitmproxy binds its listeners itself (`RegularInstance.listen`, `Socks5Instance.listen`,
`ReverseInstance.listen` for --gateway:
asyncio.start_server without reuse_port). In a worker those methods are replaced by one that
passes reuse_port=True, so N workers each own a listening socket on the same address and the
kernel hashes each new connection to one of them. An inherited socket would wake every worker
on every connection and leave the spread to whoever wins accept(); with SO_REUSEPORT a worker
that stops (drain, crash) simply leaves the group.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

_MARK = "_sandgate_reuse_port"


def default_workers() -> int:
    """The cores this process may run on (the affinity mask, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


async def _listen(self: Any, host: str, port: int) -> list[asyncio.Server]:
    return [await asyncio.start_server(self.handle_stream, host, port, reuse_port=True)]


def share_port() -> None:
    """Make mitmproxy's listeners Sandgate uses (the HTTP proxy, --socks5, --gateway) bind with
    SO_REUSEPORT (idempotent)."""
    for cls in _shared_classes():
        if not getattr(cls, _MARK, False):
            setattr(cls, "listen", _listen)  # noqa: B010 (mypy: no assigning to a method)
            setattr(cls, _MARK, True)


def _shared_classes() -> tuple[type[Any], ...]:
    from mitmproxy.proxy import mode_servers

    # the gateway is a TCP reverse listener (HTTP or TLS; never a UDP/DNS reverse mode)
    return (mode_servers.RegularInstance, mode_servers.Socks5Instance,
            mode_servers.ReverseInstance, mode_servers.TransparentInstance)


def shared() -> bool:
    return all(getattr(cls, _MARK, False) for cls in _shared_classes())


def reserve(host: str, port: int) -> socket.socket:
    """Bind (not listen) the proxy address with SO_REUSEPORT in the supervisor.

    This checks the address before any worker starts (a port taken by another program, an
    address this host does not have: one clear error instead of N failing workers), and keeps
    the port from being taken by a program without SO_REUSEPORT while workers restart. A
    socket that does not listen receives no connections.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ValueError(f"--listen {host}:{port}: cannot bind ({e.strerror or e}); is another "
                         "program using the port?") from None
    return s
