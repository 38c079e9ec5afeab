"""Docker sandboxes for agent hosts: an internal network, the Sandgate CA, the proxy env."""

from sandgate.identity.labels import LABEL_IDENTITY, LABEL_SANDBOX
from sandgate.sandbox.engine import DockerUnavailable, SandboxError, connect
from sandgate.sandbox.launcher import (
    DEFAULT_IMAGE,
    ExecResult,
    Sandbox,
    SandboxSpec,
    list_sandboxes,
    run_once,
)
from sandgate.sandbox.network import DEFAULT_SUBNET, NETWORK_NAME, ensure_network

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_SUBNET",
    "LABEL_IDENTITY",
    "LABEL_SANDBOX",
    "NETWORK_NAME",
    "DockerUnavailable",
    "ExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "connect",
    "ensure_network",
    "list_sandboxes",
    "run_once",
]
