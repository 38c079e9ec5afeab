"""Sandboxes on the internal network: no way out but the host's gateway address, the proxy env
and CA in place, no secret inside, limits applied, nothing left behind."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from sandgate.identity.docker_labels import DockerLabelSource
from sandgate.sandbox import (
    DockerUnavailable,
    Sandbox,
    SandboxError,
    SandboxSpec,
    connect,
    ensure_network,
    run_once,
)
from sandgate.sandbox import launcher as launcher_mod
from sandgate.sandbox.launcher import CA_BUNDLE, CA_FILE, LABEL_IDENTITY, LABEL_SANDBOX
from sandgate.sandbox.network import SandboxNetwork, inspect_network
from tests.integration.conftest import SECRET_VALUES
from tests.integration.docker.conftest import (
    CA_SUBJECT,
    SESSION,
    TEST_LABEL,
    host_addresses,
    host_default_ip,
)

Spec = Callable[..., SandboxSpec]


@pytest.fixture
def sandbox(docker_client: docker.DockerClient, make_spec: Spec) -> Iterator[Sandbox]:
    with Sandbox.create(docker_client, make_spec()) as sbx:
        yield sbx


class TcpListener:
    """A TCP listener on every host address; records who connected."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.peers: list[tuple[str, str]] = []  # (peer, local address it came in on)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append((peer[0], conn.getsockname()[0]))
            conn.sendall(b"hello-from-host\n")
            conn.close()

    def close(self) -> None:
        self.sock.close()


class UdpListener:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[tuple[bytes, str]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(2048)
            except OSError:
                return
            self.received.append((data, peer[0]))
            self.sock.sendto(b"pong", peer)

    def close(self) -> None:
        self.sock.close()


PROBE = r"""
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor

def attempt(target):
    host, port, proto = target
    try:
        if proto == "tcp":
            with socket.create_connection((host, port), timeout=4) as s:
                s.settimeout(4)
                return "ok:" + s.recv(100).decode().strip()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.sendto(b"ping-from-sandbox", (host, port))
            return "ok:" + s.recv(100).decode()
    except OSError as e:
        return "fail:" + type(e).__name__ + ":" + str(e)

targets = [tuple(t) for t in json.loads(sys.argv[1])]
with ThreadPoolExecutor(len(targets)) as pool:
    outcomes = list(pool.map(attempt, targets))
print(json.dumps({f"{p}:{h}:{n}": o for (h, n, p), o in zip(targets, outcomes)}))
"""


def probe(sandbox: Sandbox, targets: list[tuple[str, int, str]]) -> dict[str, str]:
    res = sandbox.exec(["python3", "-c", PROBE, json.dumps(targets)], timeout=60)
    assert res.exit_code == 0, res.stderr
    return dict(json.loads(res.stdout))


def test_network_is_internal_isolated_and_idempotent(
    docker_client: docker.DockerClient, sandbox_network: SandboxNetwork
) -> None:
    attrs = docker_client.api.inspect_network(sandbox_network.name)
    assert attrs["Internal"] is True
    assert attrs["Options"].get("com.docker.network.bridge.enable_icc") == "false"
    assert attrs["Labels"].get("sandgate.network") == "sandboxes"
    assert sandbox_network.subnet == "172.30.99.0/24"
    assert sandbox_network.gateway == "172.30.99.1"
    assert ensure_network(docker_client) == sandbox_network.gateway  # idempotent
    assert inspect_network(docker_client).id == sandbox_network.id


def test_refuses_a_network_that_is_not_internal(docker_client: docker.DockerClient) -> None:
    name = f"sandgate-test-open-{SESSION}"
    docker_client.networks.create(name, driver="bridge", labels={TEST_LABEL: SESSION})
    try:
        with pytest.raises(SandboxError, match="not internal"):
            ensure_network(docker_client, name=name, subnet="172.30.98.0/24")
    finally:
        docker_client.api.remove_network(name)


def test_no_route_out_only_the_proxy_port_of_the_gateway(
    docker_client: docker.DockerClient, make_spec: Spec, sandbox_network: SandboxNetwork
) -> None:
    proxy = TcpListener()  # stands in for Sandgate: the port of the sandbox's proxy_url
    service = TcpListener()  # any other service on the host
    try:
        spec = make_spec(proxy_url=f"http://{sandbox_network.gateway}:{proxy.port}")
        with Sandbox.create(docker_client, spec) as sandbox:
            host_ips = sorted(set(host_addresses()) - {sandbox_network.gateway})
            assert host_default_ip() in host_ips
            targets = [(sandbox_network.gateway, proxy.port, "tcp"),
                       (sandbox_network.gateway, service.port, "tcp")]
            targets += [(ip, port, "tcp") for ip in host_ips for port in (proxy.port, service.port)]
            targets += [("1.1.1.1", 80, "tcp")]  # cannot leave: no NAT, FORWARD drops it
            results = probe(sandbox, targets)
            sandbox_ip = sandbox.ip
    finally:
        proxy.close()
        service.close()
    gw_key = f"tcp:{sandbox_network.gateway}:{proxy.port}"
    assert results.pop(gw_key) == "ok:hello-from-host", "control: the proxy port must be reachable"
    for key, outcome in results.items():
        assert outcome.startswith("fail:"), f"{key} reachable from a sandbox: {outcome}"
    # the only connection the host saw came from the sandbox to the proxy port of the gateway
    assert proxy.peers == [(sandbox_ip, sandbox_network.gateway)]
    assert service.peers == []


def test_curl_without_proxy_fails(sandbox: Sandbox) -> None:
    res = sandbox.exec("curl --noproxy '*' -sS -m 5 http://1.1.1.1/", timeout=30)
    assert res.exit_code != 0, res.stdout


def test_outside_dns_fails(sandbox: Sandbox) -> None:
    # The sandbox's resolver (Docker's embedded DNS) cannot forward: the query is dropped.
    # Short resolver timeouts keep the test fast; the path is the same.
    res = sandbox.exec("getent hosts example.com", timeout=60,
                       env={"RES_OPTIONS": "timeout:2 attempts:1"})
    assert res.exit_code != 0 and not res.timed_out, (res.stdout, res.stderr)
    assert res.stdout.strip() == ""


def test_udp_goes_nowhere(sandbox: Sandbox, sandbox_network: SandboxNetwork) -> None:
    udp = UdpListener()
    try:
        host_ips = sorted(set(host_addresses()) - {sandbox_network.gateway})
        targets = [(ip, udp.port, "udp") for ip in host_ips]
        targets += [("1.1.1.1", 53, "udp"), (sandbox_network.gateway, udp.port, "udp")]
        results = probe(sandbox, targets)
    finally:
        udp.close()
    # Not even to the gateway: the host accepts only the proxy's TCP port from sandboxes.
    for key, outcome in results.items():
        assert outcome.startswith("fail:"), f"{key}: {outcome}"
    assert udp.received == []


def test_sandboxes_cannot_reach_each_other(
    docker_client: docker.DockerClient, make_spec: Spec
) -> None:
    with Sandbox.create(docker_client, make_spec()) as a, \
            Sandbox.create(docker_client, make_spec()) as b:
        a.exec("nohup python3 -m http.server 8000 >/dev/null 2>&1 &", timeout=10)
        ok = a.exec("for i in $(seq 50); do curl -s --noproxy '*' -o /dev/null "
                    "http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; exit 1", timeout=30)
        assert ok.exit_code == 0, "control: the server runs inside sandbox a"
        res = b.exec(f"curl --noproxy '*' -sS -m 4 http://{a.ip}:8000/", timeout=30)
        assert res.exit_code != 0, res.stdout


def test_proxy_env_and_ca(sandbox: Sandbox, ca_pem: str, sandbox_network: SandboxNetwork) -> None:
    env = dict(
        line.split("=", 1) for line in sandbox.exec("env", timeout=10).stdout.splitlines()
        if "=" in line
    )
    proxy = f"http://bash-tool:sg1.test-payload.test-mac@{sandbox_network.gateway}:8080"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        assert env[var] == proxy
        assert env[var.lower()] == proxy
    assert env["NO_PROXY"] == "" and env["no_proxy"] == ""
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
                "CURL_CA_BUNDLE"):
        assert env[var] == CA_BUNDLE
    assert env["NODE_EXTRA_CA_CERTS"] == CA_FILE
    assert env["SANDGATE_IDENTITY"] == "bash-tool"
    assert env["SANDGATE_SANDBOX"] == sandbox.id

    assert sandbox.exec(["cat", CA_FILE], timeout=10).stdout.strip() == ca_pem.strip()
    # the system bundle (and so OpenSSL, curl, git, pip, requests, httpx) trusts it
    check = sandbox.exec(["python3", "-c", (
        "import ssl, os\n"
        "ctx = ssl.create_default_context(cafile=os.environ['SSL_CERT_FILE'])\n"
        "names = [dict(x[0] for x in c['subject']).get('commonName') for c in ctx.get_ca_certs()]\n"
        f"assert {CA_SUBJECT!r} in names, names\n"
        "dflt = ssl.create_default_context()\n"
        "names = [dict(x[0] for x in c['subject']).get('commonName') "
        "for c in dflt.get_ca_certs()]\n"
        "print(len(names))\n"
    )], timeout=30)
    assert check.exit_code == 0, check.stderr
    # public roots are still there (it is a bundle, not only our CA)
    assert int(sandbox.exec(f"grep -c 'BEGIN CERTIFICATE' {CA_BUNDLE}", timeout=10)
               .stdout) > 50


def test_no_secret_inside(docker_client: docker.DockerClient, make_spec: Spec) -> None:
    spec = make_spec(image="sandgate-agent:dev", identity="coding-agent")
    with Sandbox.create(docker_client, spec) as sbx:
        inspected = docker_client.api.inspect_container(sbx.container.id)
        config_env = inspected["Config"]["Env"]
        everything = sbx.exec(
            "env; grep -rIl -e " + " -e ".join(SECRET_VALUES)
            + " /etc /home /workspace /tmp /root /opt/agent/bin 2>/dev/null; true",
            timeout=60, user="root",
        ).stdout
        for value in SECRET_VALUES:
            assert value not in everything
            assert value not in json.dumps(inspected)
        env = dict(item.split("=", 1) for item in config_env)
        assert env["ANTHROPIC_API_KEY"] == "sandgate-placeholder-anthropic"
        assert env["OPENAI_API_KEY"] == "sandgate-placeholder-openai"
        for name, value in env.items():
            if any(word in name.upper() for word in ("KEY", "SECRET", "PASSWORD", "TOKEN")):
                assert value.startswith("sandgate-placeholder-"), name
        # the agent image: SDKs importable, non-root
        res = sbx.exec(["python", "-c", "import anthropic, openai, os; print(os.getuid())"],
                       timeout=60)
        assert res.exit_code == 0, res.stderr
        assert res.stdout.strip() != "0"


def test_bash_tool_image(sandbox: Sandbox) -> None:
    res = sandbox.exec("id -u; pwd; for t in bash curl git python3 pip; do command -v $t; done; "
                       "pip --version", timeout=30)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] != "0"
    assert lines[1] == "/workspace"


def test_files_persist_between_exec_calls(sandbox: Sandbox) -> None:
    assert sandbox.exec("echo persisted > note.txt && mkdir -p d && echo x > d/y", timeout=10).ok
    res = sandbox.exec(["cat", "/workspace/note.txt", "/workspace/d/y"], timeout=10)
    assert res.stdout == "persisted\nx\n"
    assert sandbox.exec("cd /tmp && pwd", workdir="/tmp", timeout=10).stdout == "/tmp\n"
    err = sandbox.exec("echo out; echo err >&2; exit 3", timeout=10)
    assert (err.exit_code, err.stdout, err.stderr) == (3, "out\n", "err\n")


def test_exec_timeout(sandbox: Sandbox) -> None:
    res = sandbox.exec("echo started; sleep 30", timeout=2)
    assert res.timed_out and res.exit_code == 124
    assert res.stdout == "started\n"
    assert res.duration < 10
    assert sandbox.exec("echo alive", timeout=10).stdout == "alive\n"


def test_limits_and_hardening(docker_client: docker.DockerClient, make_spec: Spec,
                              sandbox_network: SandboxNetwork) -> None:
    spec = make_spec(memory="256m", cpus=0.5, pids_limit=64)
    with Sandbox.create(docker_client, spec) as sbx:
        attrs = docker_client.api.inspect_container(sbx.container.id)
        host = attrs["HostConfig"]
        assert host["Memory"] == 256 * 1024 * 1024
        assert host["NanoCpus"] == 500_000_000
        assert host["PidsLimit"] == 64
        assert host["CapDrop"] == ["ALL"]
        assert not host.get("CapAdd")
        assert "no-new-privileges:true" in host["SecurityOpt"]
        assert host["Privileged"] is False
        assert host["NetworkMode"] == sandbox_network.name
        assert list(attrs["NetworkSettings"]["Networks"]) == [sandbox_network.name]
        assert attrs["Config"]["Labels"][LABEL_IDENTITY] == "bash-tool"
        assert attrs["Config"]["Labels"][LABEL_SANDBOX] == sbx.id
        assert not attrs["HostConfig"].get("Binds") and not attrs["Mounts"]
        status = sbx.exec("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status", timeout=10).stdout
        assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
        # the pids limit holds
        res = sbx.exec("for i in $(seq 100); do sleep 3 & done; wait", timeout=30)
        assert "Resource temporarily unavailable" in res.stderr or "fork" in res.stderr


def test_unknown_image(docker_client: docker.DockerClient, make_spec: Spec) -> None:
    with pytest.raises(SandboxError, match=r"image 'sandgate-nope:dev' not found; build it with "
                                           r"sandbox_images/build\.sh"):
        Sandbox.create(docker_client, make_spec(image="sandgate-nope:dev"))


def _session_containers(client: docker.DockerClient) -> list[Any]:
    return list(client.containers.list(all=True, filters={"label": f"{TEST_LABEL}={SESSION}"}))


def test_failed_create_leaves_nothing(docker_client: docker.DockerClient, make_spec: Spec,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    before = {c.id for c in _session_containers(docker_client)}
    # A real Docker failure after the container exists: the CA archive is not a tar.
    monkeypatch.setattr(launcher_mod, "_ca_archive", lambda pem: b"this is not a tar archive")
    with pytest.raises(SandboxError):
        Sandbox.create(docker_client, make_spec(sandbox_id="sbx-fail-archive"))
    monkeypatch.undo()

    # A failure inside our own steps (CA install exits non-zero).
    real_exec = Sandbox.exec

    def failing_exec(self: Sandbox, cmd: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("user") == "root":
            return launcher_mod.ExecResult(1, "", "simulated failure")
        return real_exec(self, cmd, *args, **kwargs)

    monkeypatch.setattr(Sandbox, "exec", failing_exec)
    with pytest.raises(SandboxError, match="simulated failure"):
        Sandbox.create(docker_client, make_spec(sandbox_id="sbx-fail-ca"))
    monkeypatch.undo()

    # Docker refuses the container itself.
    with pytest.raises(SandboxError):
        Sandbox.create(docker_client, make_spec(memory="1m"))

    after = {c.id for c in _session_containers(docker_client)}
    assert after == before
    for name in ("sandgate-sbx-fail-archive", "sandgate-sbx-fail-ca"):
        with pytest.raises(NotFound):
            docker_client.containers.get(name)


def test_run_once_and_close(docker_client: docker.DockerClient, make_spec: Spec) -> None:
    res = run_once(docker_client, make_spec(sandbox_id="sbx-once"), "echo hi; hostname")
    assert (res.exit_code, res.stdout) == (0, "hi\nsbx-once\n")
    with pytest.raises(NotFound):
        docker_client.containers.get("sandgate-sbx-once")
    # run_once removes the sandbox even when the command cannot run
    with pytest.raises(SandboxError):
        run_once(docker_client, make_spec(sandbox_id="sbx-once-bad"), [])
    with pytest.raises(NotFound):
        docker_client.containers.get("sandgate-sbx-once-bad")
    sbx = Sandbox.create(docker_client, make_spec())
    sbx.close()
    sbx.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        sbx.exec("true")


def test_spec_validation(make_spec: Spec) -> None:
    for bad in (
        {"identity": "has space"},
        {"proxy_url": "http://user:pw@172.30.99.1:8080"},
        {"proxy_url": "172.30.99.1:8080"},
        {"ca_pem": "nope"},
        {"ca_pem": "-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----"},
        {"placeholders": {"HTTPS_PROXY": "x"}},
        {"labels": {"sandgate.identity": "other"}},
    ):
        with pytest.raises(SandboxError):
            make_spec(**bad).validate()
    token = make_spec(token="a/b:c@d")
    assert token.proxy_url_with_token().startswith("http://bash-tool:a%2Fb%3Ac%40d@")


def test_docker_unavailable() -> None:
    with pytest.raises(DockerUnavailable,
                       match=r"Docker is not running or not reachable at unix:///nonexistent"):
        connect("unix:///nonexistent/docker.sock")
    source = DockerLabelSource(["sandgate-sandboxes"], base_url="unix:///nonexistent/docker.sock")
    with pytest.raises(DockerUnavailable, match="not running or not reachable"):
        source.start()


def test_exec_backstop_when_a_process_escapes_timeout(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher_mod, "_EXEC_GRACE", 1)
    res = sandbox.exec("setsid sleep 60 &", timeout=1)  # its own session keeps stdout open
    assert res.timed_out  # bash itself exited 0; the escaped child held the output open
    assert res.duration < 6
    assert sandbox.exec("echo still usable", timeout=10).stdout == "still usable\n"
