"""The tool runner: executes the agent's tool commands as the tool user, and its client.

    python3 -m sandgate.pattern1.toolrunner serve --fd N         (the entrypoint starts it)
    sandgate-tool [--timeout S] [--cwd DIR] -- COMMAND...        (the agent; a string: bash -c)

The runner is root with only CAP_SETUID/SETGID/SETPCAP/KILL and serves one Unix socket,
/run/sandgate/runner.sock (root:agent 0660), so only the agent (and root) can reach it; it also
checks the peer's uid (SO_PEERCRED). Each request is one JSON line
{"cmd": str | [str...], "timeout": seconds, "cwd": dir}; the answer one JSON line
{"exit_code", "stdout", "stderr", "timed_out"}. The command runs through setpriv as the tool user
(its groups: `workspace`, the shared directory's), no capability, no new privileges, umask 002,
under coreutils `timeout`, with the tool's environment: every proxy variable points at Sandgate's
tool listener and nothing carries the agent's proxy credentials. The agent cannot become the tool
user or root by itself: no sudo and no setuid binary in the image, and no capability.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

SOCKET = "/run/sandgate/runner.sock"
MAX_REQUEST = 1024 * 1024
OUTPUT_LIMIT = 4 * 1024 * 1024  # per stream; the rest is dropped (and said so)
MAX_TIMEOUT = 3600.0
DEFAULT_TIMEOUT = 120.0
CONCURRENCY = 8


class RunnerError(RuntimeError):
    """The request could not be run (bad request, runner unreachable)."""


def tool_argv(drop: Sequence[str], cmd: str | Sequence[str], timeout: float, cwd: str
              ) -> list[str]:
    """The argv the runner executes: drop to the tool user, then chdir (as the tool: its
    permissions decide), then the command under `timeout`."""
    if isinstance(cmd, str):
        argv = ["bash", "-c", cmd]
    else:
        argv = [str(a) for a in cmd]
    if not argv or not argv[0]:
        raise RunnerError("empty command")
    secs = max(1, int(min(timeout, MAX_TIMEOUT) + 0.999))
    return [*drop, "env", f"--chdir={cwd}", "timeout", "--kill-after=5", str(secs), *argv]


def parse_request(raw: bytes) -> tuple[str | list[str], float, str]:
    try:
        req = json.loads(raw)
    except ValueError as e:
        raise RunnerError(f"the request is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise RunnerError("the request must be a JSON object")
    cmd = req.get("cmd")
    if not (isinstance(cmd, str) and cmd) and not (
            isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd)):
        raise RunnerError("cmd must be a non-empty string or list of strings")
    timeout = req.get("timeout", DEFAULT_TIMEOUT)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise RunnerError("timeout must be a positive number of seconds")
    cwd = req.get("cwd", "/workspace")
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise RunnerError("cwd must be an absolute path")
    return cmd, float(timeout), cwd


def read_line(conn: socket.socket, limit: int) -> bytes:
    """Bytes up to a newline or the end of the stream; RunnerError past `limit` bytes."""
    raw = b""
    while not raw.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        raw += chunk
        if len(raw) > limit:
            raise RunnerError("the message is too large")
    return raw


def _read(f: Any) -> str:
    f.seek(0)
    data = f.read(OUTPUT_LIMIT + 1)
    text = data[:OUTPUT_LIMIT].decode("utf-8", "replace")
    if len(data) > OUTPUT_LIMIT:
        text += "\n[sandgate-tool: output truncated]"
    return str(text)


class Runner:
    def __init__(self, agent_uid: int, drop: Sequence[str], env: Mapping[str, str]) -> None:
        self.agent_uid = agent_uid
        self.drop = list(drop)
        self.env = dict(env)
        self.slots = threading.BoundedSemaphore(CONCURRENCY)

    def run(self, cmd: str | list[str], timeout: float, cwd: str) -> dict[str, Any]:
        argv = tool_argv(self.drop, cmd, timeout, cwd)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=self.env, cwd="/", umask=0o002)
            try:
                code = proc.wait(timeout=min(timeout, MAX_TIMEOUT) + 15)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            return {"exit_code": code, "stdout": _read(out), "stderr": _read(err),
                    "timed_out": code in (124, 137)}

    def handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
                _, uid, _ = struct.unpack("3i", creds)
                if uid not in (self.agent_uid, 0):
                    raise RunnerError(f"uid {uid} may not use the runner")
                cmd, timeout, cwd = parse_request(read_line(conn, MAX_REQUEST))
                with self.slots:
                    answer = self.run(cmd, timeout, cwd)
            except (RunnerError, OSError, subprocess.SubprocessError) as e:
                answer = {"error": str(e)}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass

    def serve(self, sock: socket.socket) -> None:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()


def run_tool(cmd: str | Sequence[str], timeout: float = DEFAULT_TIMEOUT,
             cwd: str = "/workspace", path: str = SOCKET) -> dict[str, Any]:
    """Ask the runner to run `cmd` as the tool user; its answer (exit_code, stdout, stderr,
    timed_out). Raises RunnerError when the runner is unreachable or refuses."""
    request = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout, "cwd": cwd}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(min(timeout, MAX_TIMEOUT) + 30)
            s.connect(path)
            s.sendall(json.dumps(request).encode() + b"\n")
            raw = read_line(s, 4 * OUTPUT_LIMIT)
    except OSError as e:
        raise RunnerError(f"the tool runner at {path} is not reachable: {e}") from e
    try:
        answer = json.loads(raw)
    except ValueError:
        raise RunnerError("the tool runner's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise RunnerError("the tool runner's answer is not a JSON object")
    if "error" in answer:
        raise RunnerError(f"the tool runner refused: {answer['error']}")
    return answer


def drop_to(user: str, *, caps: str = "-all") -> list[str]:
    """setpriv argv that becomes `user` (its groups too) keeping only `caps` in the bounding
    set; -all: none at all, and no ambient or inheritable ones either way."""
    pw = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
            "--inh-caps=-all", f"--bounding-set={caps}", "--no-new-privs", "--"]


def _serve(fd: int) -> int:
    from sandgate.pattern1.rules import (
        AGENT_USER,
        TOOL_USER,
        proxy_secrets,
        split_net,
        tool_environment,
    )

    agent, tool = pwd.getpwnam(AGENT_USER), pwd.getpwnam(TOOL_USER)
    net = split_net(os.environ, agent.pw_uid, tool.pw_uid)
    env = tool_environment(os.environ, net, tool.pw_dir, proxy_secrets(os.environ))
    sock = socket.socket(fileno=fd)
    Runner(agent.pw_uid, drop_to(TOOL_USER), env).serve(sock)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sandgate-tool",
                                description="run a command as the bash tool's user")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    p.add_argument("--cwd", default=None)
    p.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd == ["serve"] and args.fd is not None:
        return _serve(args.fd)
    if not cmd:
        p.error("no command")
    try:
        res = run_tool(cmd[0] if len(cmd) == 1 else cmd, args.timeout,
                       args.cwd or os.getcwd())
    except RunnerError as e:
        print(f"sandgate-tool: {e}", file=sys.stderr)
        return 125
    sys.stdout.write(str(res.get("stdout", "")))
    sys.stderr.write(str(res.get("stderr", "")))
    code = res.get("exit_code")
    return code if isinstance(code, int) and code >= 0 else 125


if __name__ == "__main__":
    sys.exit(main())
