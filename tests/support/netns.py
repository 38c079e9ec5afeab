"""The project's own test hosts in network namespaces: an address that classifies as public
(what some tests need) on a host that exists only on this machine, never on the host's own
interfaces."""

from __future__ import annotations

import ctypes
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

_CLONE_NEWNET = 0x40000000


def _sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


@contextmanager
def host_in_netns(address: str) -> Iterator[str]:
    """A namespace that owns `address`, routed from the host over a veth pair; yields its name.

    The link between the two uses a /30 of link-local addresses chosen per call.
    """
    name = f"sgpub-{uuid.uuid4().hex[:6]}"
    veth = f"p{name[-6:]}"
    n = int(name[-2:], 16) % 60
    host_ip, ns_ip = f"169.254.213.{4 * n + 1}", f"169.254.213.{4 * n + 2}"
    _sh("ip", "netns", "add", name)
    try:
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
        _sh("ip", "link", "set", f"{veth}n", "netns", name)
        _sh("ip", "addr", "add", f"{host_ip}/30", "dev", veth)
        _sh("ip", "link", "set", veth, "up")
        _sh("ip", "-n", name, "addr", "add", f"{ns_ip}/30", "dev", f"{veth}n")
        _sh("ip", "-n", name, "addr", "add", f"{address}/32", "dev", "lo")
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        _sh("ip", "-n", name, "link", "set", f"{veth}n", "up")
        _sh("ip", "-n", name, "route", "add", "default", "via", host_ip)
        _sh("ip", "route", "add", f"{address}/32", "via", ns_ip, "dev", veth)
        yield name
    finally:
        _sh("ip", "route", "del", f"{address}/32", check=False)
        _sh("ip", "link", "del", veth, check=False)
        _sh("ip", "netns", "del", name, check=False)


def listen_in_netns(netns: str, address: str, port: int) -> socket.socket:
    """A listening TCP socket bound inside `netns` (setns in a helper thread: a thread's
    namespace is its own, and a socket stays in the namespace it was made in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    out: dict[str, object] = {}

    def work() -> None:
        try:
            with open(f"/var/run/netns/{netns}") as f:
                if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
            s.listen(64)
            out["sock"] = s
        except BaseException as e:  # reported in the caller's thread
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    sock = out["sock"]
    assert isinstance(sock, socket.socket)
    return sock
