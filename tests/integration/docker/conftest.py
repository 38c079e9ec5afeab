"""Real Docker for the sandbox tests: the engine, the local base image, the sandbox images.

Nothing here skips: without a usable Docker engine every test in this directory fails, loudly,
with the output of the setup script that could not provide one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from sandgate.sandbox import SandboxSpec, connect
from sandgate.sandbox.network import SandboxNetwork, ensure_network_info
from tests.support.pki import make_pki

REPO = Path(__file__).resolve().parents[3]
TEST_LABEL = "test.sandgate.session"
SESSION = uuid.uuid4().hex[:10]
CA_SUBJECT = "sandgate test upstream CA"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)
            item.add_marker(pytest.mark.integration)


def _script(args: list[str], timeout: float) -> None:
    t0 = time.monotonic()
    try:
        res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(args)} did not finish within {timeout} s:\n{exc.stdout}\n"
                    f"{exc.stderr}", pytrace=False)
    if res.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} failed (exit {res.returncode}); Docker tests need a working Docker "
            f"engine and the sandbox images:\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}",
            pytrace=False,
        )
    print(f"{' '.join(args)}: {time.monotonic() - t0:.1f} s\n{res.stdout}")


def docker_with_images(*images: str) -> Iterator[docker.DockerClient]:
    """A live Docker client with sandgate-base and these sandbox images (build.sh targets;
    none: all) built; containers labelled with this session are removed afterwards."""
    if os.environ.get("SANDGATE_SKIP_DOCKER_SETUP") != "1":
        _script([str(REPO / ".ci/docker-setup.sh")], timeout=1200)
    client = connect()  # DockerUnavailable propagates: an error, not a skip
    _script([str(REPO / "sandbox_images/build.sh"), *images], timeout=1200)
    yield client
    leftovers = client.containers.list(all=True, filters={"label": f"{TEST_LABEL}={SESSION}"})
    for container in leftovers:
        container.remove(force=True)
    client.close()


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    """A live Docker client, with sandgate-base, sandgate-agent and sandgate-bash-tool built."""
    yield from docker_with_images()


@pytest.fixture(scope="session")
def sandbox_network(docker_client: docker.DockerClient) -> SandboxNetwork:
    info = ensure_network_info(docker_client)
    assert info.host_firewall, "the host firewall for the sandbox network could not be installed"
    return info


@pytest.fixture(scope="session")
def ca_pem(tmp_path_factory: pytest.TempPathFactory) -> str:
    pki = make_pki(tmp_path_factory.mktemp("sandbox-ca"), ["sandbox.test"])
    return pki.ca_cert.read_text()


@pytest.fixture
def make_spec(sandbox_network: SandboxNetwork, ca_pem: str) -> Callable[..., SandboxSpec]:
    """SandboxSpec factory: proxy at the gateway, the test CA, labelled for cleanup."""

    def make(**overrides: Any) -> SandboxSpec:
        kwargs: dict[str, Any] = {
            "identity": "bash-tool",
            "proxy_url": f"http://{sandbox_network.gateway}:8080",
            "ca_pem": ca_pem,
            "token": "sg1.test-payload.test-mac",
            "labels": {TEST_LABEL: SESSION},
        }
        kwargs.update(overrides)
        return SandboxSpec(**kwargs)

    return make


def host_default_ip() -> str:
    """The host's address on its default-route interface (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("1.1.1.1", 9))
        return str(s.getsockname()[0])


def host_addresses() -> list[str]:
    """Every IPv4 address of this host (from `ip -4 -o addr`), loopback excluded."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                         check=True).stdout
    addrs = []
    for line in out.splitlines():
        parts = line.split()
        addr = parts[parts.index("inet") + 1].split("/")[0]
        if not addr.startswith("127."):
            addrs.append(addr)
    return addrs
