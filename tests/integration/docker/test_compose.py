"""The docker-compose deployment end to end, with the CI override (no internet needed).

`sandbox_images/build-compose.sh --ci` builds every image from the local base; the stack runs as
project `sandgate-citest` with docker-compose.ci.yml (a fake api.anthropic.com on the egress
network) and is ALWAYS torn down (`down -v --remove-orphans`), also on failure.

The seeded Anthropic key is random per run and obviously fake; the test never prints it. The fake
upstream logs only the SHA-256 of the x-api-key it receives.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.integration.docker.conftest import REPO

pytestmark = [pytest.mark.docker, pytest.mark.integration]

PROJECT = "sandgate-citest"
FILES = ("docker-compose.yml", "docker-compose.ci.yml")
SANDGATE_IP = "172.30.120.2"
HOST_GATEWAY = "172.30.120.1"  # the host's address on the sandbox bridge
VAULT_IP = "172.30.121.5"
FAKE_IP = "172.30.121.20"
BRIDGE = "sandgate-sbx"  # com.docker.network.bridge.name of the sandboxes network
FIREWALL_RULE = ("INPUT", "-i", BRIDGE, "-j", "DROP")  # what the README tells hosts to add
PLACEHOLDER = "sandgate-placeholder-anthropic"

ANTHROPIC_SCRIPT = """
import anthropic
client = anthropic.Anthropic(max_retries=0)
msg = client.messages.create(model="claude-test", max_tokens=8,
                             messages=[{"role": "user", "content": "hi"}])
print("TEXT:", msg.content[0].text)
"""


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass
class Stack:
    compose: list[str]  # e.g. ["docker-compose", "-p", PROJECT, "-f", ..., "-f", ...]
    anthropic_key: str
    openai_key: str
    env: dict[str, str]
    extra_secrets: list[str] = field(default_factory=list)  # AppRole ids, root token

    @property
    def secrets(self) -> list[str]:
        return [self.anthropic_key, self.openai_key, *self.extra_secrets]

    def run(self, *args: str, timeout: float = 120, check: bool = True,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([*self.compose, *args], cwd=REPO, env=self.env, text=True,
                             capture_output=True, timeout=timeout, input=input_text)
        if check and res.returncode != 0:
            pytest.fail(f"compose {' '.join(args)[:200]} failed (exit {res.returncode}):\n"
                        f"{self.scrub(res.stdout[-3000:])}\n{self.scrub(res.stderr[-3000:])}",
                        pytrace=False)
        return res

    def exec(self, service: str, *cmd: str, timeout: float = 60,
             input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.run("exec", "-T", service, *cmd, timeout=timeout, check=False,
                        input_text=input_text)

    def logs(self, *services: str) -> str:
        return self.run("logs", "--no-color", *services, check=False).stdout

    def container_id(self, service: str) -> str:
        cid = self.run("ps", "-q", service).stdout.strip()
        assert cid, f"no container for service {service}"
        return cid

    def scrub(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "<SECRET>")
        return text


def _find_compose(build_output: str) -> list[str]:
    for line in reversed(build_output.splitlines()):
        if line.startswith("COMPOSE="):
            return shlex.split(line.removeprefix("COMPOSE="))
    pytest.fail(f"build-compose.sh printed no COMPOSE= line:\n{build_output[-3000:]}",
                pytrace=False)


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("iptables")
    assert exe, "iptables is needed for the host firewall of the compose sandbox network"
    return subprocess.run([exe, "-w", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def stack(docker_client) -> Iterator[Stack]:  # docker_client: engine + base + sandbox images
    t0 = time.monotonic()
    build = subprocess.run([str(REPO / "sandbox_images/build-compose.sh"), "--ci"], cwd=REPO,
                           capture_output=True, text=True, timeout=1200)
    if build.returncode != 0:
        pytest.fail(f"build-compose.sh failed (exit {build.returncode}):\n{build.stdout[-4000:]}"
                    f"\n{build.stderr[-4000:]}", pytrace=False)
    print(f"build-compose.sh: {time.monotonic() - t0:.1f} s")
    files = [a for f in FILES for a in ("-f", str(REPO / f))]
    s = Stack(
        compose=[*_find_compose(build.stdout), "-p", PROJECT, *files],
        anthropic_key=f"sk-ant-FAKE-citest-{secrets.token_hex(16)}",
        openai_key=f"sk-FAKE-citest-{secrets.token_hex(16)}",
        env={},
    )
    s.env = {**os.environ, "SANDGATE_DEMO_ANTHROPIC_KEY": s.anthropic_key,
             "SANDGATE_DEMO_OPENAI_KEY": s.openai_key}
    down = ("down", "-v", "--remove-orphans", "--timeout", "5")
    s.run(*down, timeout=180, check=False)  # leftovers of an aborted run
    added_rule = _iptables("-C", *FIREWALL_RULE).returncode != 0
    try:
        if added_rule:
            res = _iptables("-I", *FIREWALL_RULE[:1], "1", *FIREWALL_RULE[1:])
            assert res.returncode == 0, f"iptables: {res.stderr}"
        t1 = time.monotonic()
        up = s.run("up", "-d", timeout=300, check=False)
        if up.returncode != 0:
            pytest.fail(f"compose up failed:\n{s.scrub(up.stderr[-3000:])}\n"
                        f"{s.scrub(s.logs()[-6000:])}", pytrace=False)
        print(f"compose up: {time.monotonic() - t1:.1f} s")
        ids = s.exec("sandgate", "sh", "-c", "cat /var/lib/sandgate/approle/role_id; echo; "
                     "cat /var/lib/sandgate/approle/secret_id")
        assert ids.returncode == 0, "sandgate cannot read its AppRole credentials"
        s.extra_secrets = [v for v in ids.stdout.split() if v]
        s.extra_secrets.append("sandgate-dev-root-token")  # last: see test_no_secret_in_any_log
        assert len(s.extra_secrets) == 3
        yield s
    finally:
        res = s.run(*down, timeout=180, check=False)
        if added_rule:
            _iptables("-D", *FIREWALL_RULE)
        assert res.returncode == 0, f"compose down failed: {s.scrub(res.stderr[-2000:])}"


def test_agent_calls_llm_with_placeholder_and_upstream_gets_the_seeded_key(stack: Stack) -> None:
    r = stack.exec("agent", "python", "-c", ANTHROPIC_SCRIPT, timeout=90)
    assert r.returncode == 0, stack.scrub(r.stderr[-3000:])
    assert "TEXT: hello from the test upstream" in r.stdout
    fake = stack.logs("fake-anthropic")
    assert f"FAKE-UPSTREAM POST /v1/messages x-api-key-sha256={_sha(stack.anthropic_key)}" in fake
    assert _sha(PLACEHOLDER) not in fake, "the placeholder reached the upstream"
    audit = stack.logs("sandgate")
    assert '"identity": "coding-agent"' in audit and '"secrets": ["anthropic@' in audit


def test_agent_holds_no_secret(stack: Stack) -> None:
    agent = stack.container_id("agent")
    inspect = subprocess.run(
        ["docker", "inspect", "--format",
         "{{range .Config.Env}}{{println .}}{{end}}{{range .Mounts}}"
         "MOUNT {{.Type}} {{.Name}} {{.Destination}} rw={{.RW}}{{println}}{{end}}", agent],
        capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"ANTHROPIC_API_KEY={PLACEHOLDER}" in inspect
    mounts = sorted(line for line in inspect.splitlines() if line.startswith("MOUNT "))
    assert mounts == [f"MOUNT volume {PROJECT}_ca-public /etc/sandgate/ca rw=false"], mounts
    r = stack.exec("agent", "sh", "-c",
                   "env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                   "cat /etc/sandgate/ca/*.pem; ls -la /etc/sandgate/ca")
    assert r.returncode == 0, r.stderr
    blob = inspect + r.stdout + r.stderr
    assert "PRIVATE KEY" not in blob, "the sandbox can read a private key"
    leaked = [i for i, s in enumerate(stack.secrets) if s in blob]
    assert not leaked, f"secret #{leaked} in the agent's environment or CA volume"
    # The whole filesystem, scanned on the host: the values never enter the container.
    needles = [s.encode() for s in stack.secrets]
    hits: list[str] = []
    with subprocess.Popen(["docker", "export", agent], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                f = tar.extractfile(member) if member.isfile() else None
                if f is not None:
                    data = f.read()
                    hits += [member.name for n in needles if n in data]
    assert proc.returncode == 0
    assert not hits, f"a secret value is in the agent's filesystem: {hits[:5]}"


REACH_SCRIPT = """
import concurrent.futures, json, socket, sys

def resolve(name):
    return socket.getaddrinfo(name, 443, proto=socket.IPPROTO_TCP)[0][4][0]

def connect(host, port):
    socket.create_connection((host, port), 4).close()
    return "connected"

checks = {
    "resolve vault": (resolve, "vault"),
    "resolve an outside name (DNS out)": (resolve, "example.com"),
    "vault direct": (connect, sys.argv[1], 8200),
    "fake upstream direct": (connect, sys.argv[2], 443),
    "outside direct": (connect, "1.1.1.1", 443),
}
with concurrent.futures.ThreadPoolExecutor(len(checks)) as pool:
    futures = {k: pool.submit(fn, *a) for k, (fn, *a) in checks.items()}
    out = {}
    for k, f in futures.items():
        try:
            out[k] = "REACHED " + str(f.result())
        except OSError as e:
            out[k] = "blocked: " + type(e).__name__
print(json.dumps(out))
"""


def test_agent_cannot_reach_vault_or_the_outside(stack: Stack) -> None:
    r = stack.exec("agent", "python", "-c", REACH_SCRIPT, VAULT_IP, FAKE_IP, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout)
    reached = {k: v for k, v in results.items() if not v.startswith("blocked")}
    assert not reached, f"the agent got through: {reached}"
    # Through the proxy, vault is refused (an internal address no rule names).
    r = stack.exec("agent", "curl", "-sS", "-m", "10", "-o", "/dev/null", "-w", "%{http_code}",
                   "http://vault:8200/v1/sys/health")
    assert r.stdout.strip() == "403", (r.stdout, r.stderr)


def test_agent_cannot_reach_the_host(stack: Stack) -> None:
    """The host firewall rule (README) in place: nothing on the host answers the sandboxes."""
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        listener.settimeout(0.1)
        port = listener.getsockname()[1]
        r = stack.exec("agent", "python", "-c",
                       f"import socket; socket.create_connection(('{HOST_GATEWAY}', {port}), 4)",
                       timeout=30)
        assert r.returncode != 0, f"the agent reached a host port at {HOST_GATEWAY}:{port}"
        with pytest.raises(TimeoutError):
            listener.accept()


def test_only_the_proxy_port_is_open_on_the_sandbox_network(stack: Stack) -> None:
    scan = (
        "import socket\n"
        "found = []\n"
        "for port in range(1, 65536):\n"
        "    s = socket.socket(); s.settimeout(0.5)\n"
        f"    if s.connect_ex(('{SANDGATE_IP}', port)) == 0: found.append(port)\n"
        "    s.close()\n"
        "print(found)\n"
    )
    r = stack.exec("agent", "python", "-c", scan, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[8080]"


def test_bash_tool_is_refused_the_llm_call(stack: Stack) -> None:
    r = stack.exec("bash-tool", "curl", "-sS", "-w", "\\n%{http_connect} %{http_code}",
                   "-m", "20", "https://api.anthropic.com/v1/messages",
                   "-H", f"x-api-key: {PLACEHOLDER}", "-H", "content-type: application/json",
                   "-d", "{}")
    body, _, codes = r.stdout.rpartition("\n")
    connect_status, _, status = codes.partition(" ")
    # Refused at CONNECT, or (Sandgate answering inside the tunnel) on the request itself.
    if connect_status != "403":
        assert status == "403", (r.stdout, r.stderr)
        assert '"no_rule"' in body, body
    audit = [line for line in stack.logs("sandgate").splitlines()
             if '"identity": "bash-tool"' in line and '"host": "api.anthropic.com"' in line]
    assert audit and all('"decision": "deny"' in line and '"code": "no_rule"' in line
                         for line in audit), audit


def test_no_secret_in_any_log(stack: Stack) -> None:
    # Not the dev root token: the dev server prints it at start, by design (demo only).
    text = stack.logs()
    leaked = [i for i, s in enumerate(stack.secrets[:4]) if s in text]
    assert not leaked, f"secret #{leaked} in the compose logs"
