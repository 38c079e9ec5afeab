"""Who is calling: the result every identity source produces, and the contract it meets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Caller:
    identity: str
    sandbox: str | None
    source: str  # "token", "cidr", "docker": which source vouched for this caller


class AddressIdentitySource(Protocol):
    """Identifies a caller by the address it connects from (Docker labels, static CIDRs).

    `lookup` is called on the hot path: it must only read pre-built state, never do I/O.
    It returns None when this source knows nothing about the address.
    """

    def lookup(self, client_ip: str) -> Caller | None: ...
