"""Transparent capture on the real Docker sandbox network: a sandbox with NO proxy variable
reaches an allowed host with the key injected (curl, Python urllib, Node's fetch, a Go program,
openssl) and gets Sandgate's readable refusal for a denied one; raw TCP to another port and UDP
(DNS to 8.8.8.8 included) go nowhere and are counted by the capture table on the bridge.
"""

from __future__ import annotations

import io
import socket
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandgate.capture import nftables as capture
from sandgate.sandbox import Sandbox, SandboxSpec
from tests.integration.conftest import ANTHROPIC_KEY, HERE, SANDGATE
from tests.integration.docker.conftest import SESSION, TEST_LABEL
from tests.support.capture import NODE_CLIENT, PYTHON_CLIENT, build_go_client, split
from tests.support.pki import make_pki
from tests.support.transparent_docker import (
    curl_gets_the_key,
    transparent_sandgate,
    upstream_on_lo,
)

UPSTREAM, ELSEWHERE = "198.51.100.66", "198.51.100.67"  # on the host's lo for this module
API, DENIED = "api.transparent.test", "denied.transparent.test"
RAW_PORT = 2223


@pytest.fixture(scope="module")
def world(tmp_path_factory, docker_client, sandbox_network, vault) -> Iterator[tuple]:
    tmp = tmp_path_factory.mktemp("tpd")
    pki = make_pki(tmp / "pki", [API, DENIED])
    with upstream_on_lo(UPSTREAM, pki) as up, \
            transparent_sandgate(tmp, HERE / "policies_transparent", vault, pki, docker_client,
                                 sandbox_network, f"--resolve={API}={UPSTREAM}",
                                 f"--resolve={DENIED}={ELSEWHERE}") as p:
        yield p, up, tmp


@pytest.fixture(scope="module")
def sbx(world, docker_client, sandbox_network) -> Iterator[Sandbox]:
    p, _, _ = world
    spec = SandboxSpec(identity="coding-agent", image="sandgate-bash-tool:dev",
                       proxy_url=p.url, ca_pem=p.ca.read_text(), transparent=True,
                       extra_hosts={API: UPSTREAM, DENIED: ELSEWHERE},
                       labels={TEST_LABEL: SESSION})
    s = Sandbox.create(docker_client, spec)
    yield s
    s.close()


def test_no_proxy_variable_in_the_sandbox(sbx):
    r = sbx.exec("env")
    assert "proxy" not in r.stdout.lower(), r.stdout
    assert "SSL_CERT_FILE=" in r.stdout


def test_curl_allowed_and_denied(world, sbx):
    p, up, _ = world
    curl_gets_the_key(sbx, up, f"https://{API}/v1/messages", ANTHROPIC_KEY)
    ev = p.wait_audit(lambda e: e.get("event") == "request" and e.get("host") == API)
    assert ev["identity"] == "coding-agent" and ev["identity_source"] == "docker"
    r = sbx.exec(["curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}",
                  f"https://{DENIED}/x"])
    assert r.stdout.endswith("\n403") and "no_rule" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("client", ["python", "node"])
def test_clients_that_ignore_proxies(world, sbx, client):
    _, up, _ = world
    cmd = (["python3", "-c", PYTHON_CLIENT] if client == "python"
           else ["node", "--input-type=module", "-e", NODE_CLIENT])
    before = len(up.seen)
    r = sbx.exec([*cmd, f"https://{API}/v1/messages"], timeout=60)
    status, _ = split(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert [s.headers.get("x-api-key") for s in up.seen[before:]] == [ANTHROPIC_KEY]
    r = sbx.exec([*cmd, f"https://{DENIED}/x"], timeout=60)
    status, body = split(r.stdout)
    assert status == 403 and "no_rule" in body, r.stdout + r.stderr


def _put(sbx: Sandbox, exe: Path) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(exe), arcname="goclient")
    assert sbx.container.put_archive("/tmp", buf.getvalue())
    return "/tmp/goclient"


def test_go_default_transport(world, sbx):
    _, up, tmp = world
    exe = _put(sbx, build_go_client(tmp / "go"))
    before = len(up.seen)
    r = sbx.exec([exe, f"https://{API}/v1/messages"], timeout=60)
    status, _ = split(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert [s.headers.get("x-api-key") for s in up.seen[before:]] == [ANTHROPIC_KEY]
    r = sbx.exec([exe, f"https://{DENIED}/x"], timeout=60)
    status, body = split(r.stdout)
    assert status == 403 and "no_rule" in body, r.stdout + r.stderr


def test_openssl_s_client(world, sbx):
    _, up, _ = world
    before = len(up.seen)
    r = sbx.exec(["sh", "-c", f"printf 'GET /v1/models HTTP/1.1\\r\\nHost: {API}\\r\\n"
                  "Connection: close\\r\\n\\r\\n' | openssl s_client -quiet "
                  f"-verify_return_error -connect {API}:443 -servername {API}"], timeout=30)
    assert "HTTP/1.1 200" in r.stdout, r.stdout + r.stderr
    assert [s.headers.get("x-api-key") for s in up.seen[before:]] == [ANTHROPIC_KEY]


def test_raw_tcp_and_udp_go_nowhere_and_are_counted(world, sbx, sandbox_network):
    listener = socket.socket()
    listener.bind((UPSTREAM, RAW_PORT))
    listener.listen(4)
    listener.settimeout(0.2)
    try:
        before = capture.counters(sandbox_network.bridge)
        assert before is not None
        r = sbx.exec(["sh", "-c", f"curl -sS --max-time 3 telnet://{UPSTREAM}:{RAW_PORT} "
                      "</dev/null; echo rc=$?; dig +tries=1 +time=2 @8.8.8.8 example.com; "
                      "echo dig=$?"], timeout=30)
        assert "rc=0" not in r.stdout and "ANSWER SECTION" not in r.stdout, r.stdout
        with pytest.raises(OSError):
            listener.accept()
        after = capture.counters(sandbox_network.bridge)
        assert after is not None
    finally:
        listener.close()
    assert after["dropped_tcp"]["packets"] > before["dropped_tcp"]["packets"]
    assert after["dropped_dns"]["packets"] > before["dropped_dns"]["packets"]
    st = subprocess.run([*SANDGATE, "sandbox", "network", "--network", sandbox_network.name,
                         "--status"], capture_output=True, text=True, timeout=60)
    assert st.returncode == 0 and "dropped_dns" in st.stdout, st.stderr


def test_proxy_mode_still_works_beside_capture(world, docker_client, sandbox_network):
    p, up, _ = world
    spec = SandboxSpec(identity="coding-agent", image="sandgate-bash-tool:dev", proxy_url=p.url,
                       ca_pem=p.ca.read_text(), extra_hosts={API: UPSTREAM},
                       labels={TEST_LABEL: SESSION})
    with Sandbox.create(docker_client, spec) as s:
        before = len(up.seen)
        r = s.exec(["curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "-X", "POST",
                    "-d", "{}", f"https://{API}/v1/messages"])
        assert r.stdout.endswith("\n200"), r.stdout + r.stderr
        assert [x.headers.get("x-api-key") for x in up.seen[before:]] == [ANTHROPIC_KEY]
