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
import re
import secrets
import shlex
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.integration.docker.conftest import REPO, host_addresses

pytestmark = [pytest.mark.docker, pytest.mark.integration]

PROJECT = "sandgate-citest"
FILES = ("docker-compose.yml", "docker-compose.ci.yml")
SANDGATE_IP = "172.30.120.2"
HOST_GATEWAY = "172.30.120.1"  # the host's address on the sandbox bridge
VAULT_IP = "172.30.121.5"
FAKE_IP = "172.30.121.20"
BRIDGE = "sandgate-sbx"  # com.docker.network.bridge.name of the sandboxes network
BASH_TOOL_IP = "172.30.120.11"
AGENT_IP = "172.30.120.10"
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
        # the agent service starts as root (its split entrypoint): commands run as the agent
        user = ["-u", "agent"] if service == "agent" else []
        return self.run("exec", "-T", *user, service, *cmd, timeout=timeout, check=False,
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
    try:
        # Nothing is set up on the host by hand: the stack installs its own host firewall.
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
    """No host service answers the sandboxes: not at the bridge's gateway address, not at any
    other host address, not over IPv6 (the sandboxes have none)."""
    with socket.socket(socket.AF_INET6) as listener:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 and IPv6
        listener.bind(("::", 0))
        listener.listen()
        listener.settimeout(0.1)
        port = listener.getsockname()[1]
        targets = [HOST_GATEWAY, *host_addresses()]
        probe = (
            "import json, socket, sys\n"
            "out = {}\n"
            "for h in sys.argv[2:]:\n"
            "    try:\n"
            "        socket.create_connection((h, int(sys.argv[1])), 3).close()\n"
            "        out[h] = 'REACHED'\n"
            "    except OSError as e:\n"
            "        out[h] = 'blocked: ' + type(e).__name__\n"
            "print(json.dumps(out))\n"
        )
        r = stack.exec("agent", "python", "-c", probe, str(port), *targets, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        reached = {h: v for h, v in json.loads(r.stdout).items() if v == "REACHED"}
        assert not reached, f"the agent reached a host service at port {port}: {reached}"
        with pytest.raises(TimeoutError):
            listener.accept()
    v6 = stack.exec("agent", "sh", "-c", "cat /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                    "cat /proc/net/if_inet6")
    assert v6.stdout.split() == ["1"], f"the agent has IPv6: {v6.stdout}"


def _serve_and_probe(stack: Stack, server_svc: str, server_ip: str, client_svc: str) -> str:
    """A server on server_svc's sandbox address (checked from inside it), then a connect from
    client_svc: its stderr (the connection must fail)."""
    server = (
        "import socket, threading, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{server_ip}', 8000)); s.listen()\n"
        "def serve():\n"
        "    while True:\n"
        "        c, _ = s.accept(); c.sendall(b'hello'); c.close()\n"
        "threading.Thread(target=serve, daemon=True).start()\n"
        "c = socket.create_connection(('" + server_ip + "', 8000), 3)\n"
        "print('SELF', c.recv(5).decode(), flush=True)\n"
        "time.sleep(float(__import__('sys').argv[1]))\n"
    )
    user = ["-u", "agent"] if server_svc == "agent" else []
    proc = subprocess.Popen(
        [*stack.compose, "exec", "-T", *user, server_svc, "python3", "-c", server, "25"],
        cwd=REPO, env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # control: the server answers on that address
        assert first.strip() == "SELF hello", (first, proc.stderr.read()
                                                if proc.poll() is not None else "")
        r = stack.exec(client_svc, "python3", "-c",
                       f"import socket; socket.create_connection(('{server_ip}', 8000), 4)",
                       timeout=30)
        assert r.returncode != 0, f"{client_svc} reached a port of the {server_svc} sandbox"
        return r.stderr
    finally:
        proc.kill()
        proc.wait(10)


def test_sandboxes_cannot_reach_each_other(stack: Stack) -> None:
    """Each sandbox serves on its address; the other cannot connect to it. The bridge firewall
    drops it (a timeout); the agent's split rules already reject it inside the agent."""
    err = _serve_and_probe(stack, "agent", AGENT_IP, "bash-tool")
    assert "TimeoutError" in err or "timed out" in err, err[-500:]
    err = _serve_and_probe(stack, "bash-tool", BASH_TOOL_IP, "agent")
    assert "ConnectionRefusedError" in err, err[-500:]


SCAN = """
import select, socket, sys, time
host, found = sys.argv[1], []
ports = list(range(1, 65536))
for i in range(0, len(ports), 4000):  # non-blocking connects in batches: dropped ports time out
    pending = {}
    for port in ports[i:i + 4000]:
        s = socket.socket(); s.setblocking(False)
        s.connect_ex((host, port)); pending[s.fileno()] = (s, port)
    poll, deadline = select.poll(), time.monotonic() + 1.0
    for fd in pending:
        poll.register(fd, select.POLLOUT)
    while pending and time.monotonic() < deadline:
        for fd, _ in poll.poll(100):
            s, port = pending.pop(fd); poll.unregister(fd)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                found.append(port)
            s.close()
    for s, _ in pending.values():
        s.close()
print(sorted(found))
"""


def test_only_the_proxy_port_is_open_on_the_sandbox_network(stack: Stack) -> None:
    r = stack.exec("agent", "python", "-c", SCAN, SANDGATE_IP, timeout=120)
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


def test_agent_bash_tool_is_the_bash_tool_identity(stack: Stack) -> None:
    """The compose agent has the split by default (docs/pattern1.md): what its bash tool runs
    is identity bash-tool, which may not call the LLM API."""
    r = stack.exec("agent", "sandgate-tool", "--", "id -un; curl -sS -m 20 -w '\\n%{http_code}' "
                   "https://api.anthropic.com/v1/messages -d '{}'", timeout=90)
    assert r.stdout.startswith("tool\n"), r.stdout + r.stderr
    assert r.stdout.strip().endswith("403") and '"identity": "bash-tool"' in r.stdout, r.stdout


def test_the_sandgate_image_is_the_proxy_lock_on_debian_13(stack: Stack, tmp_path) -> None:
    """Its SBOM (scripts/sbom-image.py) lists exactly the locked versions, mitmproxy 12.x."""
    from tests.integration.docker.test_image_sbom import image_sbom

    doc, found = image_sbom("sandgate:dev", tmp_path)
    assert doc["metadata"]["component"]["properties"][0]["value"] == "debian 13"
    assert found["deb"]["python3.13"].startswith("3.13.")
    assert found["pypi"]["mitmproxy"].startswith("12.")
    lock = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$",
                           (REPO / "requirements" / "proxy.lock").read_text(), re.M))
    lock = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in lock.items()}
    assert {n: found["pypi"].get(n) for n in lock} == lock
