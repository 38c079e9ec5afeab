"""Runloop: a network policy allowing only Sandgate, a blueprint with the CA, proxy variables on
the devbox (docs/providers/runloop.md).

Verified against runloop-api-client 3.0.0: `network_policies.create(name, allow_all,
allowed_cidrs=[{cidr, ports: [{port, end_port, protocol}]}], allowed_hostnames, ...)`,
`blueprints.create(name, dockerfile, launch_parameters={network_policy_id, ...})`,
`devboxes.create(blueprint_name, environment_variables, launch_parameters)`.
"""

from __future__ import annotations

from typing import Any

from sandgate.providers.sandgate_access import SandgateAccess
from sandgate.proxyenv import ca_install_command, check_ca_pem


def runloop_network_policy_kwargs(access: SandgateAccess, *, name: str) -> dict[str, Any]:
    """Keyword arguments for `client.network_policies.create(...)`: Sandgate's proxy port (and
    SOCKS5 port, when given) over TCP, nothing else: no hostnames, no mirrors, no gateways."""
    cidr = access.cidr("Runloop", "allowed_cidrs")
    if access.ip is not None and access.ip.version != 4:
        raise ValueError(
            "Runloop's allowed_cidrs takes IPv4 CIDRs only: give Sandgate's IPv4 address"
        )
    ports = [p for p in (access.proxy_port, access.socks5_port) if p is not None]
    if not ports:
        raise ValueError("give proxy_port (or socks5_port): the policy allows only those ports")
    return {
        "name": name,
        "description": f"Sandgate egress for {access.identity}",
        "allow_all": False,
        "allow_devbox_to_devbox": False,
        "allow_agent_gateway": False,
        "allow_mcp_gateway": False,
        "allow_runloop_mirrors": False,
        "allowed_hostnames": [],
        "allowed_cidrs": [
            {"cidr": cidr, "ports": [{"port": p, "protocol": "TCP"} for p in ports]}
        ],
    }


def runloop_blueprint_kwargs(ca_pem: str, *, name: str, base_image: str = "ubuntu:24.04",
                             network_policy_id: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `client.blueprints.create(...)`: a Dockerfile that trusts the CA;
    with network_policy_id, devboxes from it inherit the policy."""
    check_ca_pem(ca_pem)
    if not base_image or any(c.isspace() for c in base_image):
        raise ValueError(f"base_image must be an image reference, got {base_image!r}")
    dockerfile = (
        f"FROM {base_image}\n"
        "USER root\n"
        # ubuntu/debian images without the package have no update-ca-certificates
        "RUN (command -v update-ca-certificates >/dev/null || (apt-get update"
        " && apt-get install -y --no-install-recommends ca-certificates))"
        f" && {ca_install_command(ca_pem)}\n"
    )
    kwargs: dict[str, Any] = {"name": name, "dockerfile": dockerfile}
    if network_policy_id is not None:
        kwargs["launch_parameters"] = {"network_policy_id": network_policy_id}
    return kwargs


def runloop_devbox_kwargs(access: SandgateAccess, *, blueprint_name: str,
                          network_policy_id: str) -> dict[str, Any]:
    """Keyword arguments for `client.devboxes.create(...)`: the blueprint, the proxy variables,
    and the policy named explicitly (so a blueprint without it cannot open the network)."""
    if not network_policy_id:
        raise ValueError("network_policy_id is required: without it the devbox's egress is open")
    return {
        "blueprint_name": blueprint_name,
        "environment_variables": access.proxy_env(),
        "launch_parameters": {"network_policy_id": network_policy_id},
    }
