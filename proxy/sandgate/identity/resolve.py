"""Combine identity sources: the proxy token a client presents and what its address says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sandgate.errors import Code, IdentityError
from sandgate.identity.agents import AgentProcesses
from sandgate.identity.base import AddressIdentitySource, Caller
from sandgate.identity.roles import Split
from sandgate.identity.sockowner import Endpoint
from sandgate.tokens import authenticate_bare, authenticate_basic


@dataclass(frozen=True)
class Identifier:
    token_key: bytes
    address_sources: Sequence[AddressIdentitySource] = ()
    split: Split | None = None  # pattern 1: role listeners (sandgate.identity.roles)
    # pattern 1 without a hook: the process that holds the socket (sandgate.identity.agents)
    agents: AgentProcesses | None = None

    def identify(self, proxy_authorization: str | None, client_ip: str,
                 listen_port: int | None = None,
                 conn: tuple[tuple[str, int], tuple[str, int]] | None = None) -> Caller:
        """Who is calling. Raises IdentityError; never trusts anything unverified.

        A token that names another identity than the address is refused. An address no source
        vouches for is refused without a token; with a valid token it is that token's caller,
        unless a source is exclusive (Docker labels, `--address-identity-only`) or the listener
        is a role listener (the split: its address decides the role).
        `conn` is the connection's (peer, local) address and port: with --agent-dir, the
        process holding the client's socket decides first (sandgate.identity.agents).
        """
        return self._identify(proxy_authorization is not None, client_ip,
                              lambda: authenticate_basic(proxy_authorization, self.token_key),
                              listen_port, conn)

    def _identify(self, has_token: bool, client_ip: str, by_token_of: Callable[[], Caller],
                  listen_port: int | None,
                  conn: tuple[tuple[str, int], tuple[str, int]] | None) -> Caller:
        if self.agents is not None:
            return self._by_process(has_token, conn, by_token_of,
                                    lambda: self._combine(has_token, client_ip, by_token_of,
                                                          listen_port))
        return self._combine(has_token, client_ip, by_token_of, listen_port)

    def _by_process(self, has_token: bool,
                    conn: tuple[tuple[str, int], tuple[str, int]] | None,
                    by_token_of: Callable[[], Caller], otherwise: Callable[[], Caller]
                    ) -> Caller:
        """The caller the socket's owner stands for; a token must name the same identity.
        A connection the agents know nothing about is identified as usual, but never as an
        agent (fail closed: its owner was not found)."""
        assert self.agents is not None
        if conn is None:  # a way in without a TCP peer: no owner, so never an agent
            caller = otherwise()
            self.agents.refuse_unowned(caller, None)
            return caller
        peer, local = Endpoint.of(*conn[0]), Endpoint.of(*conn[1])
        by_owner = self.agents.identify(peer, local)
        if by_owner is None:
            caller = otherwise()
            self.agents.refuse_unowned(caller, peer)
            return caller
        if has_token:
            by_token = by_token_of()
            if by_token.identity != by_owner.identity:
                whose = ("the agent's own process" if by_owner.source.endswith("/agent")
                         else "a process the agent started (its tool) or another one")
                raise IdentityError(
                    Code.AUTH_INVALID,
                    f"the proxy token (identity '{by_token.identity}') disagrees with the "
                    f"process that holds this connection, {whose} (identity "
                    f"'{by_owner.identity}'): the owner decides, never the token")
        return by_owner

    def identify_token(self, token: str | None, client_ip: str,
                       listen_port: int | None = None,
                       conn: tuple[tuple[str, int], tuple[str, int]] | None = None) -> Caller:
        """The same, for a bare token (the gateway's token header) instead of Basic
        Proxy-Authorization; None: the request carries no token."""
        return self._identify(token is not None, client_ip,
                              lambda: authenticate_bare(token, self.token_key), listen_port,
                              conn)

    def caller_at(self, client_ip: str) -> Caller | None:
        """The caller an address source vouches for, for ways in that carry no token (the
        policy DNS): the same sources, in the same order, as a tokenless proxy request."""
        return self._by_address(client_ip)

    def address_known(self, client_ip: str) -> bool:
        """Does an address source vouch for this client (so a token is optional)?"""
        return self._by_address(client_ip) is not None

    def _combine(self, has_token: bool, client_ip: str, by_token_of: Callable[[], Caller],
                 listen_port: int | None = None) -> Caller:
        by_address = self._by_address(client_ip)
        if self.split is not None:  # a role listener: the address's caller in that role
            by_address = self.split.caller(self.split.role(listen_port), by_address, client_ip)
        if self.address_sources and by_address is None:
            if not has_token or self.split is not None or any(
                    getattr(s, "exclusive", True) for s in self.address_sources):
                raise IdentityError(
                    Code.AUTH_INVALID, f"no sandbox is known at address {client_ip}"
                )
            return by_token_of()  # an address no range names: a token client like any other
        if not has_token and by_address is not None:
            return by_address
        by_token = by_token_of()
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
