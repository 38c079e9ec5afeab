"""The environment a sandbox gets: every client finds the proxy and the CA without setup.

The launcher (sandgate.sandbox.launcher) and docker-compose.yml must give the same clients the
same settings; the matrix in tests/integration/clients/ shows the clients then work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sandgate.proxyenv import CA_BUNDLE, CA_FILE, CA_VARS, CLIENT_PROXY_VARS, PROXY_VARS
from sandgate.sandbox.engine import SandboxError
from sandgate.sandbox.launcher import SandboxSpec, sandbox_environment

CLIENT_FLAGS = {"NODE_USE_ENV_PROXY": "1"}

REPO = Path(__file__).resolve().parents[2]
CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"

# What each client reads (the "Client compatibility" table of docs/clients.md). A client
# missing here has no setting of its own: it follows the *_PROXY variables and the system
# bundle (wget, uv, go, aiohttp with trust_env, httpx, urllib).
CLIENT_CA = {
    "python ssl, go, uv, httpx": "SSL_CERT_FILE",
    "requests": "REQUESTS_CA_BUNDLE",
    "pip": "PIP_CERT",
    "git": "GIT_SSL_CAINFO",
    "curl": "CURL_CA_BUNDLE",
    "npm": "npm_config_cafile",
    "cargo": "CARGO_HTTP_CAINFO",
}
CLIENT_PROXY = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY",
                "npm_config_proxy", "npm_config_https_proxy"]


def _spec(**kw: Any) -> SandboxSpec:
    args: dict[str, Any] = {"identity": "bash-tool", "proxy_url": "http://172.30.99.1:8080",
                            "ca_pem": CA_PEM, "token": "sg1.p.m"}
    args.update(kw)
    return SandboxSpec(**args)


def test_every_client_gets_the_proxy_with_its_token() -> None:
    env = sandbox_environment(_spec(), "sbx-1")
    want = "http://bash-tool:sg1.p.m@172.30.99.1:8080"
    for var in CLIENT_PROXY:
        assert env[var] == want, var
    assert env["NO_PROXY"] == env["no_proxy"] == ""


def test_every_client_gets_the_ca() -> None:
    env = sandbox_environment(_spec(), "sbx-1")
    for client, var in CLIENT_CA.items():
        assert env[var] == CA_BUNDLE, client
    assert env["NODE_EXTRA_CA_CERTS"] == CA_FILE  # Node adds it to its own roots
    assert env["NODE_USE_ENV_PROXY"] == "1"


def test_placeholders_cannot_override_client_settings() -> None:
    for name in (*CA_VARS, *CLIENT_PROXY_VARS, *CLIENT_FLAGS, "npm_config_cafile"):
        with pytest.raises(SandboxError, match="not a usable environment name"):
            _spec(placeholders={name: "x"}).validate()


def _compose_sandbox_env() -> dict[str, str]:
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    env = doc["services"]["bash-tool"]["environment"]
    agent = dict(doc["services"]["agent"]["environment"])
    # the same anchor; the agent adds its split's role listener ports (docs/pattern1.md)
    assert agent.pop("SANDGATE_SPLIT_TOOL_PORT") == "8081"
    assert agent.pop("SANDGATE_SPLIT_OTHER_PORT") == "8082"
    assert env == agent
    return {str(k): str(v) for k, v in env.items()}


def test_compose_gives_the_same_clients_the_same_settings() -> None:
    compose = _compose_sandbox_env()
    launcher = sandbox_environment(_spec(), "sbx-1")
    proxy = compose["HTTPS_PROXY"]
    for var in (*PROXY_VARS, *(v.lower() for v in PROXY_VARS), *CLIENT_PROXY_VARS):
        assert compose[var] == proxy, var
    # compose mounts the CA volume instead of updating the system store: one bundle file
    bundles = {compose[var] for var in CA_VARS}
    assert bundles == {"/etc/sandgate/ca/ca-bundle.pem"}
    assert compose["NODE_EXTRA_CA_CERTS"] == "/etc/sandgate/ca/sandgate-ca.pem"
    for var, value in CLIENT_FLAGS.items():
        assert compose[var] == value
    # wget reads no CA variable: compose points it at the wgetrc the entrypoint publishes
    assert compose["WGETRC"] == "/etc/sandgate/ca/wgetrc"
    entry = (REPO / "sandbox_images/sandgate/entrypoint.sh").read_text()
    assert '"$CA_PUBLIC_DIR/wgetrc"' in entry and "ca_certificate = " in entry
    missing = set(launcher) - set(compose) - {"SANDGATE_IDENTITY", "SANDGATE_SANDBOX"}
    assert not missing, f"compose lacks {sorted(missing)}"
