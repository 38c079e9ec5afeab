"""Modal: outbound traffic allowed to Sandgate's address only, proxy variables, CA in the image
(docs/providers/modal.md).

Verified against modal 1.6.4 (`Sandbox.create` in modal/sandbox/_sandbox.py):
`block_network`, `outbound_cidr_allowlist` ("If None, all CIDRs are allowed"),
`outbound_domain_allowlist`, `env`, `secrets`, `image`. Modal has no customer-proxy option.
"""

from __future__ import annotations

from typing import Any

from sandgate.providers.sandgate_access import SandgateAccess
from sandgate.proxyenv import ca_install_command, check_ca_pem


def modal_image(ca_pem: str, base: Any = None) -> Any:
    """A `modal.Image` (default `Image.debian_slim()`) with the Sandgate CA trusted system-wide."""
    import modal

    check_ca_pem(ca_pem)
    image = base if base is not None else modal.Image.debian_slim()
    return image.run_commands(ca_install_command(ca_pem))


def modal_sandbox_kwargs(access: SandgateAccess, *, image: Any = None) -> dict[str, Any]:
    """Keyword arguments for `modal.Sandbox.create(app=..., **kwargs)`.

    image: the base `modal.Image` (default debian_slim); the CA is added to it.
    """
    cidr = access.cidr("Modal", "outbound_cidr_allowlist")  # checked before the SDK is needed
    env = access.proxy_env()
    return {
        "image": modal_image(access.ca_pem, image),
        "block_network": False,
        "outbound_cidr_allowlist": [cidr],
        # Modal sends `env` as an ephemeral secret source (not in the sandbox definition)
        "env": env,
    }
