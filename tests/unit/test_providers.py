"""sandgate.providers without the provider SDKs: input checks, the shared environment, the CA step.

What the SDKs do with the recipes' output is tested in tests/integration/test_providers.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandgate.providers import (
    SandgateAccess,
    daytona_create_params,
    e2b_sandbox_kwargs,
    gateway_environment,
    modal_sandbox_kwargs,
    runloop_blueprint_kwargs,
    runloop_devbox_kwargs,
    runloop_network_policy_kwargs,
)
from sandgate.proxyenv import ENV_NAMES, ca_install_command, proxy_environment

pytestmark = pytest.mark.unit

CA = "-----BEGIN CERTIFICATE-----\nMIIBdGVzdA==\n-----END CERTIFICATE-----\n"


def access(host: str = "203.0.113.7", **kw: object) -> SandgateAccess:
    args: dict[str, object] = {"host": host, "ca_pem": CA, "identity": "coding-agent",
                               "token": "sg1.payload.mac", "proxy_port": 8080,
                               "socks5_port": 1080}
    args.update(kw)
    return SandgateAccess(**args)  # type: ignore[arg-type]


def test_importing_the_recipes_imports_no_provider_sdk():
    code = ("import sys, sandgate.providers; "
            "print([m for m in ('e2b', 'modal', 'daytona', 'runloop_api_client') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "proxy")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("kw,msg", [
    ({"host": ""}, "host must be"),
    ({"host": "203.0.113.0/24"}, "host must be"),
    ({"ca_pem": "not a cert"}, "not a PEM certificate"),
    ({"ca_pem": CA + "-----BEGIN PRIVATE KEY-----\n"}, "private key"),
    ({"identity": "bad identity"}, "invalid identity"),
    ({"token": ""}, "token must be"),
    ({"token": "a b"}, "token must be"),
    ({"proxy_port": 0}, "proxy_port must be"),
    ({"socks5_port": 70000}, "socks5_port must be"),
])
def test_bad_access_is_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        access(**kw)


def test_the_proxy_environment_is_the_launchers():
    """One builder: the Docker launcher's sandboxes and the hosted ones see the same variables."""
    from sandgate.sandbox.launcher import SandboxSpec, sandbox_environment

    spec = SandboxSpec(identity="coding-agent", proxy_url="http://203.0.113.7:8080", ca_pem=CA,
                       token="sg1.payload.mac")
    docker_env = sandbox_environment(spec, "sbx-1")
    hosted = access().proxy_env()
    assert {k: v for k, v in docker_env.items() if k != "SANDGATE_SANDBOX"} == hosted
    assert set(hosted) == ENV_NAMES | {"SANDGATE_IDENTITY"}
    assert hosted["HTTPS_PROXY"] == hosted["all_proxy"] == \
        "http://coding-agent:sg1.payload.mac@203.0.113.7:8080"
    assert hosted["NO_PROXY"] == hosted["no_proxy"] == ""
    assert hosted["NODE_USE_ENV_PROXY"] == "1"


def test_credentials_in_the_proxy_url_are_percent_encoded():
    env = access(identity="agent@team", token="sg1.a/b:c").proxy_env()
    assert env["HTTPS_PROXY"] == "http://agent%40team:sg1.a%2Fb%3Ac@203.0.113.7:8080"


def test_ipv6_hosts_are_bracketed():
    a = access(host="2001:db8::7")
    assert a.proxy_url().endswith("@[2001:db8::7]:8080")
    assert a.cidr("Modal", "outbound_cidr_allowlist") == "2001:db8::7/128"


@pytest.mark.parametrize("call", [
    lambda a: modal_sandbox_kwargs(a),
    lambda a: daytona_create_params(a),
    lambda a: runloop_network_policy_kwargs(a, name="p"),
    lambda a: e2b_sandbox_kwargs(a, mode="proxy"),
], ids=["modal", "daytona", "runloop", "e2b-proxy"])
def test_cidr_allow_lists_need_an_address_not_a_name(call):
    with pytest.raises(ValueError, match="takes CIDRs, not names"):
        call(access(host="sandgate.example.com"))


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "169.254.169.254"])
def test_an_address_the_sandbox_cannot_reach_is_refused(host):
    with pytest.raises(ValueError, match="not reachable"):
        modal_sandbox_kwargs(access(host=host))


def test_e2b_socks5_needs_the_socks5_port_and_a_public_address():
    with pytest.raises(ValueError, match="SOCKS5 port"):
        e2b_sandbox_kwargs(access(socks5_port=None))
    with pytest.raises(ValueError, match="private or internal"):
        e2b_sandbox_kwargs(access(host="10.0.0.5"))
    with pytest.raises(ValueError, match="255 bytes"):
        e2b_sandbox_kwargs(access(host="sandgate.example.com", token="t" * 256))
    with pytest.raises(ValueError, match="unknown keys"):
        e2b_sandbox_kwargs(access(host="sandgate.example.com"), socks5_tls={"verify": "no"})
    with pytest.raises(ValueError, match="8192"):
        e2b_sandbox_kwargs(access(host="sandgate.example.com"),
                           socks5_tls={"ca_cert": CA + "x" * 8192})
    with pytest.raises(ValueError, match="mode='socks5' only"):
        e2b_sandbox_kwargs(access(), mode="proxy", socks5_tls=True)
    with pytest.raises(ValueError, match="mode must be"):
        e2b_sandbox_kwargs(access(), mode="vpn")  # type: ignore[arg-type]


def test_e2b_socks5_kwargs():
    kw = e2b_sandbox_kwargs(access(host="sandgate.example.com"), template="sandgate-ca")
    assert kw["template"] == "sandgate-ca"
    assert kw["network"] == {"egress_proxy": {"address": "sandgate.example.com:1080",
                                              "username": "coding-agent",
                                              "password": "sg1.payload.mac"}}
    assert not any("PROXY" in k.upper() for k in kw["envs"])


def test_runloop_refusals():
    with pytest.raises(ValueError, match="IPv4"):
        runloop_network_policy_kwargs(access(host="2001:db8::7"), name="p")
    with pytest.raises(ValueError, match="proxy_port"):
        runloop_network_policy_kwargs(access(proxy_port=None, socks5_port=None), name="p")
    with pytest.raises(ValueError, match="network_policy_id is required"):
        runloop_devbox_kwargs(access(), blueprint_name="b", network_policy_id="")
    with pytest.raises(ValueError, match="base_image"):
        runloop_blueprint_kwargs(CA, name="b", base_image="ubuntu; rm -rf /")
    with pytest.raises(ValueError, match="not a PEM"):
        runloop_blueprint_kwargs("x", name="b")


def test_runloop_policy_allows_only_the_given_ports():
    kw = runloop_network_policy_kwargs(access(socks5_port=None), name="p")
    assert kw["allowed_cidrs"] == [{"cidr": "203.0.113.7/32",
                                    "ports": [{"port": 8080, "protocol": "TCP"}]}]


def test_daytona_refusals():
    with pytest.raises(ValueError, match="not both"):
        daytona_create_params(access(), image="python:3.12", snapshot="s")
    with pytest.raises(ValueError, match=r"is not access\.host"):
        daytona_create_params(access(), gateway_url="http://198.51.100.1:8081",
                              gateway_base_urls={"ANTHROPIC": "/anthropic"})


@pytest.mark.parametrize("url,bases,msg", [
    ("ftp://h:1", {"A": "/a"}, "gateway_url must be"),
    ("http://u:p@h:1", {"A": "/a"}, "gateway_url must be"),
    ("http://h:1", {}, "base_urls is empty"),
    ("http://h:1", {"anthropic": "/a"}, "variable prefix"),
    ("http://h:1", {"A": "a"}, "must start with /"),
])
def test_gateway_environment_refusals(url, bases, msg):
    with pytest.raises(ValueError, match=msg):
        gateway_environment(url, "sg1.t.m", bases)


def test_gateway_environment():
    assert gateway_environment("https://sandgate.internal:8443/", "sg1.t.m",
                               {"ANTHROPIC": "/anthropic"}) == {
        "ANTHROPIC_BASE_URL": "https://sandgate.internal:8443/anthropic",
        "ANTHROPIC_API_KEY": "sg1.t.m"}


def test_proxy_environment_without_credentials():
    env = proxy_environment("http://10.0.0.1:8080")
    assert env["https_proxy"] == "http://10.0.0.1:8080"


def test_the_ca_step_installs_the_ca_without_update_ca_certificates(tmp_path):
    """The image build step, run by a real shell: the fallback appends the CA to the bundle (the
    PATH holds only the tools the step needs, so update-ca-certificates is never the system's)."""
    from tests.support.pki import make_pki

    pem = make_pki(tmp_path / "pki", ["x.test"]).ca_cert.read_text()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("mkdir", "base64", "cat", "grep", "sed", "echo"):
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    ca_file, bundle = tmp_path / "ca" / "sandgate.crt", tmp_path / "bundle.crt"
    bundle.write_text("system roots\n")
    cmd = ca_install_command(pem, ca_file=str(ca_file), ca_bundle=str(bundle))
    r = subprocess.run([shutil.which("sh") or "sh", "-c", cmd], env={"PATH": str(bindir)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ca_file.read_text().strip() == pem.strip()
    assert bundle.read_text() == "system roots\n" + pem.strip() + "\n"
    # a bundle that does not end up holding the CA fails the build step
    cmd = ca_install_command(pem, ca_file=str(ca_file), ca_bundle="/dev/null")
    r = subprocess.run([shutil.which("sh") or "sh", "-c", cmd], env={"PATH": str(bindir)},
                       capture_output=True, text=True)
    assert r.returncode != 0
