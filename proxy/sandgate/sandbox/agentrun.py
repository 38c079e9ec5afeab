"""`sandgate sandbox run --agent NAME`: a coding agent in a Docker sandbox, with the process split.

The split without a hook (sandgate.identity.agents) across the container boundary: Sandgate runs
on the Docker host, in the host's PID namespace, as root, so it reads the container's TCP table
and the agent's fds through /proc/HOSTPID (the container's network namespace is the agent's).
The launcher, on the same host, registers the agent's HOST pid in Sandgate's agent directory,
which no process of the sandbox can reach (it is not mounted there). Only that process is the
agent; everything it starts in the sandbox, at any depth, is its tool.

The agent process is held at a gate until it is registered, so its first connection already
finds its registration (an unregistered agent's calls would be refused, fail closed):

    docker exec: timeout ... sh -c 'wait for GATE; exec "$@"' GATE AGENT ARGS...
                         `-- this pid (host view) is registered, then GATE is created: the
                             shell execs the agent's binary in the same process

The registration is removed when the command ends (and pruned by any later registration).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import docker

from sandgate.identity.agents import Registration, trusted, write_registration
from sandgate.identity.sockowner import net_namespace, start_time
from sandgate.sandbox.agent_profiles import CLI_MOUNT, AgentProfile
from sandgate.sandbox.engine import SandboxError
from sandgate.sandbox.launcher import ExecResult, Sandbox, SandboxSpec

# $0 is the gate file; the shell waits for it, then becomes the agent (same pid)
GATE = 'while [ ! -e "$0" ]; do sleep 0.05; done; exec "$@"'
# the home-relative settings files, written as the sandbox's user before the agent starts
_WRITE = 'f="$HOME/$1"; mkdir -p "$(dirname "$f")" && printf "%s" "$2" > "$f"'


def child_of(proc: Path, pid: int) -> int | None:
    """The one child of `pid` (the process `timeout` started), None while it has none.
    Raises SandboxError when it has several: the agent would be ambiguous."""
    try:
        text = (proc / str(pid) / "task" / str(pid) / "children").read_text()
        kids = [int(k) for k in text.split()]
    except OSError:  # a kernel without the children file: scan the parents
        kids = []
        for entry in os.listdir(proc):
            if not entry.isdigit():
                continue
            try:
                stat = (proc / entry / "stat").read_text(errors="replace")
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                kids.append(int(entry))
    if len(kids) > 1:
        raise SandboxError(f"the agent's exec process {pid} has several children: cannot "
                           "tell which one is the agent")
    return kids[0] if kids else None


def wait_agent_pid(client: docker.DockerClient, exec_id: str, proc: Path,
                   timeout: float = 20) -> int:
    """The host pid of the gated agent shell of `exec_id`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.api.exec_inspect(exec_id)
        pid = int(info.get("Pid") or 0)
        if pid and not info.get("Running", True):
            break  # it ended before it could be registered
        if pid:
            kid = child_of(proc, pid)
            if kid is not None:
                return kid
        time.sleep(0.05)
    raise SandboxError("the agent's process did not start in the sandbox, so it could not be "
                       "registered")


def agent_registration(proc: Path, pid: int, container_pid: int, identity: str,
                       tool_identity: str, sandbox: str) -> Registration:
    """The registration of host pid `pid` as the sandbox's agent. Raises SandboxError when this
    host's /proc does not show it in the sandbox's network namespace (the launcher runs in
    another PID namespace than Docker's: the lookup would find nothing, so refuse now)."""
    ns = net_namespace(proc, pid)
    if ns is None or ns != net_namespace(proc, container_pid):
        raise SandboxError(
            f"process {pid} is not in the sandbox's network namespace as this host's /proc "
            "shows it: run the launcher (and Sandgate) in the Docker host's PID namespace, "
            "as root")
    start = start_time(proc, pid)
    if start is None:
        raise SandboxError(f"cannot read the start time of the agent's process {pid}")
    return Registration(pid, start, identity, tool_identity, sandbox)


def run_agent(client: docker.DockerClient, spec: SandboxSpec, profile: AgentProfile,
              tool_identity: str, cmd: Sequence[str], *, agent_dir: Path,
              cli_mount: str | None = None, timeout: float = 600,
              proc: Path = Path("/proc")) -> ExecResult:
    """Start a sandbox, run `cmd` in it as the registered agent (identity spec.identity; what
    it starts: tool_identity), remove the sandbox. Raises SandboxError."""
    if spec.split is not None:
        raise SandboxError("--agent is the process split: it does not combine with --pattern1 "
                           "(the uid split needs the agent to route its tool through "
                           "sandgate-tool)")
    try:
        if not trusted(os.stat(agent_dir), os.geteuid()):
            raise SandboxError(f"--agent-dir {agent_dir}: another user may write it (chmod go-w "
                               f"{agent_dir}; owned by root or Sandgate's user)")
    except OSError as e:
        raise SandboxError(f"--agent-dir {agent_dir}: {e.strerror} (create it: install -d -m "
                           f"0755 {agent_dir})") from None
    argv = profile.argv(cmd, cli_mount if cli_mount is not None else
                        (CLI_MOUNT if CLI_MOUNT in spec.mounts.values() else None))
    if not argv:
        raise SandboxError(f"sandbox run --agent {profile.name}: no command after --")
    with Sandbox.create(client, spec) as sbx:
        for rel, content in profile.files.items():
            r = sbx.exec(["sh", "-c", _WRITE, "write", rel, content], timeout=30)
            if not r.ok:
                raise SandboxError(f"could not write ~/{rel} in the sandbox: {r.stderr[-300:]}")
        sbx.container.reload()
        container_pid = int(sbx.container.attrs["State"]["Pid"])
        # in the sandbox, not on this host; it only releases the agent, nothing trusts it
        gate = f"/tmp/.sandgate-agent-{secrets.token_hex(8)}"  # noqa: S108
        registered: list[Path] = []

        def register(exec_id: str) -> None:
            pid = wait_agent_pid(client, exec_id, proc)
            registered.append(write_registration(agent_dir, agent_registration(
                proc, pid, container_pid, spec.identity, tool_identity, sbx.id)))
            opened = sbx.container.exec_run(["touch", gate])
            if opened.exit_code != 0:
                raise SandboxError(f"could not release the agent (exit {opened.exit_code})")

        try:
            return sbx.exec(["sh", "-c", GATE, gate, *argv], timeout=timeout,
                            on_start=register)
        finally:
            for path in registered:
                try:
                    path.unlink()
                except OSError:
                    pass
