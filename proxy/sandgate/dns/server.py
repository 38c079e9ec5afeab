"""The policy DNS listeners (UDP and TCP) and the one path every query takes: `PolicyDns.answer`.

    bytes -> bounded and parsed (FORMERR) -> rate per source (REFUSED) -> identity from the
    source address (REFUSED when unknown) -> decide_name (NXDOMAIN/REFUSED + audit, never asked
    upstream) -> Sandgate's resolver (CNAMEs followed, answered under the asked name) ->
    dialable addresses only, TTL and count bounded -> audit -> answer

A query that is itself a response is never answered (no reflection loops between resolvers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from dns.rdatatype import RdataType

from sandgate.audit import events as A
from sandgate.decision import ADDRESS_TYPES, Decision, decide_name, reported
from sandgate.dns.bounds import DnsLimits, SourceRates
from sandgate.dns.resolver import Answer, Upstream, UpstreamError
from sandgate.identity.base import Caller
from sandgate.netguard import classify, in_ranges, is_this_host, known_addresses, unmap
from sandgate.policy.model import Policy, Rule

log = logging.getLogger("sandgate")

EVENT = "dns"  # the audit event of every judged query
QTYPE = "qtype"
RCODE = "rcode"
ANSWERS = "answers"  # how many records were answered

MAX_PENDING_UDP = 1024  # queries being answered at once on the UDP socket; more are dropped
UDP_PAYLOAD = 1232  # the EDNS payload Sandgate offers (the DNS flag day 2020 value)

Emit = Callable[..., None]  # audit: emit(event, **fields)
Count = Callable[[str], None]  # metrics: one answer of this outcome


def formerr(wire: bytes) -> bytes | None:
    """FORMERR for bytes that cannot be parsed, built from their header alone; None when not
    even a header is there or they claim to be a response (never answered)."""
    if len(wire) < 12 or wire[2] & 0x80:
        return None
    opcode_bits = wire[2] & 0x78
    return wire[:2] + bytes([0x80 | opcode_bits, dns.rcode.FORMERR]) + bytes(8)


@dataclass
class PolicyDns:
    """What the listeners call: judged, bounded answers. Holds no socket."""

    policy: Callable[[], Policy]
    identify: Callable[[str], Caller | None]  # source address -> caller (address sources)
    upstream: Upstream
    limits: DnsLimits = field(default_factory=DnsLimits)
    audit: Emit | None = None
    count: Count | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)  # --resolve HOST=IP
    rates: SourceRates = field(init=False)

    def __post_init__(self) -> None:
        self.rates = SourceRates(self.limits.rps, self.limits.burst)

    def _count(self, outcome: str) -> None:
        if self.count is not None:
            self.count(outcome)

    async def answer(self, wire: bytes, source: str, udp: bool = True) -> bytes | None:
        """The answer to one query from `source` (an IP address), or None (no answer)."""
        if len(wire) > self.limits.max_query:
            self._count("formerr")
            return formerr(wire)
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # anything dnspython cannot read is malformed, whatever it raises
            self._count("formerr")
            return formerr(wire)
        if query.flags & dns.flags.QR:
            self._count("dropped")
            return None
        if not self.rates.admit(source):
            self._count("rate_limited")
            return self._wire(self._rcode(query, dns.rcode.REFUSED), query, udp)
        if query.opcode() != dns.opcode.QUERY:
            self._count("notimp")
            return self._wire(self._rcode(query, dns.rcode.NOTIMP), query, udp)
        if len(query.question) != 1 or query.answer or query.authority:
            self._count("formerr")
            return self._wire(self._rcode(query, dns.rcode.FORMERR), query, udp)
        resp = await self._judged(query, source)
        return self._wire(resp, query, udp)

    def _rcode(self, query: dns.message.Message, rcode: dns.rcode.Rcode) -> dns.message.Message:
        resp = dns.message.make_response(query, our_payload=UDP_PAYLOAD)
        resp.flags |= dns.flags.RA
        resp.set_rcode(rcode)
        return resp

    def _wire(self, resp: dns.message.Message, query: dns.message.Message,
              udp: bool) -> bytes:
        limit = 65535
        if udp:
            limit = max(512, min(query.payload, UDP_PAYLOAD)) if query.edns >= 0 else 512
        try:
            return resp.to_wire(max_size=limit)
        except dns.exception.TooBig:  # the client asks again over TCP
            resp.answer.clear()
            resp.flags |= dns.flags.TC
            return resp.to_wire(max_size=limit)

    def _emit(self, **fields: Any) -> None:
        if self.audit is not None:
            self.audit(EVENT, **fields)

    async def _judged(self, query: dns.message.Message, source: str) -> dns.message.Message:
        q = query.question[0]
        qname = q.name.to_text(omit_final_dot=True)
        qtype = dns.rdatatype.to_text(q.rdtype)
        caller = self.identify(source)
        base: dict[str, Any] = {A.CLIENT: source, A.HOST: qname[:253], QTYPE: qtype}
        if caller is None:
            self._count("unknown_source")
            self._emit(**{A.IDENTITY: None, **base, A.DECISION: "deny",
                          A.CODE: "auth_invalid", RCODE: "REFUSED",
                          A.REASON: f"no sandbox is known at address {source}"})
            return self._rcode(query, dns.rcode.REFUSED)
        who = {A.IDENTITY: caller.identity, A.SANDBOX: caller.sandbox,
               A.IDENTITY_SOURCE: caller.source}
        policy = self.policy()
        if q.rdclass != dns.rdataclass.IN:
            d = Decision(False, None, f"class {dns.rdataclass.to_text(q.rdclass)} is not "
                         "answered (only IN)")
        else:
            d = decide_name(policy, caller.identity, qname, qtype)
        report = reported(policy, caller.identity, d)  # `mode: report`: answered, audited so
        if not d.allowed and not report:
            # A name a rule reaches, asked with a type no rule allows: REFUSED, never NXDOMAIN
            # (which would say the name does not exist, and be cached so for its A lookups).
            name_ok = d.code is not None and q.rdclass == dns.rdataclass.IN and \
                decide_name(policy, caller.identity, qname, "A").allowed
            rcode = dns.rcode.REFUSED if (name_ok or self.limits.refuse == "refused"
                                          or d.code is None) else dns.rcode.NXDOMAIN
            self._count("refused" if rcode == dns.rcode.REFUSED else "nxdomain")
            self._emit(**{**who, **base, A.DECISION: "deny",
                          A.CODE: str(d.code) if d.code else "bad_request",
                          A.RULE: d.rule_name, RCODE: dns.rcode.to_text(rcode),
                          A.REASON: d.reason})
            return self._rcode(query, rcode)
        try:
            got = await self._resolve(qname, q.rdtype, d.rule)
        except UpstreamError as e:
            self._count("servfail")
            self._emit(**{**who, **base, A.DECISION: "allow", A.RULE: d.rule_name,
                          RCODE: "SERVFAIL", A.ERROR: str(e)})
            return self._rcode(query, dns.rcode.SERVFAIL)
        rcode = got.rcode
        # Fail closed: an answer goes out only once its audit line is written.
        self._emit(**{**who, **base, A.DECISION: "report" if report else "allow",
                      A.RULE: d.rule_name, RCODE: dns.rcode.to_text(rcode),
                      ANSWERS: len(got.records),
                      **({A.CODE: str(d.code), A.REASON: d.reason} if report else {})})
        resp = self._rcode(query, rcode)
        if rcode == dns.rcode.NOERROR and got.records:
            rrset = dns.rrset.RRset(q.name, dns.rdataclass.IN, q.rdtype)
            ttl = min(got.ttl, self.limits.max_ttl)
            for rd in got.records:
                rrset.add(rd, ttl)
            resp.answer.append(rrset)
            self.upstream.remember(qname.lower(), q.rdtype, got.records, ttl)
        self._count("answer" if got.records else
                    "nodata" if rcode == dns.rcode.NOERROR else
                    "nxdomain_upstream" if rcode == dns.rcode.NXDOMAIN else "servfail")
        return resp

    async def _resolve(self, qname: str, rdtype: RdataType,
                       rule: Rule | None) -> Answer:
        """The records answered for an allowed name: --resolve pins first (what the dialer
        dials), else the upstream; addresses only those the dialer may dial; bounded count."""
        name = qname.lower()
        pinned = known_addresses(name, self.overrides)
        if pinned is not None and dns.rdatatype.to_text(rdtype) in ADDRESS_TYPES:
            family = 4 if rdtype == dns.rdatatype.A else 6
            records = tuple(dns.rdata.from_text(dns.rdataclass.IN, rdtype, str(ip))
                            for ip in pinned if ip.version == family)
            got = Answer(dns.rcode.NOERROR, records, self.limits.max_ttl)
        else:
            got = await self.upstream.lookup(name, rdtype)
        records = got.records
        if rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            records = dialable(records, rule)
        return Answer(got.rcode, records[: self.limits.max_answers], got.ttl)


def dialable(records: tuple[dns.rdata.Rdata, ...], rule: Rule | None
             ) -> tuple[dns.rdata.Rdata, ...]:
    """The addresses the dialer may dial for `rule` (netguard.choose_address's test): public,
    or in the rule's private_cidrs; never this host's unspecified address. A `public: true`
    rule's host with any non-public address is refused whole, so nothing is answered."""
    cidrs = rule.private_cidrs if rule is not None else ()
    ips = [(rd, unmap(ipaddress.ip_address(rd.to_text()))) for rd in records]
    if rule is not None and rule.public and any(classify(ip) is not None for _, ip in ips):
        return ()
    return tuple(rd for rd, ip in ips if not is_this_host(ip)
                 and (classify(ip) is None or in_ranges(ip, cidrs)))


# --- the listeners --------------------------------------------------------------------------


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, dns_: PolicyDns) -> None:
        self.dns = dns_
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # the selector's own class

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if len(self.pending) >= MAX_PENDING_UDP:  # bounded: a flood is dropped, not queued
            self.dns._count("dropped")
            return
        t = asyncio.get_running_loop().create_task(self._one(data, addr))
        self.pending.add(t)
        t.add_done_callback(self.pending.discard)

    async def _one(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        try:
            out = await self.dns.answer(data, str(addr[0]), udp=True)
        except Exception:  # fail closed: an error in Sandgate answers nothing the upstream said
            log.exception("sandgate: policy DNS failed on a query; answering SERVFAIL")
            self.dns._count("servfail")
            out = _servfail(data)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)


def _servfail(wire: bytes) -> bytes | None:
    if len(wire) < 12 or wire[2] & 0x80:
        return None
    return wire[:2] + bytes([0x80 | (wire[2] & 0x78), dns.rcode.SERVFAIL]) + bytes(8)


class PolicyDnsServer:
    """The UDP socket and TCP listener of `--dns HOST:PORT`."""

    def __init__(self, dns_: PolicyDns, host: str, port: int, reuse_port: bool = False) -> None:
        self.dns, self.host, self.port, self.reuse_port = dns_, host, port, reuse_port
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._open = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self.dns), local_addr=(self.host, self.port),
            reuse_port=self.reuse_port or None)
        self._udp = transport
        self._tcp = await asyncio.start_server(self._client, self.host, self.port,
                                               reuse_port=self.reuse_port or None,
                                               limit=self.dns.limits.max_query + 2)
        log.info("sandgate: policy DNS on %s:%d (udp, tcp)", self.host, self.port)

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await self._tcp.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.dns.limits
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        if self._open >= lim.tcp_connections:
            self.dns._count("dropped")
            writer.close()
            return
        self._open += 1
        try:
            for _ in range(lim.tcp_queries):
                try:
                    head = await asyncio.wait_for(reader.readexactly(2), lim.tcp_idle)
                    (size,) = struct.unpack("!H", head)
                    if size > lim.max_query or size < 12:  # bounded before it is read
                        self.dns._count("formerr")
                        return
                    wire = await asyncio.wait_for(reader.readexactly(size), lim.tcp_idle)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    out = await self.dns.answer(wire, source, udp=False)
                except Exception:
                    log.exception("sandgate: policy DNS failed on a query; answering SERVFAIL")
                    self.dns._count("servfail")
                    out = _servfail(wire)
                if out is None:
                    return
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
