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


def _container_at(client: docker.DockerClient, network: str, ip: str, identity: str,
                  name: str) -> str:
    """A running container with the given identity label at a fixed address of `network`."""
    api = client.api
    cid = api.create_container(
        "sandgate-bash-tool:dev", ["sleep", "infinity"], name=name,
        labels={TEST_LABEL: SESSION, "sandgate.identity": identity},
        host_config=api.create_host_config(init=True, network_mode=network,
                                           cap_drop=["ALL"]),
        networking_config=api.create_networking_config(
            {network: api.create_endpoint_config(ipv4_address=ip)}),
    )["Id"]
    api.start(cid)
    return str(cid)


def _free_address(client: docker.DockerClient, network: SandboxNetwork) -> str:
    used = {c["IPv4Address"].split("/")[0]
            for c in (client.api.inspect_network(network.name).get("Containers") or {}).values()}
    prefix = network.gateway.rsplit(".", 1)[0]
    return next(ip for ip in (f"{prefix}.{n}" for n in range(240, 254)) if ip not in used)


def test_reused_address_never_inherits_the_old_identity(
    docker_client: docker.DockerClient, sandbox_network: SandboxNetwork
) -> None:
    """Container A (identity old-owner) leaves; container B (new-owner) gets A's very address.
    While the source's Docker calls are held up (the consumer lagging behind the event stream,
    simulated with the test hook `_io_gate`), B must not be identified as A: the address is
    unknown (refused) until B's own labels are read, then it is B's."""
    net = sandbox_network.name
    src = DockerLabelSource([net], client=docker_client).start()
    ip = _free_address(docker_client, sandbox_network)
    a = _container_at(docker_client, net, ip, "old-owner", f"sandgate-test-reuse-a-{SESSION}")
    b = None
    try:
        old = src.wait_for(ip)
        assert old is not None and old.identity == "old-owner"
        src._io_gate.clear()  # from here on the source's calls to Docker wait
        docker_client.api.remove_container(a, force=True)
        b = _container_at(docker_client, net, ip, "new-owner", f"sandgate-test-reuse-b-{SESSION}")
        assert docker_client.api.inspect_container(b)["State"]["Running"]
        # The address is B's now: whatever the source says, it must not be A's identity.
        deadline = time.monotonic() + 5
        seen = src.lookup(ip)
        while seen is not None and time.monotonic() < deadline:
            seen = src.lookup(ip)
            time.sleep(0.02)
        assert seen is None, f"{ip} (now container B's) is still identified as {seen}"
        src._io_gate.set()
        assert src.wait_for(ip) == Caller("new-owner", f"sandgate-test-reuse-b-{SESSION}",
                                          "docker")
    finally:
        src._io_gate.set()
        src.stop()
        for cid in (a, b):
            if cid is not None:
                try:
                    docker_client.api.remove_container(cid, force=True)
                except docker.errors.NotFound:
                    pass
