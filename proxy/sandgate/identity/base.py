"""Who is calling: the result every identity source produces, and the contract it meets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Caller:
    identity: str
    sandbox: str | None
    source: str  # "token", "cidr", "docker": which source vouched for this caller
    # a token caller: when its token expires (epoch seconds); a sandbox known only by tokens
    # ends then (its dynamic secrets are revoked)
    expires: float | None = field(default=None, compare=False)
    # pattern 1: does the sandbox run with the split (its bash tool as another user on the tool
    # listener, sandgate.identity.roles)? None: the source cannot tell (tokens, CIDRs)
    split: bool | None = field(default=None, compare=False)


SandboxEnded = Callable[[Caller, str], None]  # (the caller that is gone, why); any thread


class AddressIdentitySource(Protocol):
    """Identifies a caller by the address it connects from (Docker labels, static CIDRs).

    `lookup` is called on the hot path: it must only read pre-built state, never do I/O.
    It returns None when this source knows nothing about the address. `exclusive`: an address
    it knows nothing about is refused even with a valid proxy token (Docker labels: every client
    on the watched networks is a container; `--identity-cidr` with `--address-identity-only`);
    otherwise such a client is identified by its token alone.
    """

    exclusive: bool

    def lookup(self, client_ip: str) -> Caller | None: ...
