"""Recipes for hosted sandboxes: each provider SDK's own configuration for "all egress through
this Sandgate, nothing else" (docs/providers/).

The provider SDKs are not dependencies of Sandgate: each recipe imports its SDK inside the
function that needs it, so `import sandgate.providers` works without any of them.

    access = SandgateAccess(host="203.0.113.7", proxy_port=8080, ca_pem=CA_PEM,
                            identity="coding-agent", token=TOKEN)
    sb = modal.Sandbox.create(app=app, **modal_sandbox_kwargs(access))
"""

from sandgate.providers.daytona import daytona_create_params, daytona_image
from sandgate.providers.e2b import e2b_sandbox_kwargs, e2b_template
from sandgate.providers.modal import modal_image, modal_sandbox_kwargs
from sandgate.providers.runloop import (
    runloop_blueprint_kwargs,
    runloop_devbox_kwargs,
    runloop_network_policy_kwargs,
)
from sandgate.providers.sandgate_access import SandgateAccess, gateway_environment

__all__ = [
    "SandgateAccess",
    "daytona_create_params",
    "daytona_image",
    "e2b_sandbox_kwargs",
    "e2b_template",
    "gateway_environment",
    "modal_image",
    "modal_sandbox_kwargs",
    "runloop_blueprint_kwargs",
    "runloop_devbox_kwargs",
    "runloop_network_policy_kwargs",
]
