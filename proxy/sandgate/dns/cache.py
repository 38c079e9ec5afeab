"""The addresses the policy DNS answered, shared with the dialer.

A sandbox that looked a name up through Sandgate connects to one of the addresses it was told;
the dialer (`netguard.resolve`) uses the same answer while it is fresh instead of resolving the
name a second time (which could give other addresses: round-robin, geo DNS, rebinding). Filled
only by `sandgate.dns.resolver.Upstream`; empty (and unused) without `--dns`.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_NAMES = 10_000  # oldest first out: the table is bounded whatever names are asked


class AddressCache:
    def __init__(self, max_names: int = MAX_NAMES) -> None:
        self._max = max_names
        # (name, "A"|"AAAA") -> (expires at, monotonic; addresses)
        self._table: OrderedDict[tuple[str, str], tuple[float, tuple[IPAddress, ...]]] = \
            OrderedDict()

    def put(self, name: str, rdtype: str, addresses: tuple[IPAddress, ...], ttl: float) -> None:
        key = (name, rdtype)
        self._table.pop(key, None)
        self._table[key] = (time.monotonic() + ttl, addresses)
        while len(self._table) > self._max:
            self._table.popitem(last=False)

    def get(self, name: str, rdtype: str) -> tuple[IPAddress, ...] | None:
        hit = self._table.get((name, rdtype))
        if hit is None:
            return None
        if hit[0] <= time.monotonic():
            self._table.pop((name, rdtype), None)
            return None
        return hit[1]

    def addresses(self, name: str) -> list[IPAddress] | None:
        """What the policy DNS last answered for `name` (A then AAAA), while fresh; None when
        it answered nothing that is still fresh (the dialer then resolves itself)."""
        out = [*(self.get(name, "A") or ()), *(self.get(name, "AAAA") or ())]
        return out or None

    def clear(self) -> None:
        self._table.clear()


# The one table of this process: written by the DNS server, read by the dialer.
ANSWERED = AddressCache()
