"""Pattern 1 with the split: one sandbox, two identities, told apart by the listener.

Inside a split sandbox (sandgate.pattern1) the kernel sends every TCP connection of the bash
tool's user to Sandgate's *tool* listener, and every connection of any user other than the agent
and its tool to the *other* listener, whatever address and port the process asked for (the
sandbox's own nat table, set by its entrypoint before anything untrusted runs, with no
capability left to change it). So the listener a connection arrives on says which user opened
it, and the address says which sandbox:

    (sandbox at the address, agent listener) -> the sandbox's identity (its label / CIDR entry)
    (sandbox at the address, tool listener)  -> the tool identity `--tool-identity` names for it
    (anything, other listener)               -> refused (auth_invalid) and audited

An agent identity with a tool identity whose sandbox runs WITHOUT the split (the Docker label
`sandgate.split` is not `uid`: its tools share its egress) is served, and audited as such: its
requests' identity_source ends in `/unsplit` (`/agent` with the split, `/tool` for its tool).

On the tool listener the address decides, never the token: a token is honoured only when it
names the same tool identity (and sandbox); the agent's token, read from its environment or
/proc, is refused there like any token that disagrees with the address. Fail closed: the tool
listener serves only callers an address source vouches for, whose identity has a tool identity.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from sandgate.errors import Code, IdentityError
from sandgate.identity.base import Caller

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")


class Role(StrEnum):
    AGENT = "agent"  # the proxy, SOCKS5 and gateway listeners: the sandbox's own identity
    TOOL = "tool"  # the bash tool's user inside a split sandbox
    OTHER = "other"  # any other user inside a split sandbox: always refused


ROLE_LISTENERS = (Role.TOOL, Role.OTHER)  # the roles `--role-listen` may name


@dataclass(frozen=True)
class Split:
    """Which listen port is which role, and each agent identity's tool identity."""

    listeners: Mapping[int, Role] = field(default_factory=dict)  # listen port -> role
    tools: Mapping[str, str] = field(default_factory=dict)  # agent identity -> tool identity

    def role(self, listen_port: int | None) -> Role:
        if listen_port is None:
            return Role.AGENT
        return self.listeners.get(listen_port, Role.AGENT)

    def caller(self, role: Role, by_address: Caller | None, client_ip: str) -> Caller | None:
        """The caller a connection on a role listener stands for (AGENT: the address's caller
        unchanged). Raises IdentityError for the other listener and for a tool listener
        connection that no address source vouches for or whose identity has no tool."""
        if role is Role.AGENT:  # audited as the agent of a split sandbox, or as unsplit
            if by_address is None or by_address.split is None or (
                    by_address.identity not in self.tools):
                return by_address
            mark = "agent" if by_address.split else "unsplit"
            return replace(by_address, source=f"{by_address.source}/{mark}")
        where = (f"sandbox '{by_address.sandbox or by_address.identity}' ({client_ip})"
                 if by_address is not None else f"address {client_ip}")
        if role is Role.OTHER:
            raise IdentityError(
                Code.AUTH_INVALID,
                f"a process of {where} that is neither the agent nor its bash tool: the "
                "sandbox's network rules send such traffic here, and it is refused")
        if by_address is None:
            raise IdentityError(
                Code.AUTH_INVALID,
                f"the tool listener serves only sandboxes identified by address; no sandbox "
                f"is known at {client_ip}")
        if by_address.split is False:
            raise IdentityError(
                Code.AUTH_INVALID,
                f"{where} runs without the split; the tool listener serves only split "
                "sandboxes")
        tool = self.tools.get(by_address.identity)
        if tool is None:
            raise IdentityError(
                Code.AUTH_INVALID,
                f"{where} reached the tool listener but identity '{by_address.identity}' has "
                "no tool identity (sandgate run --tool-identity AGENT=TOOL)")
        return replace(by_address, identity=tool, source=f"{by_address.source}/tool")


def parse_role_listen(spec: str) -> tuple[Role, str, int]:
    """`tool=HOST:PORT` or `other=HOST:PORT`. Raises ValueError with a clear message."""
    role, sep, addr = spec.partition("=")
    host, colon, port = addr.rpartition(":")
    if not sep or not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--role-listen {spec!r}: expected ROLE=HOST:PORT, e.g. "
                         "tool=0.0.0.0:8081")
    try:
        parsed = Role(role.strip())
    except ValueError:
        parsed = None
    if parsed not in ROLE_LISTENERS:
        raise ValueError(f"--role-listen {spec!r}: the role must be one of "
                         f"{', '.join(ROLE_LISTENERS)}")
    assert parsed is not None
    return parsed, host.strip("[]") or "0.0.0.0", int(port)


def parse_tool_identity(spec: str, flag: str = "--tool-identity") -> tuple[str, str]:
    """`AGENT=TOOL`: the agent identity's bash tool is identity TOOL."""
    agent, sep, tool = spec.partition("=")
    agent, tool = agent.strip(), tool.strip()
    if not sep or not _NAME.match(agent) or not _NAME.match(tool):
        raise ValueError(f"{flag} {spec!r}: expected AGENT=TOOL (two identity names), "
                         "e.g. coding-agent=coding-agent-tool")
    if agent == tool:
        raise ValueError(f"{flag} {spec!r}: the tool identity must differ from the "
                         "agent's (that is what the split is for)")
    return agent, tool


def split_from(role_listen: Iterable[str], tool_identity: Iterable[str]
               ) -> tuple[Split | None, list[tuple[Role, str, int]]]:
    """The Split of `--role-listen` / `--tool-identity`, and the role listeners to open.
    None when neither is given. Raises ValueError."""
    listens = [parse_role_listen(s) for s in role_listen]
    tools: dict[str, str] = {}
    for spec in tool_identity:
        agent, tool = parse_tool_identity(spec)
        if agent in tools and tools[agent] != tool:
            raise ValueError(f"--tool-identity: '{agent}' is given two tool identities "
                             f"('{tools[agent]}' and '{tool}')")
        tools[agent] = tool
    if not listens and not tools:
        return None, []
    roles = [r for r, _, _ in listens]
    if Role.TOOL not in roles:
        raise ValueError("--tool-identity needs --role-listen tool=HOST:PORT (the listener the "
                         "sandboxes' bash-tool traffic is sent to)")
    if not tools:
        raise ValueError("--role-listen tool=... needs --tool-identity AGENT=TOOL")
    ports: dict[int, Role] = {}
    for role, _, port in listens:
        if port in ports:
            raise ValueError(f"--role-listen: port {port} is given twice")
        ports[port] = role
    return Split(listeners=ports, tools=tools), listens
