"""The demo's moving parts, all local and temporary: an OpenBao dev server seeded with the demo
secrets, the stand-in LLM API, and `sandgate run` with the demo policy, in one temporary
directory. `demo_stack()` starts them in that order and stops them in reverse, whatever happens
(an error, Ctrl-C, SIGTERM), then removes the directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sandgate.demo.upstream import EchoUpstream
from sandgate.secrets.devserver import DevVault, die_with_parent, free_port, seed_demo

API_HOST = "llm.demo.test"  # .test: a name that can never be someone else's host
DEMO_SECRET = ("llm/anthropic", "api_key")  # seeded by seed_demo: an obviously fake value

POLICY = """\
# The demo policy: the agent may call the stand-in LLM API, with the key injected by Sandgate;
# the bash tool (code the agent generated) may only read the package index.
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key, hosts: [{host}]}}
identities:
  coding-agent:
    rules:
      - name: llm
        hosts: [{host}]
        ports: [{port}]
        methods: [POST]
        paths: [/v1/messages]
        private_cidrs: [127.0.0.1/32]   # the stand-in runs on loopback
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
  bash-tool:
    narrower_than: coding-agent
    rules:
      - {{name: packages, hosts: [pypi.org, files.pythonhosted.org], methods: [GET, HEAD]}}
"""


@dataclass
class Stack:
    root: Path
    policies: Path
    confdir: Path
    audit: Path
    proxy: tuple[str, int]
    api_port: int
    vault: DevVault
    resolve: dict[str, str]

    @property
    def api_url(self) -> str:
        return f"https://{API_HOST}:{self.api_port}"


def _wait_listening(proc: subprocess.Popen[bytes], addr: tuple[str, int], log: Path,
                    timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sandgate exited with {proc.returncode} at start:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(addr, timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"sandgate did not listen on {addr[0]}:{addr[1]} within {timeout:.0f}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # drains (at most --drain-timeout), then exits
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the cleanup below runs for it too."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller handles its own signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def demo_stack() -> Iterator[Stack]:
    with _sigterm_unwinds(), contextlib.ExitStack() as cleanup:
        root = Path(tempfile.mkdtemp(prefix="sandgate-demo-"))
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        # Each child in a process group of its own: a terminal's Ctrl-C reaches the demo alone,
        # which stops them in order (below). Had it reached them too, the proxy could close a
        # request the tour was making before the demo saw the interrupt, which then read as a
        # failure (exit 1) instead of an interruption (130).
        vault = DevVault(own_process_group=True)
        cleanup.callback(vault.cleanup)
        vault.start()
        seed_demo(vault)
        api = EchoUpstream(root / "api-pki", API_HOST)
        cleanup.callback(api.stop)
        api.start()
        policies = root / "policies"
        policies.mkdir()
        (policies / "demo.yaml").write_text(POLICY.format(host=API_HOST, port=api.port))
        proxy = ("127.0.0.1", free_port())
        confdir, audit, log = root / "confdir", root / "audit.jsonl", root / "sandgate.log"
        resolve = {API_HOST: "127.0.0.1"}
        cmd = [sys.executable, "-m", "sandgate.cli", "run", "--policies", str(policies),
               "--confdir", str(confdir), "--listen", f"{proxy[0]}:{proxy[1]}",
               "--workers", "1", "--no-watch", "--drain-timeout", "2", "--log-format", "text",
               "--resolve", f"{API_HOST}={resolve[API_HOST]}", "--upstream-ca",
               str(api.ca_cert), "--audit", str(audit)]
        # Only the dev Vault: no Vault or proxy settings of the caller's environment apply.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VAULT_", "BAO_")) and not k.lower().endswith("_proxy")}
        env.update(VAULT_ADDR=vault.addr, VAULT_TOKEN=vault.root_token)
        with log.open("ab") as logf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=logf, env=env, preexec_fn=die_with_parent(),
                                    process_group=0)
        cleanup.callback(_stop, proc)
        _wait_listening(proc, proxy, log)
        yield Stack(root=root, policies=policies, confdir=confdir, audit=audit, proxy=proxy,
                    api_port=api.port, vault=vault, resolve=resolve)
