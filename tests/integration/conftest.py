"""Real parts for integration tests: OpenBao, TLS upstreams on loopback, the sandgate CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandgate.secrets.devserver import DevVault
from tests.support.bao import SeedableVault
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret
from tests.support.upstream import UpstreamServer

HERE = Path(__file__).parent
UPSTREAM_IP = "127.0.0.2"
OLD_SERVER_IP = "127.0.0.10"  # an HTTP/1.0 server (Python's http.server), see test_clients.py
NAMES = ["api.anthropic.com", "api.openai.com", "upstream.test", "*.upstream.test", "old.test",
         "inside.test", "meta.test", "plain.test", "other.test", "tunnel.test",
         "*.r2.test",  # the side-channel servers (tests/support/proxy_stack.py)
         "*.wire.test"]  # tests/integration/test_wire.py
# Obvious fakes: what the upstream must see and no sandbox, log or output may contain.
ANTHROPIC_KEY = "test-anthropic-REAL-key-7f3a9c1e5b"
OPENAI_KEY = "test-openai-REAL-key-2d8e4f6a0c"
GITHUB_TOKEN = "test-github-REAL-token-91b7c3"
SECRET_VALUES = (ANTHROPIC_KEY, OPENAI_KEY, GITHUB_TOKEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):
    # names only, no IP SAN: upstream TLS must verify the name although Sandgate dials the IP
    return make_pki(tmp_path_factory.mktemp("pki"), NAMES)


@pytest.fixture(scope="session")
def upstream(pki) -> Iterator[UpstreamServer]:
    server = UpstreamServer(UPSTREAM_IP, 443, str(pki.cert), str(pki.key)).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_upstream() -> Iterator[UpstreamServer]:
    server = UpstreamServer(UPSTREAM_IP, 80, None, None).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vault() -> Iterator[DevVault]:
    v = SeedableVault()
    v.start()
    v.put_kv2("llm/anthropic", {"api_key": ANTHROPIC_KEY})
    v.put_kv2("llm/openai", {"api_key": OPENAI_KEY})
    v.enable_kv1("kv")
    v.put_kv1("ci/github", {"token": GITHUB_TOKEN})
    yield v
    v.stop()


@dataclass
class Proxy:
    host: str
    port: int
    confdir: Path
    audit_file: Path
    log_file: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def token(self, identity: str, ttl: str = "1h", sandbox: str | None = None) -> str:
        cmd = [*SANDGATE, "token", "issue", "--confdir", str(self.confdir),
               "--identity", identity, "--ttl", ttl]
        if sandbox:
            cmd += ["--sandbox", sandbox]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    def proxy_url(self, identity: str) -> str:
        return f"http://{identity}:{self.token(identity)}@{self.host}:{self.port}"

    def audit(self) -> list[dict]:
        """The events, without the audit log's own signed checkpoints (docs/audit.md)."""
        if not self.audit_file.exists():
            return []
        events = (json.loads(line) for line in self.audit_file.read_text().splitlines() if line)
        return [e for e in events if e.get("event") != "checkpoint"]

    def wait_audit(self, pred, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in reversed(self.audit()):
                if pred(ev):
                    return ev
            time.sleep(0.05)
        raise AssertionError("no matching audit event")

    def logs(self) -> str:
        return self.log_file.read_text(errors="replace")


SANDGATE = [sys.executable, "-m", "sandgate.cli"]


def start_proxy(tmp: Path, policies: Path, vault_env: dict[str, str], pki, *extra: str,
                listen_host: str = "127.0.0.1", start_timeout: float = 30) -> Proxy:
    port = free_port()
    confdir = tmp / "conf"
    audit = tmp / "audit.jsonl"
    log = tmp / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAULT_")}
    env.update(vault_env)
    resolve = [f"--resolve={n}={UPSTREAM_IP}" for n in
               ("api.anthropic.com", "api.openai.com", "upstream.test", "a.upstream.test",
                "plain.test", "other.test", "tunnel.test", "nocert.test")]
    resolve += ["--resolve=inside.test=10.1.2.3", "--resolve=meta.test=169.254.169.254",
                f"--resolve=old.test={OLD_SERVER_IP}"]
    # One process unless the test asks for workers (tests/integration/test_workers.py): the
    # other suites assert single-process facts (one shutdown event, exact metric deltas).
    workers = [] if "--workers" in extra else ["--workers", "1"]
    cmd = [*SANDGATE, "run", "--policies", str(policies), "--listen", f"{listen_host}:{port}",
           "--confdir", str(confdir), "--audit", str(audit), "--upstream-ca", str(pki.ca_cert),
           *resolve, *workers, *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=str(HERE.parent.parent))
    p = Proxy(listen_host, port, confdir, audit, log, proc)
    # workers are N interpreters starting at once: give them longer on a loaded machine
    deadline = time.monotonic() + (start_timeout if workers else max(start_timeout, 120))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sandgate exited {proc.returncode}:\n{p.logs()[-3000:]}")
        try:
            with socket.create_connection((listen_host, port), timeout=0.5):
                return p
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sandgate did not listen:\n{p.logs()[-3000:]}")


def stop_proxy(p: Proxy) -> None:
    p.proc.terminate()
    try:
        p.proc.wait(10)
    except subprocess.TimeoutExpired:
        p.proc.kill()


@pytest.fixture(scope="session")
def proxy(tmp_path_factory, vault, upstream, plain_upstream, pki) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("proxy")
    p = start_proxy(tmp, HERE / "policies", {"VAULT_ADDR": vault.addr,
                                              "VAULT_TOKEN": vault.root_token}, pki)
    yield p
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the proxy's logs or audit")


@pytest.fixture(scope="module")
def proxy_stack(tmp_path_factory, vault):
    """A factory of running proxies for one test module: `proxy_stack(name, pki, policy=...,
    resolve=..., admin=..., ...)` (tests/support/proxy_stack.py, start_stack) gives a
    ProxyStack; what a test module started is stopped and checked for secrets after it."""
    from tests.support.proxy_stack import stack_factory  # it imports this module

    yield from stack_factory(tmp_path_factory, vault)


def curl(proxy: Proxy, identity: str | None, url: str, *args: str,
         token: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["curl", "-sS", "--max-time", "15", "--proxy", proxy.url, "--cacert", str(proxy.ca),
           "-w", "\n%{http_code}", url, *args]
    if identity is not None:
        cmd[1:1] = ["--proxy-user", f"{identity}:{token or proxy.token(identity)}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def split_status(out: str) -> tuple[str, int]:
    body, _, code = out.rpartition("\n")
    return body, int(code or 0)
