"""No way to the inside: parse every spelling of an address, classify it, choose what to dial.

The name is resolved once; the address that was checked is the address that is dialled, so a
DNS answer cannot change between the check and the connect (no rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sandgate.dns.cache import ANSWERED
from sandgate.errors import AddressRefused, Code

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_V4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_V6_RESERVED_LOW = ipaddress.ip_network("::/8")
_THIS_NET = ipaddress.ip_network("0.0.0.0/8")
_V4_CLASSES: tuple[tuple[str, IPNetwork], ...] = tuple(
    (name, ipaddress.ip_network(net))
    for name, net in (
        ("this_network", "0.0.0.0/8"),
        ("private", "10.0.0.0/8"),
        ("cgnat", "100.64.0.0/10"),
        ("loopback", "127.0.0.0/8"),
        ("link_local", "169.254.0.0/16"),  # includes cloud metadata 169.254.169.254
        ("private", "172.16.0.0/12"),
        ("ietf_protocol", "192.0.0.0/24"),
        ("documentation", "192.0.2.0/24"),
        ("relay_6to4", "192.88.99.0/24"),
        ("private", "192.168.0.0/16"),
        ("benchmarking", "198.18.0.0/15"),
        ("documentation", "198.51.100.0/24"),
        ("documentation", "203.0.113.0/24"),
        ("multicast", "224.0.0.0/4"),
        ("reserved", "240.0.0.0/4"),  # includes broadcast
    )
)


def parse_ip_literal(host: str) -> IPAddress | None:
    """Return the address a host string denotes in any numeric spelling, or None for a name.

    Accepts what C resolvers and browsers accept: dotted quads, shortened forms ("127.1"),
    hex ("0x7f000001", "0x7f.0.0.1"), octal ("0177.0.0.1"), a single integer ("2130706433"),
    and IPv6 with or without brackets, zone ids stripped.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if ":" in h:
        try:
            return ipaddress.IPv6Address(h.split("%", 1)[0])
        except ValueError:
            return None
    h = h.rstrip(".") if h.endswith(".") and h.count(".") <= 4 else h
    if not h or not all(is_numeric_label(p) for p in h.split(".")):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(h))
    except OSError:
        return None


def ip_text(ip: IPAddress) -> str:
    """The canonical text of an address, the same on every Python: RFC 5952's, with an
    IPv4-mapped address as ``::ffff:a.b.c.d`` (section 5). Python 3.13's `str()` writes that
    form, 3.12's writes ``::ffff:7f00:1``; host names compare as text, so both must agree."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None \
            and ip.scope_id is None:
        return f"::ffff:{ip.ipv4_mapped}"
    return str(ip)


def is_numeric_label(part: str) -> bool:
    """A label a C resolver reads as (part of) an IPv4 address: decimal, octal or 0x-hex."""
    p = part.lower()
    if p.startswith("0x"):
        return all(c in "0123456789abcdef" for c in p[2:])
    return p.isdigit() and p.isascii()


def classify(ip: IPAddress) -> str | None:
    """Why this address is not a public unicast destination, or None when it is one."""
    if isinstance(ip, ipaddress.IPv4Address):
        for name, net in _V4_CLASSES:
            if ip in net:
                return name
        return None if ip.is_global else "reserved"
    mapped = ip.ipv4_mapped
    if mapped is not None:
        return "ipv4_mapped:" + (classify(mapped) or "public")
    if ip in _V4_TRANSLATED:  # ::ffff:0:a.b.c.d (RFC 2765 SIIT): a translator dials a.b.c.d
        embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        return "ipv4_translated:" + (classify(embedded) or "public")
    if ip.packed[:12] == bytes(12):
        # ::a.b.c.d (IPv4-compatible, deprecated), :: and ::1
        if ip == ipaddress.IPv6Address("::1"):
            return "loopback"
        return "ipv4_compatible" if int(ip) > 1 else "unspecified"
    if any(ip in n for n in _NAT64):
        return "nat64"
    if ip.sixtofour is not None:
        return "6to4"
    if ip.teredo is not None:
        return "teredo"
    if ip in _V6_RESERVED_LOW:  # ::/8 holds no unicast space beyond the embeddings above
        return "reserved"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link_local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_site_local:
        return "site_local"
    if ip in ipaddress.IPv6Network("fc00::/7"):
        return "ula"
    if ip.is_unspecified:
        return "unspecified"
    return None if ip.is_global else "reserved"


def unmap(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:a.b.c.d``, what a dual-stack socket reports for an
    IPv4 peer) as the IPv4 address it is, so that ranges name it once."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def in_ranges(ip: IPAddress, ranges: Iterable[IPNetwork]) -> bool:
    return any(ip.version == n.version and ip in n for n in ranges)


def may_dial(ip: IPAddress, allowed: Iterable[IPNetwork]) -> bool:
    """A public address, or a non-public one inside the rule's `private_cidrs`."""
    return classify(ip) is None or in_ranges(ip, allowed)


@dataclass(frozen=True, slots=True)
class DialTarget:
    ip: IPAddress
    port: int

    @property
    def address(self) -> tuple[str, int]:
        return (str(self.ip), self.port)


def choose_address(
    host: str,
    port: int,
    candidates: Sequence[IPAddress],
    allowed: Iterable[IPNetwork],
    self_addresses: Iterable[tuple[IPAddress, int]] = (),
    only_public: bool = False,
) -> DialTarget:
    """Pick the first candidate that may be dialled; refuse when none may.

    A non-public address is allowed only when it lies in one of `allowed` (the matching rule's
    `private_cidrs`); the proxy's own listening sockets are never allowed. `only_public` (a
    `public: true` rule): the host must resolve only to public addresses; one non-public
    address among them refuses the host.
    """
    allowed = tuple(allowed)
    selves = tuple(self_addresses)
    reasons: list[str] = []
    if only_public:
        inside = [f"{unmap(ip)} is {kind}" for ip in candidates
                  if (kind := classify(unmap(ip))) is not None]
        if inside:
            raise AddressRefused(
                Code.INTERNAL_ADDRESS,
                f"{host} resolves to a non-public address ({'; '.join(inside)}); the matching "
                "rule allows only hosts that resolve only to public addresses (public: true)",
                hint="a rule that names this host (and, if it is meant to be reachable, its "
                "range in private_cidrs) is needed",
            )
    for raw in candidates:
        ip = unmap(raw)
        if is_this_host(raw):
            raise AddressRefused(Code.SELF_ADDRESS, f"{host}:{port} is Sandgate's own host "
                                 f"({raw} is an unspecified address, which dials this host)")
        if _is_self(ip, port, selves):
            raise AddressRefused(Code.SELF_ADDRESS, f"{host}:{port} is Sandgate itself ({ip})")
        kind = classify(ip)
        if kind is not None and not in_ranges(ip, allowed):
            reasons.append(f"{ip} is {kind}")
            continue
        return DialTarget(ip, port)
    if not reasons:
        raise AddressRefused(Code.UNRESOLVABLE, f"{host} did not resolve to any address")
    raise AddressRefused(
        Code.INTERNAL_ADDRESS,
        f"{host} resolves to a non-public address ({'; '.join(reasons)}) "
        "that the matching rule does not name in private_cidrs",
        hint="name the range in the rule's private_cidrs only if this destination is meant to "
        "be reachable",
    )


def embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 spelling carries (mapped, SIIT-translated, IPv4-compatible,
    NAT64), or None."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _V4_TRANSLATED or ip.packed[:12] == bytes(12) or any(ip in n for n in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_this_host(ip: IPAddress) -> bool:
    """An address that dials the local host whatever listens there: 0.0.0.0/8 ("this network":
    Linux connects 0.0.0.0 to the local host) and `::`, in every spelling (::ffff:0.0.0.0,
    ::ffff:0:0.0.0.0, ::0.0.0.0, 64:ff9b::0.0.0.0). Never dialled, whatever private_cidrs say:
    Sandgate's own listeners (admin API included) are on this host."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_unspecified:
        return True
    v4 = embedded_v4(ip)
    return v4 is not None and v4 in _THIS_NET and not (
        isinstance(ip, ipaddress.IPv6Address) and ip == ipaddress.IPv6Address("::1"))


def _is_self(ip: IPAddress, port: int, selves: Sequence[tuple[IPAddress, int]]) -> bool:
    for self_ip, self_port in selves:
        if port != self_port:
            continue
        if ip == self_ip or (self_ip.is_unspecified and (ip.is_loopback or ip.is_unspecified)):
            return True
        if self_ip.is_unspecified and ip.version == self_ip.version and _is_local_interface(ip):
            return True
    return False


def _is_local_interface(ip: IPAddress) -> bool:
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def known_addresses(host: str, overrides: Mapping[str, str]) -> list[IPAddress] | None:
    """The addresses `resolve` gives without asking DNS: an IP literal, or a name pinned with
    --resolve. None when the answer is only known at request time."""
    literal = parse_ip_literal(host)
    if literal is not None:
        return [literal]
    if host in overrides:
        return [ipaddress.ip_address(overrides[host])]
    return None


async def resolve(
    host: str, port: int, overrides: Mapping[str, str], timeout: float = 5.0
) -> list[IPAddress]:
    """Resolve once. `overrides` (from --resolve) map a name to an address and win over DNS."""
    known = known_addresses(host, overrides)
    if known is not None:
        return known
    answered = ANSWERED.addresses(host)  # what the policy DNS told a sandbox: dial that
    if answered is not None:
        return answered
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout=timeout
        )
    except (OSError, TimeoutError):
        return []
    out: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if ip not in out:
            out.append(ip)
    return out
