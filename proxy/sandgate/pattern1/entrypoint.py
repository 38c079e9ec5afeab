"""The split sandbox's entrypoint: root, before anything untrusted runs.

    sandgate-split-entrypoint [CMD ARGS...]      (default CMD: sleep infinity)

1. trusts the Sandgate CA the launcher put in /usr/local/share/ca-certificates (or the compose
   file's /etc/sandgate/ca/sandgate-ca.pem);
2. replaces the namespace's iptables rules (sandgate.pattern1.rules), routes every address at the
   gateway (an internal network has no default route) and checks the rules are in place;
3. opens the runner's socket (root:agent 0660 in /run/sandgate, 0750) and starts the runner
   (sandgate.pattern1.toolrunner) with only CAP_SETUID/SETGID/SETPCAP/KILL, reparented to init;
4. writes /run/sandgate/split (what was applied: the launcher waits for it);
5. execs CMD as the agent user with setpriv: no capability (bounding set empty), no new
   privileges, umask 002 (files are shared with the tool through the `workspace` group).

Any failure before 5 exits non-zero: the sandbox does not run unsplit by accident (the runner
is asked to run `true` as the tool before the agent starts). There is no way to switch the split
off here: an unsplit sandbox is the image without this entrypoint, which Sandgate audits as such
(docs/pattern1.md).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence

from sandgate.pattern1.rules import (
    AGENT_USER,
    ENV_SPLIT,
    TOOL_USER,
    SplitConfigError,
    applied,
    iptables_v4,
    iptables_v6,
    split_net,
)
from sandgate.pattern1.toolrunner import RunnerError, drop_to, run_tool

RUN_DIR = "/run/sandgate"
SOCKET = f"{RUN_DIR}/runner.sock"
STATE = f"{RUN_DIR}/split"
CA_PEM = "/etc/sandgate/ca/sandgate-ca.pem"  # the compose file's ca-public volume
CA_DIR = "/usr/local/share/ca-certificates"  # where the launcher puts it (sandgate.proxyenv)
RUNNER_CAPS = "-all,+setuid,+setgid,+setpcap,+kill"




def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    res = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise SplitConfigError(f"{argv[0]} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def trust_ca() -> None:
    """The Sandgate CA into the system store: the launcher's copy (already in the store's
    directory) or the compose file's (its ca-public volume)."""
    if os.path.exists(CA_PEM):
        os.makedirs(CA_DIR, exist_ok=True)
        shutil.copyfile(CA_PEM, f"{CA_DIR}/sandgate-compose.crt")
    if os.path.isdir(CA_DIR) and any(n.endswith(".crt") for n in os.listdir(CA_DIR)):
        _run(["update-ca-certificates"])


def apply_rules(env: dict[str, str]) -> dict[str, object]:
    net = split_net(env, pwd.getpwnam(AGENT_USER).pw_uid, pwd.getpwnam(TOOL_USER).pw_uid)
    _run(["iptables-restore"], iptables_v4(net))
    try:
        _run(["ip6tables-restore"], iptables_v6())
    except SplitConfigError:
        with open("/proc/sys/net/ipv6/conf/all/disable_ipv6") as f:
            if f.read().strip() != "1":
                raise
    # An internal network has no default route, so a connection to any other address would fail
    # before the nat hook could send it to Sandgate (and be audited there): route everything at
    # the gateway; the rules decide what leaves, and where to.
    if not _run(["ip", "-4", "route", "show", "default"]).strip():
        _run(["ip", "-4", "route", "add", "default", "via", net.gateway])
    missing = applied(_run(["iptables-save"]), net)
    if missing:
        raise SplitConfigError(f"the split rules are not in place (missing {missing})")
    return {"split": "uid", "gateway": net.gateway, "agent_ports": list(net.agent_ports),
            "tool_port": net.tool_port, "other_port": net.other_port,
            "agent_uid": net.agent_uid, "tool_uid": net.tool_uid}


def open_socket() -> socket.socket:
    agent_gid = grp.getgrnam(AGENT_USER).gr_gid
    os.makedirs(RUN_DIR, exist_ok=True)
    os.chown(RUN_DIR, 0, agent_gid)
    os.chmod(RUN_DIR, 0o750)  # noqa: S103 - root and the agent group only, by design
    if os.path.exists(SOCKET):
        os.unlink(SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(SOCKET)
    finally:
        os.umask(old)
    os.chown(SOCKET, 0, agent_gid)
    os.chmod(SOCKET, 0o660)
    sock.listen(16)
    return sock


def start_runner(sock: socket.socket) -> None:
    """The runner, detached (double fork: init adopts it, the agent is not its parent)."""
    argv = [*drop_to("root", caps=RUNNER_CAPS), sys.executable, "-m",
            "sandgate.pattern1.toolrunner", "--fd", str(sock.fileno()), "serve"]
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.set_inheritable(sock.fileno(), True)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.execvp(argv[0], argv)  # noqa: S606 - a fixed argv, no shell wanted
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv) or ["sleep", "infinity"]
    env = dict(os.environ)
    try:
        if os.geteuid() != 0:
            raise SplitConfigError("the entrypoint must start as root (it drops to the agent)")
        if env.get(ENV_SPLIT, "uid") != "uid":
            raise SplitConfigError(f"{ENV_SPLIT} must be 'uid' (run the image without this "
                                   "entrypoint for no split)")
        trust_ca()
        state = apply_rules(env)
        start_runner(open_socket())
        check = run_tool(["true"], 30, "/", SOCKET)
        if check.get("exit_code") != 0:
            raise SplitConfigError(f"the tool runner does not work: {check}")
        with open(STATE, "w") as f:
            json.dump(state, f)
    except (SplitConfigError, RunnerError, OSError, KeyError, subprocess.SubprocessError) as e:
        print(f"sandgate-split: not starting: {e}", file=sys.stderr)
        return 1
    os.umask(0o002)
    os.chdir(env.get("SANDGATE_WORKDIR", "/workspace"))
    os.execvp("setpriv", [*drop_to(AGENT_USER), *cmd])  # noqa: S606 - the agent's CMD
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
