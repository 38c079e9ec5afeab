"""Pattern 1 without a hook in the agent: the agent's own process is the agent, all else its tool.

`sandgate agent run --identity A --tool-identity T -- CMD` (sandgate.cli.agent) writes a
registration for its own pid into the agent directory, then execs CMD: the agent is exactly that
process (pid and start time). `sandgate run --agent-dir DIR --agent-split A=T` reads the
registrations. For each client connection it looks the client's socket up in the registered
agents' network namespaces (sandgate.identity.sockowner):

    the socket is held by the agent's process (any of its threads)  -> identity A
    the socket is in an agent's namespace, held by any other process -> identity T
      (the agent's children at any depth, re-executed agent binaries: a new pid is a new process)
    the socket is in no registered agent's namespace                 -> not decided here

The token the connection sends does not choose: a token that names another identity than the
owner's is refused (auth_invalid), as on the Docker split's tool listener. Fail closed: an
identity `--agent-split` names as an agent is given ONLY through this lookup; a connection whose
owner cannot be found (not in the table, an orphan socket, a process gone) never gets it, whatever
token it sends.

Registrations are trusted only from a directory and files that no other user can write: the
directory and each file must belong to root or to Sandgate's own user and not be writable by
group or others (see docs/pattern1.md for what the split rests on).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sandgate.errors import Code, IdentityError
from sandgate.identity.base import Caller
from sandgate.identity.roles import parse_tool_identity
from sandgate.identity.sockowner import (
    Endpoint,
    Unreadable,
    holds,
    net_namespace,
    socket_inode,
    start_time,
)

log = logging.getLogger("sandgate")

SOURCE_AGENT = "process/agent"
SOURCE_TOOL = "process/tool"
_MAX_REGISTRATION = 4096  # bytes of one registration file
_MAX_REGISTRATIONS = 1024  # files read from the directory per lookup (the launcher prunes)


@dataclass(frozen=True, slots=True)
class Registration:
    pid: int
    start: int  # /proc/PID/stat start time: the pid names this process, not a later one
    identity: str
    tool_identity: str
    sandbox: str | None = None

    def to_json(self) -> str:
        doc = {"pid": self.pid, "start": self.start, "identity": self.identity,
               "tool_identity": self.tool_identity, "sandbox": self.sandbox}
        return json.dumps(doc, sort_keys=True) + "\n"


def parse_registration(text: str) -> Registration:
    """A registration file's content. Raises ValueError."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("a registration is a JSON object")
    pid, start = doc.get("pid"), doc.get("start")
    identity, tool, sandbox = doc.get("identity"), doc.get("tool_identity"), doc.get("sandbox")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError("`pid` must be a positive integer")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError("`start` must be a non-negative integer")
    if not isinstance(identity, str) or not isinstance(tool, str) or not identity or not tool:
        raise ValueError("`identity` and `tool_identity` must be identity names")
    if sandbox is not None and not isinstance(sandbox, str):
        raise ValueError("`sandbox` must be a string")
    return Registration(pid, start, identity, tool, sandbox)


def trusted(st: os.stat_result, own_uid: int) -> bool:
    """Only root or Sandgate's own user may have written it, and nobody else may change it."""
    return st.st_uid in (0, own_uid) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


@dataclass(frozen=True)
class AgentProcesses:
    """The agent directory and which identities are agents (`--agent-split AGENT=TOOL`)."""

    directory: Path
    tools: Mapping[str, str]  # agent identity -> its tool identity
    proc: Path = Path("/proc")

    def registered(self) -> list[Registration]:
        """The live registrations: trusted files whose process still runs (same start time)
        and whose identities match --agent-split. Others are skipped, with a warning."""
        own = os.geteuid()
        try:
            if not trusted(os.stat(self.directory), own):
                log.warning("sandgate: agent directory %s is writable by another user: no "
                            "agent is registered (chmod go-w, owned by root or Sandgate's "
                            "user)", self.directory)
                return []
            names = sorted(os.listdir(self.directory))[:_MAX_REGISTRATIONS]
        except OSError as e:
            log.warning("sandgate: agent directory %s: %s", self.directory, e.strerror)
            return []
        out = []
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            reg = self._read(self.directory / name, own)
            if reg is None or str(reg.pid) != name[:-5]:
                continue
            if start_time(self.proc, reg.pid) != reg.start:
                continue  # the agent has exited (a later process may have its pid)
            if self.tools.get(reg.identity) != reg.tool_identity:
                log.warning("sandgate: agent registration %s names identity '%s' with tool "
                            "identity '%s', which --agent-split does not: ignored", name,
                            reg.identity, reg.tool_identity)
                continue
            out.append(reg)
        return out

    def _read(self, path: Path, own: int) -> Registration | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not trusted(st, own):
                log.warning("sandgate: agent registration %s is not a regular file that "
                            "only root or Sandgate's user can write: ignored", path)
                return None
            text = os.read(fd, _MAX_REGISTRATION + 1)
            if len(text) > _MAX_REGISTRATION:
                return None
            return parse_registration(text.decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.warning("sandgate: agent registration %s: %s: ignored", path, e)
            return None
        finally:
            os.close(fd)

    def identify(self, peer: Endpoint, local: Endpoint) -> Caller | None:
        """The caller a connection stands for, by the process that holds its socket; None
        when the connection is in no registered agent's network namespace. Raises
        IdentityError when that namespace's agents have different tool identities."""
        namespaces: dict[str, list[Registration]] = {}
        for reg in self.registered():
            ns = net_namespace(self.proc, reg.pid)
            if ns is not None:
                namespaces.setdefault(ns, []).append(reg)
        for regs in namespaces.values():
            inode = socket_inode(self.proc, regs[0].pid, peer, local)
            if inode is None:
                continue
            for reg in regs:
                try:
                    held = holds(self.proc, reg.pid, inode)
                except Unreadable as e:  # fail closed, and say how to fix it
                    raise IdentityError(
                        Code.AUTH_INVALID,
                        f"Sandgate cannot read the fds of agent process {reg.pid} ({e}), so "
                        "it cannot tell the agent from its tool: run Sandgate as root or with "
                        "CAP_SYS_PTRACE") from None
                if held and start_time(self.proc, reg.pid) == reg.start:
                    return Caller(reg.identity, reg.sandbox, SOURCE_AGENT)
            tools = {reg.tool_identity for reg in regs}
            if len(tools) != 1:
                raise IdentityError(
                    Code.AUTH_INVALID,
                    f"a process that is not a registered agent, in a network namespace shared "
                    f"by agents with different tool identities ({', '.join(sorted(tools))}): "
                    "give each agent its own network namespace")
            sandboxes = {reg.sandbox for reg in regs}
            return Caller(tools.pop(), sandboxes.pop() if len(sandboxes) == 1 else None,
                          SOURCE_TOOL)
        return None

    def refuse_unowned(self, caller: Caller, peer: Endpoint | None) -> None:
        """Fail closed: an agent identity is given only to its registered process (`peer`:
        the connection's client end; None: a way in without one)."""
        if caller.identity in self.tools:
            who = (f"the process behind {peer.address}:{peer.port} is not one" if peer
                   else "this way in has no client socket to look up")
            raise IdentityError(
                Code.AUTH_INVALID,
                f"identity '{caller.identity}' is given only to its registered agent process "
                f"(sandgate agent run), and {who}: start the agent with `sandgate agent run`, "
                "in the same network namespace as Sandgate's listener or routed to it without "
                "NAT")


def write_registration(directory: Path, reg: Registration) -> Path:
    """Register `reg` in the agent directory (atomically, mode 0644: only its writer, root or
    Sandgate's user, may change it). Used by `sandgate agent run` (its own pid) and by the Docker
    launcher (the agent's host pid). Raises OSError."""
    path = directory / f"{reg.pid}.json"
    tmp = directory / f".{reg.pid}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(reg.to_json())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def agents_from(directory: Path | None, specs: Iterable[str]) -> AgentProcesses | None:
    """The AgentProcesses of `--agent-dir` / `--agent-split`; None when neither is given.
    Raises ValueError."""
    tools: dict[str, str] = {}
    for spec in specs:
        agent, tool = parse_tool_identity(spec, "--agent-split")
        if tools.get(agent, tool) != tool:
            raise ValueError(f"--agent-split: '{agent}' is given two tool identities "
                             f"('{tools[agent]}' and '{tool}')")
        tools[agent] = tool
    if directory is None and not tools:
        return None
    if directory is None:
        raise ValueError("--agent-split needs --agent-dir DIR (where `sandgate agent run` "
                         "registers the agent processes)")
    if not tools:
        raise ValueError("--agent-dir needs --agent-split AGENT=TOOL (which identities are "
                         "agents, and their tools' identities)")
    if not directory.is_dir():
        raise ValueError(f"--agent-dir {directory}: not a directory (create it: install -d "
                         f"-m 0755 {directory})")
    if not trusted(directory.stat(), os.geteuid()):
        raise ValueError(f"--agent-dir {directory}: another user may write it; it must "
                         f"belong to root or Sandgate's user (chmod go-w {directory})")
    return AgentProcesses(directory, tools)


def prune(directory: Path, proc: Path = Path("/proc")) -> list[Path]:
    """Remove the registrations of agents that have exited (their pid gone, or reused by a
    process with another start time) and unreadable ones; returns what was removed. The
    launcher runs it before it registers, so the directory holds about the live agents."""
    removed = []
    for path in directory.glob("*.json"):
        try:
            reg = parse_registration(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            reg = None
        if reg is not None and start_time(proc, reg.pid) == reg.start:
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed
