"""Combine identity sources: the proxy token a client presents and what its address says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sandgate.errors import Code, IdentityError
from sandgate.identity.base import AddressIdentitySource, Caller
from sandgate.tokens import authenticate_basic


@dataclass(frozen=True)
class Identifier:
    token_key: bytes
    address_sources: Sequence[AddressIdentitySource] = ()

    def identify(self, proxy_authorization: str | None, client_ip: str) -> Caller:
        """Who is calling. Raises IdentityError; never trusts anything unverified.

        With address sources configured, an address no source vouches for is refused even with
        a valid token, and a token that names another identity than the address is refused.
        """
        by_address = self._by_address(client_ip)
        if self.address_sources and by_address is None:
            raise IdentityError(
                Code.AUTH_INVALID, f"no sandbox is known at address {client_ip}"
            )
        if proxy_authorization is None and by_address is not None:
            return by_address
        by_token = authenticate_basic(proxy_authorization, self.token_key)
        if by_address is not None:
            if by_token.identity != by_address.identity or (
                by_token.sandbox is not None
                and by_address.sandbox is not None
                and by_token.sandbox != by_address.sandbox
            ):
                raise IdentityError(
                    Code.AUTH_INVALID,
                    f"the proxy token (identity '{by_token.identity}') disagrees with the "
                    f"sandbox at {client_ip} (identity '{by_address.identity}')",
                )
            return by_address
        return by_token

    def _by_address(self, client_ip: str) -> Caller | None:
        for source in self.address_sources:
            caller = source.lookup(client_ip)
            if caller is not None:
                return caller
        return None
