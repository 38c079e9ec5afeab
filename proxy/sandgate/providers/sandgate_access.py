"""What every recipe needs: where Sandgate is, who the sandbox is, and checks that fail early."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from sandgate.proxyenv import (
    ca_environment,
    check_ca_pem,
    check_identity,
    proxy_environment,
    proxy_url_with_credentials,
)


@dataclass(frozen=True, kw_only=True)
class SandgateAccess:
    """How one hosted sandbox reaches Sandgate and proves who it is.

    host: Sandgate's address as the provider's sandboxes reach it (a public IP address for the
        providers whose allow-lists take CIDRs; E2B's SOCKS5 egress proxy also takes a name).
    proxy_port: the HTTP proxy listener (`sandgate run --listen`), None when not used.
    socks5_port: the SOCKS5 listener (`sandgate run --socks5`), None when not used.
    ca_pem: the Sandgate CA certificate (`sandgate ca`); never the key.
    identity: the sandbox's identity (or sandbox id) as inside its token.
    token: a short-lived proxy token bound to this sandbox (POST /v1/tokens with identity,
        sandbox and ttl, or `sandgate token issue --identity NAME --sandbox ID --ttl 1h`).
    """

    host: str
    ca_pem: str
    identity: str
    token: str
    proxy_port: int | None = 8080
    socks5_port: int | None = None

    def __post_init__(self) -> None:
        if not self.host or self.host != self.host.strip() or "/" in self.host:
            raise ValueError(
                f"host must be Sandgate's address as the sandbox reaches it, got {self.host!r}"
            )
        check_ca_pem(self.ca_pem)
        check_identity(self.identity)
        if not self.token or any(c.isspace() for c in self.token):
            raise ValueError("token must be a Sandgate proxy token (POST /v1/tokens), not empty")
        for name in ("proxy_port", "socks5_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be 1-65535, got {port}")

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        try:
            return ipaddress.ip_address(self.host.strip("[]"))
        except ValueError:
            return None

    def cidr(self, provider: str, what: str) -> str:
        """The one-address CIDR of Sandgate, for allow-lists that take only CIDRs."""
        ip = self.ip
        if ip is None:
            raise ValueError(
                f"{provider}'s {what} takes CIDRs, not names: pass Sandgate's IP address as host "
                f"(got the name {self.host!r})"
            )
        if ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast:
            raise ValueError(
                f"host {self.host} is not reachable from {provider}'s sandboxes: give the address "
                "they reach Sandgate at"
            )
        return f"{ip}/{ip.max_prefixlen}"

    def _hostport(self, port: int) -> str:
        ip = self.ip
        host = f"[{ip}]" if ip is not None and ip.version == 6 else self.host.strip("[]")
        return f"{host}:{port}"

    def proxy_url(self) -> str:
        """http://IDENTITY:TOKEN@HOST:PORT, the value of every proxy variable."""
        if self.proxy_port is None:
            raise ValueError("this recipe needs Sandgate's HTTP proxy port (proxy_port)")
        return proxy_url_with_credentials(
            f"http://{self._hostport(self.proxy_port)}", self.identity, self.token
        )

    def socks5_address(self) -> str:
        if self.socks5_port is None:
            raise ValueError("this recipe needs Sandgate's SOCKS5 port (socks5_port, "
                             "`sandgate run --socks5 HOST:PORT`)")
        return self._hostport(self.socks5_port)

    def proxy_env(self) -> dict[str, str]:
        """The proxy and CA variables every common client needs (sandgate.proxyenv)."""
        env = proxy_environment(self.proxy_url())
        env["SANDGATE_IDENTITY"] = self.identity
        return env

    def ca_env(self) -> dict[str, str]:
        """Only the CA variables (for a transparent tunnel: no proxy variable)."""
        env = ca_environment()
        env["SANDGATE_IDENTITY"] = self.identity
        return env


def gateway_environment(gateway_url: str, token: str,
                        base_urls: Mapping[str, str]) -> dict[str, str]:
    """Gateway mode: SDK base-URL variables pointing at Sandgate, the token as the API key.

    base_urls maps an SDK's variable prefix to the gateway path of its `gateways:` entry, e.g.
    {"ANTHROPIC": "/anthropic", "OPENAI": "/openai/v1"} gives ANTHROPIC_BASE_URL=
    GATEWAY/anthropic and ANTHROPIC_API_KEY=TOKEN, and the same for OPENAI_.
    """
    url = urlsplit(gateway_url)
    if url.scheme not in ("http", "https") or not url.hostname or url.username or url.query:
        raise ValueError(
            f"gateway_url must be http(s)://HOST:PORT of `sandgate run --gateway`, "
            f"got {gateway_url!r}"
        )
    if not token or any(c.isspace() for c in token):
        raise ValueError("token must be a Sandgate proxy token (POST /v1/tokens), not empty")
    if not base_urls:
        raise ValueError("base_urls is empty: name at least one SDK and its gateway prefix")
    base = gateway_url.rstrip("/")
    env: dict[str, str] = {}
    for name, path in base_urls.items():
        if not name.isidentifier() or not name.isupper():
            raise ValueError(f"{name!r} is not an SDK variable prefix such as ANTHROPIC")
        if not path.startswith("/"):
            raise ValueError(f"gateway path {path!r} must start with / (the policy's prefix)")
        env[f"{name}_BASE_URL"] = base + path
        env[f"{name}_API_KEY"] = token
    return env
