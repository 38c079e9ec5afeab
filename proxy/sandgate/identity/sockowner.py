"""Which process holds a TCP connection's socket: read from /proc, bounded, no side effects.

The proxy sees a client connection as (peer address, peer port) -> (its own address and port).
The client's socket is the entry of its network namespace's TCP table (/proc/PID/net/tcp and
tcp6, PID any process of that namespace) whose local end is the proxy's peer and whose remote
end is the proxy's listener; the entry's inode names the socket, and a process holds it when one
of its fds links to `socket:[INODE]`. Without NAT between the client and the proxy, the two
views of the connection are the same four values.

Bounded work: one pass over one namespace's TCP tables, then one listing of one process's fds
(the registered agent's; nobody else is searched). Every function takes the /proc root, so the
tests give it a fake one.

An inode of 0 is an orphan socket (closed by its process, the kernel still finishing it): it has
no owner, and `socket_inode` returns None for it like for a connection not in the table.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandgate.errors import Unavailable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# an entry larger than this is not a /proc TCP table line; the table is read line by line
_MAX_LINE = 512


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: IPAddress
    port: int

    @classmethod
    def of(cls, address: str, port: int) -> Endpoint:
        """An endpoint as a socket API reports it (an IPv4-mapped IPv6 address is the IPv4
        address: a dual-stack listener reports IPv4 peers that way)."""
        return cls(canonical(ipaddress.ip_address(address.split("%", 1)[0])), port)


def canonical(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_endpoint(field: str, byteorder: str = sys.byteorder) -> Endpoint:
    """`0100007F:1F90` (IPv4) or 32 hex digits `:PORT` (IPv6), as the kernel prints them: the
    address as 32-bit words in host byte order, the port in hex. Raises ValueError."""
    addr_hex, sep, port_hex = field.partition(":")
    if not sep or len(port_hex) != 4 or len(addr_hex) not in (8, 32):
        raise ValueError(f"not a /proc/net/tcp endpoint: {field!r}")
    raw = bytes.fromhex(addr_hex)
    if byteorder == "little":  # each 32-bit word was printed as a host-order integer
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw)
    return Endpoint(canonical(address), int(port_hex, 16))


def format_endpoint(ep: Endpoint, v6: bool, byteorder: str = sys.byteorder) -> str:
    """The inverse of parse_endpoint (for the tests' fake /proc): in tcp6, an IPv4 endpoint is
    the IPv4-mapped address."""
    address: IPAddress = ep.address
    if v6 and isinstance(address, ipaddress.IPv4Address):
        address = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)
    raw = address.packed
    if byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{raw.hex().upper()}:{ep.port:04X}"


def find_inode(lines: Iterable[str], local: Endpoint, remote: Endpoint,
               byteorder: str = sys.byteorder) -> int | None:
    """The inode of the socket from `local` to `remote` in a TCP table's lines (the header
    first); None when no entry matches or the matching one is an orphan (inode 0)."""
    it = iter(lines)
    next(it, None)  # the header
    for line in it:
        if len(line) > _MAX_LINE:
            continue
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            if parse_endpoint(fields[1], byteorder) != local:
                continue
            if parse_endpoint(fields[2], byteorder) != remote:
                continue
            inode = int(fields[9])
        except ValueError:
            continue
        return inode or None
    return None


def socket_inode(proc: Path, pid: int, local: Endpoint, remote: Endpoint) -> int | None:
    """The inode of the socket `local` -> `remote` in the network namespace of `pid`, from its
    tcp and tcp6 tables; None if there is none (or only an orphan), or the tables are gone."""
    for table in ("tcp", "tcp6"):
        try:
            with open(proc / str(pid) / "net" / table, encoding="ascii",
                      errors="replace") as f:
                inode = find_inode(f, local, remote)
        except OSError:
            continue
        if inode is not None:
            return inode
    return None


class Unreadable(Unavailable):
    """A process's fds exist but cannot be listed (another user's, without CAP_SYS_PTRACE)."""


def socket_fds(proc: Path, pid: int) -> Iterator[int]:
    """The inodes of the sockets `pid` holds (its threads share its fd table). Nothing when
    the process is gone; Unreadable when its fds cannot be listed."""
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return
    except OSError as e:
        raise Unreadable(f"{fd_dir}: {e.strerror}") from None
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            digits = target[len("socket:["):-1]
            if digits.isdigit():
                yield int(digits)


def holds(proc: Path, pid: int, inode: int) -> bool:
    """Does process `pid` hold the socket `inode` (one of its fds)? Raises Unreadable."""
    return any(held == inode for held in socket_fds(proc, pid))


def start_time(proc: Path, pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): with the
    pid, it names one process, never a later one that reuses the pid. None: no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces and parentheses
    rest = stat.rpartition(")")[2].split()
    try:
        return int(rest[19])  # field 22 is the 20th after the name
    except (IndexError, ValueError):
        return None


def net_namespace(proc: Path, pid: int) -> str | None:
    """The process's network namespace (`net:[INODE]`), None if it is gone."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "net")
    except OSError:
        return None
