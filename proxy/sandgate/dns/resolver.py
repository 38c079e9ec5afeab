"""Sandgate's own resolver for the policy DNS: asks a recursive server, follows CNAMEs itself,
caches by TTL, and records the addresses it answered for the dialer (sandgate.dns.cache).

Only names the policy allowed ever reach here (sandgate.dns.server judges first).
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.resolver
from dns.rdatatype import RdataType

from sandgate.dns.cache import ANSWERED, AddressCache
from sandgate.errors import Unavailable

MAX_CACHED = 10_000


@dataclass(frozen=True, slots=True)
class Answer:
    """What the upstream says about one (name, type), CNAMEs already followed."""

    rcode: dns.rcode.Rcode  # NOERROR, NXDOMAIN, SERVFAIL
    records: tuple[dns.rdata.Rdata, ...]  # of the asked type, at the end of the chain
    ttl: int  # the smallest TTL along the chain (0 when nothing was answered)


class UpstreamError(Unavailable):
    """The upstream resolver did not answer usably (timeout, network, a broken answer)."""


def system_servers() -> list[tuple[str, int]]:
    """The recursive servers of this host's resolv.conf (what getaddrinfo asks)."""
    try:
        r = dns.resolver.Resolver(configure=True)
    except dns.resolver.NoResolverConfiguration:
        return []
    return [(str(ns), 53) for ns in r.nameservers]


class Upstream:
    def __init__(self, servers: Sequence[tuple[str, int]], timeout: float = 3.0,
                 max_chain: int = 8, answered: AddressCache = ANSWERED) -> None:
        if not servers:
            raise ValueError("no upstream DNS server: give --dns-upstream HOST:PORT")
        self.servers = list(servers)
        self.timeout = timeout
        self.max_chain = max_chain
        self.answered = answered
        self._cache: OrderedDict[tuple[str, RdataType], tuple[float, Answer]] = \
            OrderedDict()

    async def lookup(self, name: str, rdtype: RdataType) -> Answer:
        """`name` (normalised, no trailing dot) of type `rdtype`, from the cache while fresh."""
        key = (name, rdtype)
        hit = self._cache.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        answer = await self._resolve(name, rdtype)
        if answer.rcode in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
            self._cache.pop(key, None)
            self._cache[key] = (time.monotonic() + (answer.ttl if answer.records else 5),
                                answer)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return answer

    def remember(self, name: str, rdtype: RdataType,
                 records: Sequence[dns.rdata.Rdata], ttl: int) -> None:
        """The addresses answered to a sandbox: the dialer pins these while they are fresh."""
        if rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA) or not records:
            return
        ips = tuple(ipaddress.ip_address(r.to_text()) for r in records)
        self.answered.put(name, dns.rdatatype.to_text(rdtype), ips, max(ttl, 1))

    async def _resolve(self, name: str, rdtype: RdataType) -> Answer:
        current = dns.name.from_text(name)
        ttl: int | None = None
        seen = {current}
        for _ in range(self.max_chain + 1):
            asked = current
            resp = await self._ask(asked, rdtype)
            rcode = resp.rcode()
            if rcode not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
                return Answer(dns.rcode.SERVFAIL, (), 0)
            # Follow the chain inside this answer: current -> CNAME -> ... -> the records.
            while True:
                rrset = resp.get_rrset(resp.answer, current, dns.rdataclass.IN, rdtype)
                if rrset is not None:
                    ttl = rrset.ttl if ttl is None else min(ttl, rrset.ttl)
                    return Answer(dns.rcode.NOERROR, tuple(rrset), ttl)
                cname = resp.get_rrset(resp.answer, current, dns.rdataclass.IN,
                                       dns.rdatatype.CNAME)
                if cname is None:
                    break
                ttl = cname.ttl if ttl is None else min(ttl, cname.ttl)
                current = next(iter(cname)).target
                if current in seen or len(seen) > self.max_chain:
                    return Answer(dns.rcode.SERVFAIL, (), 0)  # a loop, or too long a chain
                seen.add(current)
            if rcode == dns.rcode.NXDOMAIN:
                return Answer(dns.rcode.NXDOMAIN, (), 0)
            if current == asked:  # no record of this type and no alias: no data
                return Answer(dns.rcode.NOERROR, (), 0)
            # The chain ends in a name this answer says nothing about: ask for that (bounded).
        return Answer(dns.rcode.SERVFAIL, (), 0)

    async def _ask(self, name: dns.name.Name, rdtype: RdataType) -> dns.message.Message:
        q = dns.message.make_query(name, rdtype, use_edns=0, payload=1232)
        q.flags |= dns.flags.RD
        last: Exception | None = None
        for host, port in self.servers:
            try:
                resp, _tcp = await dns.asyncquery.udp_with_fallback(
                    q, host, timeout=self.timeout, port=port)
                return resp
            except (dns.exception.DNSException, OSError, EOFError) as e:
                last = e
        raise UpstreamError(f"no upstream DNS server answered ({type(last).__name__})")
