"""Daytona: network allow-list = Sandgate, proxy variables and CA in the image or snapshot, or
gateway mode (docs/providers/daytona.md).

Verified against daytona 0.226.1 (`CreateSandboxBaseParams` in daytona/common/daytona.py):
`network_block_all`, `network_allow_list` (comma-separated CIDRs), `domain_allow_list`,
`env_vars`, and `outbound_proxy_url`, which the SDK documents as applied through the
HTTP(S)_PROXY variables: "convenience routing, not a security boundary on its own".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from sandgate.providers.sandgate_access import SandgateAccess, gateway_environment
from sandgate.proxyenv import ca_install_command, check_ca_pem


def daytona_image(ca_pem: str, base: str | Any = None) -> Any:
    """A `daytona.Image` (from an image name, or the given Image; default debian_slim) that
    trusts the Sandgate CA. Use it in CreateSandboxFromImageParams or CreateSnapshotParams."""
    from daytona import Image

    check_ca_pem(ca_pem)
    if base is None:
        image = Image.debian_slim()
    elif isinstance(base, str):
        image = Image.base(base)
    else:
        image = base
    return image.run_commands(ca_install_command(ca_pem))


def daytona_create_params(
    access: SandgateAccess,
    *,
    image: str | Any = None,
    snapshot: str | None = None,
    gateway_url: str | None = None,
    gateway_base_urls: Mapping[str, str] | None = None,
) -> Any:
    """`CreateSandboxFromImageParams` (or `...FromSnapshotParams` with snapshot=, a snapshot built
    from daytona_image) for `Daytona().create(params)`.

    Proxy mode (default): the proxy variables; the allow-list is Sandgate's proxy address.
    Gateway mode (gateway_url and gateway_base_urls, e.g. {"ANTHROPIC": "/anthropic"}): SDK
    base-URL variables and the token as API key, no proxy variable (Node clients that ignore
    proxy variables); the allow-list is the gateway's address.
    """
    if gateway_url is not None:
        host = urlsplit(gateway_url).hostname
        if not host:
            raise ValueError(f"gateway_url has no host: {gateway_url!r}")
        if host != access.host.strip("[]"):
            raise ValueError(
                f"gateway_url's host ({host}) is not access.host ({access.host}): the allow-list "
                "would not let the sandbox reach the gateway"
            )
        env = gateway_environment(gateway_url, access.token, gateway_base_urls or {})
        env.update(access.ca_env())  # an https gateway (--gateway-tls-name) is signed by the CA
    else:
        env = access.proxy_env()
    common: dict[str, Any] = {
        "env_vars": env,
        "network_block_all": False,
        "network_allow_list": access.cidr("Daytona", "network_allow_list"),
    }
    if snapshot is not None and image is not None:
        raise ValueError("give image or snapshot, not both")
    from daytona import CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams

    if snapshot is not None:
        return CreateSandboxFromSnapshotParams(snapshot=snapshot, **common)
    return CreateSandboxFromImageParams(image=daytona_image(access.ca_pem, image), **common)
