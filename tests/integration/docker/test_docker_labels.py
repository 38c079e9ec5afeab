"""DockerLabelSource against a real engine: listing at start, then the event stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import docker
import pytest

from sandgate.identity.base import AddressIdentitySource, Caller
from sandgate.identity.docker_labels import DockerLabelSource
from sandgate.sandbox import Sandbox, SandboxSpec
from sandgate.sandbox.network import SandboxNetwork
from tests.integration.docker.conftest import SESSION, TEST_LABEL

Spec = Callable[..., SandboxSpec]


@pytest.fixture
def source(docker_client: docker.DockerClient,
           sandbox_network: SandboxNetwork) -> Iterator[DockerLabelSource]:
    src = DockerLabelSource([sandbox_network.name], client=docker_client)
    src.start()
    yield src
    src.stop()


def _plain_container(client: docker.DockerClient, network: str, labels: dict[str, str],
                     name: str) -> Any:
    return client.containers.run(
        "sandgate-bash-tool:dev", ["sleep", "infinity"], detach=True, init=True, name=name,
        network=network, labels={TEST_LABEL: SESSION, **labels},
    )


def _ip(container: Any, network: str) -> str:
    container.reload()
    return str(container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"])


def test_maps_a_started_sandbox_and_drops_it_after_removal(
    docker_client: docker.DockerClient, source: DockerLabelSource, make_spec: Spec
) -> None:
    as_protocol: AddressIdentitySource = source
    sbx = Sandbox.create(docker_client, make_spec(identity="labelled-tool"))
    try:
        caller = source.wait_for(sbx.ip)
        assert caller == Caller("labelled-tool", sbx.id, "docker")
        assert as_protocol.lookup(sbx.ip) == caller
        assert source.lookup(f"::ffff:{sbx.ip}") == caller
    finally:
        sbx.close()
    assert source.wait_for(sbx.ip, present=False) is None
    assert source.lookup(sbx.ip) is None


def test_initial_listing_is_synchronous(
    docker_client: docker.DockerClient, sandbox_network: SandboxNetwork, make_spec: Spec
) -> None:
    with Sandbox.create(docker_client, make_spec(identity="early")) as sbx:
        src = DockerLabelSource([sandbox_network.name], client=docker_client)
        try:
            src.start()  # no waiting: the map is complete when start() returns
            assert src.lookup(sbx.ip) == Caller("early", sbx.id, "docker")
        finally:
            src.stop()


def test_sandbox_label_defaults_to_container_name(
    docker_client: docker.DockerClient, source: DockerLabelSource,
    sandbox_network: SandboxNetwork,
) -> None:
    name = f"sandgate-test-nolabel-sbx-{SESSION}"
    c = _plain_container(docker_client, sandbox_network.name, {"sandgate.identity": "plain"}, name)
    try:
        assert source.wait_for(_ip(c, sandbox_network.name)) == Caller("plain", name, "docker")
    finally:
        c.remove(force=True)


def test_container_without_identity_label_is_not_mapped(
    docker_client: docker.DockerClient, source: DockerLabelSource,
    sandbox_network: SandboxNetwork, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="sandgate.identity.docker_labels")
    name = f"sandgate-test-anon-{SESSION}"
    c = _plain_container(docker_client, sandbox_network.name, {"sandgate.sandbox": "x"}, name)
    try:
        ip = _ip(c, sandbox_network.name)
        deadline = time.monotonic() + 10
        while "has no sandgate.identity label" not in caplog.text:
            assert time.monotonic() < deadline, "the unlabelled container was not logged"
            time.sleep(0.05)
        assert name in caplog.text
        assert source.lookup(ip) is None
    finally:
        c.remove(force=True)


def test_other_networks_are_ignored(
    docker_client: docker.DockerClient, source: DockerLabelSource
) -> None:
    name = f"sandgate-test-bridge-{SESSION}"
    c = _plain_container(docker_client, "bridge", {"sandgate.identity": "elsewhere"}, name)
    try:
        ip = _ip(c, "bridge")
        generation = source.generation
        time.sleep(1)
        assert source.lookup(ip) is None
        assert source.generation == generation
    finally:
        c.remove(force=True)


def test_network_disconnect_and_reconnect(
    docker_client: docker.DockerClient, source: DockerLabelSource,
    sandbox_network: SandboxNetwork, make_spec: Spec,
) -> None:
    with Sandbox.create(docker_client, make_spec(identity="moving")) as sbx:
        ip = sbx.ip
        assert source.wait_for(ip) is not None
        net = docker_client.networks.get(sandbox_network.name)
        net.disconnect(sbx.container)
        assert source.wait_for(ip, present=False) is None
        net.connect(sbx.container)
        new_ip = _ip(sbx.container, sandbox_network.name)
        assert source.wait_for(new_ip) == Caller("moving", sbx.id, "docker")


def test_stop_is_prompt(docker_client: docker.DockerClient,
                        sandbox_network: SandboxNetwork) -> None:
    src = DockerLabelSource([sandbox_network.name], client=docker_client).start()
    t0 = time.monotonic()
    src.stop()
    assert time.monotonic() - t0 < 3
