"""`sandgate agent run`: start an agent whose own process alone has the agent's identity.

It registers its own pid (and start time) in the agent directory, optionally drops to
`--user`, and execs the command: the agent is this very process, so no other process can be
registered in its place afterwards, and everything it starts is a new pid, identified as the
tool (sandgate.identity.agents). Sandgate reads the directory (`sandgate run --agent-dir DIR
--agent-split AGENT=TOOL`).

It refuses to start where the split would not hold, unless told so explicitly:
- without Yama's ptrace_scope >= 1 the agent's children may ptrace it (same user) and make its
  process open connections for them (--allow-ptrace);
- when the agent runs as a user that may write the agent directory (root, or the directory's
  owner), its children may register themselves (--allow-same-user).
"""

from __future__ import annotations

import argparse
import os
import pwd
import sys
from pathlib import Path
from typing import Any

from sandgate.cli.common import err
from sandgate.identity.agents import Registration, prune, trusted, write_registration
from sandgate.identity.roles import parse_tool_identity
from sandgate.identity.sockowner import start_time

DEFAULT_AGENT_DIR = Path("/run/sandgate/agents")
YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


def register(sub: Any) -> None:
    agent = sub.add_parser("agent", help="run an agent with the split and no hook in it "
                           "(docs/pattern1.md)")
    asub = agent.add_subparsers(dest="agent_command", required=True)
    run = asub.add_parser(
        "run", help="register this process as the agent and exec CMD: only CMD's own process "
        "is the agent; everything it starts is the tool identity")
    run.add_argument("--identity", required=True, help="the agent's identity")
    run.add_argument("--tool-identity", required=True,
                     help="the identity of every process the agent starts (must match "
                     "sandgate run --agent-split)")
    run.add_argument("--agent-dir", type=Path,
                     default=Path(os.environ.get("SANDGATE_AGENT_DIR", DEFAULT_AGENT_DIR)),
                     metavar="DIR", help="Sandgate's --agent-dir (default $SANDGATE_AGENT_DIR "
                     f"or {DEFAULT_AGENT_DIR})")
    run.add_argument("--sandbox", default=None, help="a sandbox name for the audit")
    run.add_argument("--user", default=None, metavar="USER",
                     help="run the agent as this user (name or uid; needs root): a user that "
                     "cannot write the agent directory")
    run.add_argument("--allow-ptrace", action="store_true",
                     help="start even without Yama ptrace_scope >= 1 (the agent's children "
                     "could then drive its process)")
    run.add_argument("--allow-same-user", action="store_true",
                     help="start even if the agent's user may write the agent directory (its "
                     "children could then register themselves)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                     help="the agent's command; it runs as this process (the registered pid)")
    agent.set_defaults(handler=cmd_agent)


def cmd_agent(args: argparse.Namespace) -> int:
    return _run(args)  # `run` is the only agent command (argparse requires it)


def ptrace_scope(path: Path = YAMA) -> int | None:
    """Yama's ptrace_scope, None without Yama (then any process may trace its user's)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _user(spec: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except KeyError:
        raise ValueError(f"--user {spec!r}: no such user") from None


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        return err("agent run: give the agent's command after --, e.g. sandgate agent run "
                   "--identity coding-agent --tool-identity bash-tool -- claude -p 'hi'")
    try:
        agent, tool = parse_tool_identity(f"{args.identity}={args.tool_identity}",
                                          "--identity/--tool-identity")
        user = _user(args.user) if args.user is not None else None
        scope = ptrace_scope()
        if (scope is None or scope < 1) and not args.allow_ptrace:
            raise ValueError(
                "kernel.yama.ptrace_scope is " + ("absent" if scope is None else str(scope)) +
                ": the agent's children could ptrace the agent and open connections as it. "
                "Set it to 1 (sysctl kernel.yama.ptrace_scope=1) or pass --allow-ptrace")
        directory: Path = args.agent_dir
        st = directory.stat()
        if not trusted(st, os.geteuid()):
            raise ValueError(f"--agent-dir {directory}: another user may write it (chmod go-w "
                             f"{directory}; owned by root or Sandgate's user)")
        uid = user.pw_uid if user is not None else os.geteuid()
        if uid in (0, st.st_uid) and not args.allow_same_user:
            raise ValueError(
                f"the agent would run as uid {uid}, which may write {directory}: the processes "
                "it starts could register themselves as the agent. Pass --user (a user that "
                "cannot write it) or --allow-same-user")
    except (ValueError, OSError) as e:
        return err(f"agent run: {e}")
    prune(directory)  # the registrations of agents that have exited
    pid = os.getpid()
    start = start_time(Path("/proc"), pid)
    if start is None:
        return err("agent run: cannot read this process's start time from /proc")
    try:
        path = write_registration(directory, Registration(pid, start, agent, tool,
                                                          args.sandbox))
    except OSError as e:
        return err(f"agent run: cannot register in {directory}: {e.strerror}")
    try:
        if user is not None:
            os.initgroups(user.pw_name, user.pw_gid)
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        sys.stdout.flush()
        sys.stderr.flush()
        # this process becomes the agent: its pid is the registered one
        os.execvp(cmd[0], cmd)  # noqa: S606 (the operator's command, as given)
    except OSError as e:
        try:
            path.unlink()
        except OSError:
            pass
        print(f"sandgate: agent run: cannot start {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
