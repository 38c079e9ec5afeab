"""Identify callers by static address ranges (VMs, network namespaces, fixed sandbox subnets).

    10.20.0.0/16=bash-tool             every address in the range is identity "bash-tool"
    10.20.5.0/24=bash-tool/sbx-5       ... and this narrower range is also sandbox "sbx-5"

The most specific (longest) prefix containing the address wins.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

from sandgate.identity.base import Caller
from sandgate.netguard import unmap

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")

CidrEntry = tuple[str, str, str | None]  # (cidr, identity, sandbox)


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr.strip(), strict=True)
    except ValueError as exc:
        try:
            loose = ipaddress.ip_network(cidr.strip(), strict=False)
        except ValueError:
            raise ValueError(f"{cidr!r} is not an IP network (expected e.g. 10.20.0.0/16)") from exc
        raise ValueError(f"{cidr!r} has host bits set; did you mean {loose}?") from exc


def _check_name(what: str, value: str, cidr: str) -> None:
    if not _NAME.match(value):
        raise ValueError(
            f"{cidr}: invalid {what} {value!r} (letters, digits, '_', '.', '@', '-')"
        )


class StaticCidrSource:
    """AddressIdentitySource over a fixed table of ranges. Lookups only read prebuilt dicts."""

    source = "cidr"

    def __init__(self, mapping: Sequence[CidrEntry], exclusive: bool = False) -> None:
        # not exclusive: the ranges say who the addresses in them are; a client elsewhere (a
        # host tool, another network) is identified by its proxy token as without any range
        self.exclusive = exclusive
        # Per IP version: prefix lengths longest first, and per length {network int: Caller}.
        tables: dict[int, dict[int, dict[int, Caller]]] = {4: {}, 6: {}}
        seen: dict[ipaddress.IPv4Network | ipaddress.IPv6Network, CidrEntry] = {}
        for cidr, identity, sandbox in mapping:
            net = _network(cidr)
            _check_name("identity", identity, cidr)
            if sandbox is not None:
                _check_name("sandbox", sandbox, cidr)
            if net in seen:
                raise ValueError(
                    f"identity CIDR map: {net} is mapped twice ({seen[net][1]!r} and {identity!r})"
                )
            seen[net] = (cidr, identity, sandbox)
            by_len = tables[net.version].setdefault(net.prefixlen, {})
            by_len[int(net.network_address)] = Caller(identity, sandbox, self.source)
        self._v4 = sorted(tables[4].items(), key=lambda kv: -kv[0])
        self._v6 = sorted(tables[6].items(), key=lambda kv: -kv[0])
        self.entries: tuple[CidrEntry, ...] = tuple(
            (str(net), e[1], e[2]) for net, e in seen.items()
        )

    def lookup(self, client_ip: str) -> Caller | None:
        try:
            addr = ipaddress.ip_address(client_ip.split("%", 1)[0])
        except ValueError:
            return None
        addr = unmap(addr)  # ::ffff:10.20.0.5 from a dual-stack listener
        if addr.version == 4:
            tables, bits = self._v4, 32
        else:
            tables, bits = self._v6, 128
        value = int(addr)
        for plen, nets in tables:
            mask = ((1 << plen) - 1) << (bits - plen) if plen else 0
            caller = nets.get(value & mask)
            if caller is not None:
                return caller
        return None

    def __repr__(self) -> str:
        return f"StaticCidrSource({len(self.entries)} ranges)"


def parse_cidr_entry(text: str) -> CidrEntry:
    """One "CIDR=identity" or "CIDR=identity/sandbox". Raises ValueError with a clear message."""
    cidr, sep, who = text.strip().partition("=")
    if not sep or not cidr.strip() or not who.strip():
        raise ValueError(f"{text.strip()!r}: expected CIDR=IDENTITY or CIDR=IDENTITY/SANDBOX")
    cidr = cidr.strip()
    net = _network(cidr)
    identity, slash, sandbox = who.strip().partition("/")
    _check_name("identity", identity, cidr)
    if slash:
        _check_name("sandbox", sandbox, cidr)
    return (str(net), identity, sandbox if slash else None)


def parse_cidr_map(text: str | Iterable[str], exclusive: bool = False) -> StaticCidrSource:
    """A StaticCidrSource from lines of "CIDR=identity[/sandbox]" (e.g. --identity-cidr values).
    `exclusive`: refuse addresses outside every range even with a valid token.

    Raises ValueError naming the offending line or range.
    """
    return StaticCidrSource(parse_cidr_entries(text), exclusive)


def parse_cidr_entries(text: str | Iterable[str]) -> list[CidrEntry]:
    """Parse lines of "CIDR=identity[/sandbox]" (blank lines and # comments ignored).

    Raises ValueError naming the line.
    """
    lines = text.splitlines() if isinstance(text, str) else list(text)
    entries: list[CidrEntry] = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            entries.append(parse_cidr_entry(line))
        except ValueError as exc:
            raise ValueError(f"identity CIDR map, line {n}: {exc}") from None
    return entries
