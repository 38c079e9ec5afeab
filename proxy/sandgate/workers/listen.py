"""One proxy port for every worker, the supervisor's side: the address bound first
(`reserve`), and how many workers by default. The workers' side, mitmproxy's listeners bound
with SO_REUSEPORT, is a patch: sandgate.mitm.speedups.sharedport."""

from __future__ import annotations

import os
import socket


def default_workers() -> int:
    """The cores this process may run on (the affinity mask, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


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
