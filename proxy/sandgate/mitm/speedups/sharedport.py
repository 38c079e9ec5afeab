"""One proxy port for every worker: mitmproxy's TCP listeners bind with SO_REUSEPORT.

mitmproxy binds its listeners itself (`AsyncioServerInstance.listen`, inherited by the regular,
SOCKS5, reverse (--gateway) and transparent modes: asyncio.start_server without reuse_port).
In a worker that method is replaced by one that passes reuse_port=True, so N workers each own
a listening socket on the same address and the kernel hashes each new connection to one of
them. An inherited socket would wake every worker on every connection and leave the spread to
whoever wins accept(); with SO_REUSEPORT a worker that stops (drain, crash) simply leaves the
group. Installed in workers only (registry: `only_in_workers`): a single process keeps
mitmproxy's own bind, so no other program of the same user can join its port. The supervisor's
side (binding the address first: sandgate.workers.listen.reserve) is not a patch.
"""

from __future__ import annotations

import asyncio
from typing import Any

_MARK = "_sandgate_reuse_port"


async def _listen(self: Any, host: str, port: int) -> list[asyncio.Server]:
    # mitmproxy's listen() also serves UDP and port 0 (a free port): Sandgate's TCP modes on a
    # port the supervisor reserved need neither
    return [await asyncio.start_server(self.handle_stream, host, port, reuse_port=True)]


def _shared_classes() -> tuple[type[Any], ...]:
    from mitmproxy.proxy import mode_servers

    # the gateway is a TCP reverse listener (HTTP or TLS; never a UDP/DNS reverse mode)
    return (mode_servers.RegularInstance, mode_servers.Socks5Instance,
            mode_servers.ReverseInstance, mode_servers.TransparentInstance)


def install() -> None:
    """Make mitmproxy's listeners Sandgate uses (the HTTP proxy, --socks5, --gateway,
    transparent capture) bind with SO_REUSEPORT (idempotent)."""
    for cls in _shared_classes():
        if not getattr(cls, _MARK, False):
            setattr(cls, "listen", _listen)  # noqa: B010 (mypy: no assigning to a method)
            setattr(cls, _MARK, True)


def installed() -> bool:
    return all(getattr(cls, _MARK, False) for cls in _shared_classes())
