"""The environment that sends a sandbox's clients through Sandgate: one builder for every launcher.

Used by the Docker launcher (sandgate.sandbox.launcher) and by the hosted-sandbox recipes
(sandgate.providers). Imports nothing beyond the standard library, so that the recipes work in an
environment without Docker or mitmproxy.

The variables cover the common clients: curl/wget/git/pip/requests/httpx/aiohttp read the proxy
variables (some only the lower-case, some only the upper-case ones), OpenSSL-based clients read
SSL_CERT_FILE, requests REQUESTS_CA_BUNDLE, curl CURL_CA_BUNDLE, pip PIP_CERT, git GIT_SSL_CAINFO,
Node NODE_EXTRA_CA_CERTS (added to its own roots) and, from Node 24, NODE_USE_ENV_PROXY=1 to make
its built-in fetch/http honour the proxy variables at all. NO_PROXY is set empty so that an image's
own exemptions do not open a path around the proxy.
"""

from __future__ import annotations

import base64
import re
from urllib.parse import quote, urlsplit, urlunsplit

CA_DIR = "/usr/local/share/ca-certificates"
CA_FILE = f"{CA_DIR}/sandgate.crt"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # system bundle, includes CA_FILE once updated
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
# Clients that read a proxy setting of their own instead of (or before) the *_PROXY variables.
CLIENT_PROXY_VARS = ("npm_config_proxy", "npm_config_https_proxy")
# The system bundle (the distribution's roots + the Sandgate CA) for every client that takes a
# file: OpenSSL and Go (SSL_CERT_FILE), requests, pip, git, curl, npm (its `cafile` replaces
# its built-in roots, so it gets the whole bundle), cargo. uv reads SSL_CERT_FILE too.
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE",
           "npm_config_cafile", "CARGO_HTTP_CAINFO")
# Every name proxy_environment sets: a launcher refuses user variables that would override them.
ENV_NAMES = frozenset(
    [*PROXY_VARS, *(v.lower() for v in PROXY_VARS), *CLIENT_PROXY_VARS, "NO_PROXY", "no_proxy",
     *CA_VARS, "NODE_EXTRA_CA_CERTS", "NODE_USE_ENV_PROXY"]
)

_IDENTITY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")


def proxy_url_with_credentials(proxy_url: str, identity: str, token: str | None) -> str:
    """http://HOST:PORT -> http://IDENTITY:TOKEN@HOST:PORT (both percent-encoded)."""
    if token is None:
        return proxy_url
    url = urlsplit(proxy_url)
    userinfo = f"{quote(identity, safe='')}:{quote(token, safe='')}"
    return urlunsplit(url._replace(netloc=f"{userinfo}@{url.netloc}"))


def proxy_environment(proxy_url: str, *, ca_bundle: str = CA_BUNDLE,
                      ca_file: str = CA_FILE) -> dict[str, str]:
    """Proxy variables (both cases), NO_PROXY empty, and every client's CA variable.

    `proxy_url` is the URL clients use, credentials included (proxy_url_with_credentials);
    `ca_bundle` a bundle holding the system roots plus the Sandgate CA, `ca_file` the Sandgate CA
    alone (Node adds it to its own roots).
    """
    env: dict[str, str] = {}
    for var in PROXY_VARS:
        env[var] = proxy_url
        env[var.lower()] = proxy_url
    for var in CLIENT_PROXY_VARS:
        env[var] = proxy_url
    env["NO_PROXY"] = ""
    env["no_proxy"] = ""
    env.update(ca_environment(ca_bundle=ca_bundle, ca_file=ca_file))
    env["NODE_USE_ENV_PROXY"] = "1"
    return env


def ca_environment(*, ca_bundle: str = CA_BUNDLE, ca_file: str = CA_FILE) -> dict[str, str]:
    """Only the CA variables: for a transparent tunnel (E2B's SOCKS5), where no client needs
    to be told about a proxy but every client must trust Sandgate's interception."""
    env = {var: ca_bundle for var in CA_VARS}
    env["NODE_EXTRA_CA_CERTS"] = ca_file
    return env


def ca_install_command(ca_pem: str, *, ca_file: str = CA_FILE,
                       ca_bundle: str = CA_BUNDLE) -> str:
    """One shell command (for an image build step) that makes the Sandgate CA trusted system-wide.

    The PEM travels base64-encoded so that no quoting of the build step can mangle it; images
    without update-ca-certificates get it appended to the bundle. Fails (non-zero) when the bundle
    does not end up holding the CA.
    """
    check_ca_pem(ca_pem)
    b64 = base64.b64encode(ca_pem.strip().encode() + b"\n").decode()
    ca_dir = ca_file.rsplit("/", 1)[0]
    return (
        f"mkdir -p {ca_dir} && echo {b64} | base64 -d > {ca_file}"
        f" && (update-ca-certificates >/dev/null 2>&1 || cat {ca_file} >> {ca_bundle})"
        f" && grep -qF \"$(sed -n 2p {ca_file})\" {ca_bundle}"
    )


def check_ca_pem(ca_pem: str) -> None:
    if "-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise ValueError("ca_pem is not a PEM certificate (use the output of `sandgate ca`)")
    if "PRIVATE KEY" in ca_pem:
        raise ValueError("ca_pem contains a private key: pass only the CA certificate")


def check_identity(identity: str) -> None:
    if not _IDENTITY.match(identity):
        raise ValueError(
            f"invalid identity {identity[:40]!r}: letters, digits and _.@- (at most 128)"
        )
