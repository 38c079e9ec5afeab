"""The client matrix runs in Docker: the engine, images and fixtures of tests/integration/docker.

Its tests get the `docker` and `integration` markers like those, and nothing skips: without a
usable engine every cell fails with the setup script's output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.docker.conftest import (  # noqa: F401  (fixtures, found by name)
    ca_pem,
    docker_client,
    make_spec,
    sandbox_network,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)
            item.add_marker(pytest.mark.integration)
