"""Errors of the Docker side, and the one way Sandgate connects to a Docker engine."""

from __future__ import annotations

import os
from typing import Any

import docker
from docker.errors import DockerException

from sandgate.errors import SetupFailed


class DockerUnavailable(SetupFailed):
    """The Docker engine is not running or not reachable. The message says where it looked."""


class SandboxError(SetupFailed):
    """A sandbox could not be created or used. The message says what to do about it."""


def docker_endpoint(base_url: str | None = None) -> str:
    """Where the Docker client will connect: explicit URL, DOCKER_HOST, or the default socket."""
    return base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(base_url: str | None = None, timeout: float = 60) -> docker.DockerClient:
    """A Docker client that has answered a ping. Raises DockerUnavailable."""
    where = docker_endpoint(base_url)
    try:
        kwargs: dict[str, Any] = {"timeout": int(timeout)}
        client = (
            docker.DockerClient(base_url=base_url, **kwargs)
            if base_url
            else docker.from_env(**kwargs)
        )
        client.ping()
    except DockerException as exc:
        raise DockerUnavailable(
            f"Docker is not running or not reachable at {where}: {exc}"
        ) from exc
    return client


def unavailable(exc: Exception, client: docker.DockerClient | None = None) -> DockerUnavailable:
    """Wrap a connection-level failure of an existing client."""
    url = getattr(getattr(client, "api", None), "base_url", None)
    where = docker_endpoint(None if url == "http+docker://localhost" else url)
    return DockerUnavailable(f"Docker is not running or not reachable at {where}: {exc}")
