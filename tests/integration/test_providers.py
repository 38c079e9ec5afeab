"""The hosted-sandbox recipes (sandgate.providers) through each provider SDK's own create call.

Each case runs tests/support/provider_sdk_calls.py in the provider venv (.venv-providers, from
scripts/setup.sh --test): the recipe's output goes into the SDK's real create function, whose API
base URL is a local stand-in on a loopback address (127.0.19.0/24); the stand-in records what
the SDK's transport sent and refuses the create. So these tests show that the SDK accepts the
recipe's objects and what exactly it would send to the provider: no account, no network.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandgate.proxyenv import CA_BUNDLE, CA_FILE, CA_VARS, CLIENT_PROXY_VARS, PROXY_VARS
from sandgate.tokens import issue_token
from tests.support.pki import make_pki

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
PROVIDERS_PY = REPO / ".venv-providers" / "bin" / "python"
SCRIPT = REPO / "tests" / "support" / "provider_sdk_calls.py"
API_HOST = {"e2b": "127.0.19.1", "daytona": "127.0.19.2", "runloop": "127.0.19.3",
            "modal": "127.0.19.4"}
PUBLIC_IP = "203.0.113.7"  # Sandgate as the provider's sandboxes reach it
IDENTITY = "coding-agent"
# A real Sandgate token (the admin API's POST /v1/tokens issues the same), bound to one sandbox.
TOKEN = issue_token(b"k" * 32, IDENTITY, sandbox="sbx-42", ttl_seconds=900)
PROXY_URL = f"http://{IDENTITY}:{TOKEN}@{PUBLIC_IP}:8080"
_CA_STEP = re.compile(r"echo ([A-Za-z0-9+/=]+) \| base64 -d > " + re.escape(CA_FILE))


@pytest.fixture(scope="module")
def ca_pem(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_pki(tmp_path_factory.mktemp("provider-ca"), ["unused.test"]).ca_cert.read_text()


def run(provider: str, case: str, ca_pem: str, host: str = PUBLIC_IP,
        tmp: Path | None = None, **extra: Any) -> dict[str, Any]:
    assert PROVIDERS_PY.exists(), "run scripts/setup.sh --test: the provider SDK venv is missing"
    access = {"host": host, "proxy_port": 8080, "socks5_port": 1080, "ca_pem": ca_pem,
              "identity": IDENTITY, "token": TOKEN}
    env = {k: v for k, v in os.environ.items()
           if "PROXY" not in k.upper() and not k.startswith(("MODAL_", "E2B_", "DAYTONA_",
                                                            "RUNLOOP_"))}
    env["PYTHONPATH"] = str(REPO / "proxy")  # sandgate.providers: standard library only
    if tmp is not None:
        env["HOME"] = str(tmp)  # no ~/.modal.toml or other provider config of the machine
    r = subprocess.run(
        # -P: the script's directory (tests/support, with its own secrets.py) is not on sys.path
        [str(PROVIDERS_PY), "-P", str(SCRIPT), provider, case, API_HOST[provider],
         json.dumps({"access": access, **extra})],
        capture_output=True, text=True, env=env, timeout=180, cwd=tmp or REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout)
    assert out["requests"], out
    return out


def proxy_env() -> dict[str, str]:
    env = {v: PROXY_URL for v in PROXY_VARS} | {v.lower(): PROXY_URL for v in PROXY_VARS}
    env |= {v: PROXY_URL for v in CLIENT_PROXY_VARS}  # npm's own proxy settings
    env |= {"NO_PROXY": "", "no_proxy": ""} | {v: CA_BUNDLE for v in CA_VARS}
    env |= {"NODE_EXTRA_CA_CERTS": CA_FILE, "NODE_USE_ENV_PROXY": "1",
            "SANDGATE_IDENTITY": IDENTITY}
    return env


def ca_env() -> dict[str, str]:
    return {v: CA_BUNDLE for v in CA_VARS} | {"NODE_EXTRA_CA_CERTS": CA_FILE,
                                             "SANDGATE_IDENTITY": IDENTITY}


def installed_ca(text: str) -> str:
    """The PEM that an image build step writes to the Sandgate CA file (exactly one)."""
    found = _CA_STEP.findall(text)
    assert len(found) == 1, f"expected one CA step in {text[:300]!r}"
    return base64.b64decode(found[0]).decode()


def only(out: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    hits = [r for r in out["requests"] if r["method"] == method and r["path"] == path]
    assert len(hits) == 1, [(r["method"], r["path"]) for r in out["requests"]]
    return hits[0]["body"]


def assert_refused_by_stand_in(out: dict[str, Any]) -> None:
    # the SDK got as far as its create request: nothing failed inside the SDK before that
    assert out["error"] and "refused by the test server" in out["error"], out["error"]


# --- E2B -------------------------------------------------------------------------------------


def test_e2b_socks5_egress_proxy_with_the_sandbox_token(ca_pem, tmp_path):
    out = run("e2b", "socks5", ca_pem, host="sandgate.example.com", tmp=tmp_path)
    assert_refused_by_stand_in(out)
    body = only(out, "POST", "/v2/sandboxes")
    assert body["network"] == {"egressProxy": {"address": "sandgate.example.com:1080",
                                               "username": IDENTITY, "password": TOKEN}}
    # a transparent tunnel: no proxy variable, no deny-all (E2B filters before it tunnels)
    assert body["envVars"] == ca_env()
    assert body["allow_internet_access"] is True


def test_e2b_socks5_over_tls_to_a_terminator(ca_pem, tmp_path):
    tls = {"server_name": "socks.sandgate.example", "ca_cert": ca_pem}
    out = run("e2b", "socks5", ca_pem, host="sandgate.example.com", tmp=tmp_path,
              template="sandgate-ca", socks5_tls=tls)
    body = only(out, "POST", "/v2/sandboxes")
    assert body["templateID"] == "sandgate-ca"
    assert body["network"]["egressProxy"]["tls"] == {
        "enabled": True, "serverName": "socks.sandgate.example", "caCert": ca_pem}


def test_e2b_proxy_mode_denies_everything_but_sandgate(ca_pem, tmp_path):
    out = run("e2b", "proxy", ca_pem, tmp=tmp_path)
    assert_refused_by_stand_in(out)
    body = only(out, "POST", "/v2/sandboxes")
    assert body["network"] == {"allowOut": [f"{PUBLIC_IP}/32"], "denyOut": ["0.0.0.0/0"]}
    assert body["envVars"] == proxy_env()


def test_e2b_template_build_trusts_the_ca(ca_pem, tmp_path):
    out = run("e2b", "template", ca_pem, tmp=tmp_path, base_image="python:3.12-slim")
    assert_refused_by_stand_in(out)
    build = only(out, "POST", "/v2/templates/tpl-test/builds/bld-test")
    assert build["fromImage"] == "python:3.12-slim"
    (step,) = build["steps"]
    assert step["type"] == "RUN" and step["args"][1] == "root"
    assert installed_ca(step["args"][0]).strip() == ca_pem.strip()


# --- Modal -----------------------------------------------------------------------------------


def test_modal_cidr_allowlist_proxy_env_and_ca_image(ca_pem, tmp_path):
    out = run("modal", "proxy", ca_pem, tmp=tmp_path)
    assert_refused_by_stand_in(out)
    creates = [r for r in out["requests"] if r["path"] in ("SandboxCreate", "SandboxCreateV2")]
    assert len(creates) == 1
    create = creates[0]["body"]
    assert create["definition"]["network_access"] == {
        "network_access_type": "ALLOWLIST", "allowed_cidrs": [f"{PUBLIC_IP}/32"]}
    assert [s["env"]["contents"] for s in create["secret_sources"]] == [proxy_env()]
    # the sandbox runs the image whose last layer installs the CA
    images = {f"im-{i}": r["body"]["image"] for i, r in enumerate(out["requests"])
              if r["path"] == "ImageGetOrCreate"}
    top = images[create["definition"]["image_id"]]
    assert installed_ca("\n".join(top["dockerfile_commands"])).strip() == ca_pem.strip()


# --- Daytona ---------------------------------------------------------------------------------


def test_daytona_allow_list_proxy_env_and_ca_image(ca_pem, tmp_path):
    out = run("daytona", "proxy", ca_pem, tmp=tmp_path, base_image="python:3.12-slim")
    assert_refused_by_stand_in(out)
    body = only(out, "POST", "/sandbox")
    assert body["networkBlockAll"] is False
    assert body["networkAllowList"] == f"{PUBLIC_IP}/32"
    assert body["env"] == proxy_env()
    dockerfile = body["buildInfo"]["dockerfileContent"]
    assert dockerfile.startswith("FROM python:3.12-slim\n")
    assert installed_ca(dockerfile).strip() == ca_pem.strip()


def test_daytona_from_a_snapshot(ca_pem, tmp_path):
    out = run("daytona", "snapshot", ca_pem, tmp=tmp_path)
    assert_refused_by_stand_in(out)
    body = only(out, "POST", "/sandbox")
    assert body["snapshot"] == "sandgate-ca" and "buildInfo" not in body
    assert body["networkAllowList"] == f"{PUBLIC_IP}/32" and body["env"] == proxy_env()


def test_daytona_gateway_mode_has_base_urls_and_no_proxy(ca_pem, tmp_path):
    out = run("daytona", "gateway", ca_pem, tmp=tmp_path,
              gateway_url=f"http://{PUBLIC_IP}:8081",
              gateway_base_urls={"ANTHROPIC": "/anthropic", "OPENAI": "/openai/v1"})
    assert_refused_by_stand_in(out)
    body = only(out, "POST", "/sandbox")
    assert body["networkAllowList"] == f"{PUBLIC_IP}/32"
    assert body["env"] == {
        "ANTHROPIC_BASE_URL": f"http://{PUBLIC_IP}:8081/anthropic", "ANTHROPIC_API_KEY": TOKEN,
        "OPENAI_BASE_URL": f"http://{PUBLIC_IP}:8081/openai/v1", "OPENAI_API_KEY": TOKEN,
    } | ca_env()


# --- Runloop ---------------------------------------------------------------------------------


def test_runloop_policy_blueprint_and_devbox(ca_pem, tmp_path):
    out = run("runloop", "proxy", ca_pem, tmp=tmp_path)
    policy = only(out, "POST", "/v1/network-policies")
    assert policy["allowed_cidrs"] == [{"cidr": f"{PUBLIC_IP}/32", "ports": [
        {"port": 8080, "protocol": "TCP"}, {"port": 1080, "protocol": "TCP"}]}]
    assert policy["allowed_hostnames"] == []
    assert not any(policy[k] for k in ("allow_all", "allow_devbox_to_devbox", "allow_agent_gateway",
                                       "allow_mcp_gateway", "allow_runloop_mirrors"))
    blueprint = only(out, "POST", "/v1/blueprints")
    assert blueprint["launch_parameters"] == {"network_policy_id": "np_test"}
    assert installed_ca(blueprint["dockerfile"]).strip() == ca_pem.strip()
    devbox = only(out, "POST", "/v1/devboxes")
    assert devbox["blueprint_name"] == "sandgate-ca"
    assert devbox["launch_parameters"] == {"network_policy_id": "np_test"}
    assert devbox["environment_variables"] == proxy_env()
    assert out["error"].count("refused by the test server") == 2  # blueprint, devbox
