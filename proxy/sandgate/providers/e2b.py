"""E2B: the sandbox's TCP tunnelled by E2B's host to Sandgate's SOCKS5 listener
(docs/providers/e2b.md).

Verified against e2b 2.63.0 (`SandboxNetworkOpts`, `SandboxEgressProxyOpts` in
e2b/sandbox/sandbox_api.py): `network.egress_proxy` = {address, username, password[, tls]} is
applied on E2B's host after `allow_out`/`deny_out` filtering, fails closed when the proxy is
unreachable, and does not tunnel UDP (DNS, QUIC).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from sandgate.providers.sandgate_access import SandgateAccess
from sandgate.proxyenv import ca_install_command, check_ca_pem

_SOCKS5_FIELD_MAX = 255  # RFC 1929: username and password are at most 255 bytes each


def e2b_template(ca_pem: str, *, base_image: str | None = None) -> Any:
    """An `e2b.Template` whose image trusts the Sandgate CA (build it with `Template.build`).

    base_image: a Docker image (`from_image`); default E2B's base image (`from_base_image`).
    """
    from e2b import Template

    check_ca_pem(ca_pem)
    builder = Template()
    start = builder.from_image(base_image) if base_image else builder.from_base_image()
    # The CA is written by root: E2B templates run build steps as the template's user otherwise.
    return start.run_cmd(ca_install_command(ca_pem), user="root")


def e2b_sandbox_kwargs(access: SandgateAccess, *, template: str | None = None,
                       mode: Literal["socks5", "proxy"] = "socks5",
                       socks5_tls: bool | Mapping[str, str] = False) -> dict[str, Any]:
    """Keyword arguments for `e2b.Sandbox.create(...)`.

    mode "socks5" (needs access.socks5_port): `network.egress_proxy` names Sandgate's SOCKS5
    listener with the identity and token as username/password; every TCP connection of the
    sandbox goes there, whatever the client does. No `deny_out`: E2B filters before it
    tunnels, so denying 0.0.0.0/0 would deny the tunnelled traffic too.

    mode "proxy" (needs access.proxy_port): `deny_out` everything, `allow_out` only Sandgate's
    address, and the proxy variables: clients that ignore them cannot connect at all, and UDP to
    anywhere but Sandgate is dropped as well.

    socks5_tls: E2B's `egress_proxy.tls` (True, or {"server_name", "ca_cert"}): E2B then speaks
    TLS to the proxy address, so the token does not cross the internet in clear. Sandgate's
    SOCKS5 listener speaks no TLS itself: this needs a TLS terminator in front of it.
    """
    kwargs: dict[str, Any] = {"allow_internet_access": True}
    if template is not None:
        kwargs["template"] = template
    if mode == "socks5":
        address = access.socks5_address()
        ip = access.ip
        if ip is not None and not ip.is_global:
            raise ValueError(
                f"E2B rejects an egress proxy in a private or internal range ({access.host}): "
                "give the public address (or name) its hosts reach Sandgate's SOCKS5 listener at"
            )
        for field, value in (("identity", access.identity), ("token", access.token)):
            if len(value.encode()) > _SOCKS5_FIELD_MAX:
                raise ValueError(f"{field} is longer than SOCKS5's 255 bytes")
        proxy: dict[str, Any] = {
            "address": address,
            "username": access.identity,
            "password": access.token,
        }
        if socks5_tls:
            proxy["tls"] = _tls(socks5_tls)
        kwargs["network"] = {"egress_proxy": proxy}
        # A transparent tunnel needs no proxy variable, only the CA (also baked into the
        # template by e2b_template: the variables tell each client where the bundle is).
        kwargs["envs"] = access.ca_env()
    elif mode == "proxy":
        if socks5_tls:
            raise ValueError("socks5_tls applies to mode='socks5' only")
        cidr = access.cidr("E2B", "allow_out")
        kwargs["network"] = {"allow_out": [cidr], "deny_out": ["0.0.0.0/0"]}
        kwargs["envs"] = access.proxy_env()
    else:
        raise ValueError(f"mode must be 'socks5' or 'proxy', got {mode!r}")
    return kwargs


def _tls(tls: bool | Mapping[str, str]) -> bool | dict[str, str]:
    if tls is True:
        return True
    if not isinstance(tls, Mapping):
        raise ValueError("socks5_tls must be True or a mapping with server_name and/or ca_cert")
    unknown = set(tls) - {"server_name", "ca_cert"}
    if unknown:
        raise ValueError(f"socks5_tls: unknown keys {sorted(unknown)} (server_name, ca_cert)")
    if "ca_cert" in tls:
        check_ca_pem(tls["ca_cert"])
        if len(tls["ca_cert"].encode()) > 8192:
            raise ValueError("socks5_tls ca_cert: E2B takes at most 8192 bytes of PEM")
    return dict(tls)
