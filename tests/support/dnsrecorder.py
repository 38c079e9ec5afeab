"""A recording upstream resolver for the policy DNS tests: a small dnspython UDP server that
records every question it is asked and answers from a fixed zone, as a recursive resolver
would (CNAME chains answered with the records at their end, unless the alias is `partial`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

Zone = Mapping[str, Mapping[str, Sequence[str]]]  # name -> type -> rdata texts


@dataclass
class RecordingResolver:
    host: str
    port: int
    zone: Zone
    partial: frozenset[str] = frozenset()  # aliases answered with their CNAME only
    ttl: int = 300
    default: str | None = None  # an A address for every name not in the zone (else NXDOMAIN)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (name, type) asked

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.host, self.port))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def names(self) -> set[str]:
        with self._lock:
            return {n for n, _ in self.seen}

    def clear(self) -> None:
        with self._lock:
            self.seen.clear()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RecordingResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while True:
            try:
                data, addr = self._sock.recvfrom(4096)
            except OSError:
                return
            try:
                q = dns.message.from_wire(data)
            except Exception:
                continue
            question = q.question[0]
            name = question.name.to_text(omit_final_dot=True).lower()
            rtype = dns.rdatatype.to_text(question.rdtype)
            with self._lock:
                self.seen.append((name, rtype))
            self._sock.sendto(self._answer(q, name, question.rdtype).to_wire(), addr)

    def _answer(self, q: dns.message.Message, name: str,
                rdtype: dns.rdatatype.RdataType) -> dns.message.Message:
        resp = dns.message.make_response(q)
        resp.flags |= dns.flags.RA
        current = name
        for _ in range(10):
            records = self.zone.get(current)
            if records is None and self.default is not None:
                records = {"A": [self.default]}
            if records is None:
                if current == name:
                    resp.set_rcode(dns.rcode.NXDOMAIN)
                return resp
            want = dns.rdatatype.to_text(rdtype)
            if want in records:
                resp.answer.append(dns.rrset.from_text_list(
                    current + ".", self.ttl, "IN", want, list(records[want])))
                return resp
            if "CNAME" not in records:
                return resp
            target = records["CNAME"][0]
            resp.answer.append(dns.rrset.from_text_list(
                current + ".", self.ttl, "IN", "CNAME", [target + "."]))
            if current in self.partial:
                return resp
            current = target
        return resp
