"""The SOCKS5 listener's pure parts: its layer is installed, its flags, the mode pin, and the
credentials it turns into the one Basic check (mitm/guards/socks5.py)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.proxy import mode_servers
from mitmproxy.proxy.layers import modes

from sandgate.addons.pinned import pinned
from sandgate.errors import Code, IdentityError
from sandgate.mitm.guards import socks5
from sandgate.tokens import authenticate_basic, issue_token
from tests.support.cli import run_cli

KEY = b"k" * 32


def test_socks5_mode_is_served_by_sandgates_layer():
    socks5.install()
    socks5.install()
    assert socks5.installed()
    from mitmproxy import options
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import tflow

    ctx = Context(tflow.tclient_conn(), options.Options())
    top = mode_servers.Socks5Instance.make_top_layer(None, ctx)  # type: ignore[arg-type]
    assert isinstance(top, socks5.SandgateSocks5) and isinstance(top, modes.Socks5Proxy)
    # the mitmproxy methods the subclass builds on still exist
    for name in ("state_auth", "state_connect", "socks_err", "finish_start", "done"):
        assert callable(getattr(modes.Socks5Proxy, name))
    assert socks5.Socks5ConnectHook.name == "socks5_connect"


def test_mode_pin_is_exactly_the_configured_listeners():
    assert pinned("1m", None)["mode"] == ["regular"]
    assert pinned("1m", None, ("127.0.15.1", 1080))["mode"] == ["regular",
                                                                "socks5@127.0.15.1:1080"]
    assert pinned("1m", None, ("::1", 1080))["mode"] == ["regular", "socks5@::1:1080"]
    from mitmproxy.proxy.mode_specs import ProxyMode

    spec = ProxyMode.parse("socks5@::1:1080")
    assert spec.custom_listen_host == "::1" and spec.custom_listen_port == 1080


def test_socks5_credentials_are_the_basic_proxy_credentials():
    tok = issue_token(KEY, "coding-agent", ttl_seconds=3600)
    header = socks5.basic_credentials("coding-agent", tok)
    assert authenticate_basic(header, KEY).identity == "coding-agent"
    assert socks5.basic_credentials("", "") is None
    with pytest.raises(IdentityError) as e:
        authenticate_basic(socks5.basic_credentials("bash-tool", tok), KEY)
    assert e.value.code == Code.AUTH_INVALID


@given(st.text(max_size=40), st.text(max_size=60))
def test_any_socks5_credentials_refuse_or_identify_never_crash(user, password):
    header = socks5.basic_credentials(user, password)
    if header is None:
        return
    with pytest.raises(IdentityError):
        authenticate_basic(header, KEY)


def test_source_allow():
    nets = socks5.parse_allow(["10.20.0.0/16", "fd00::/8"])
    assert socks5.source_allowed("10.20.3.4", nets)
    assert socks5.source_allowed("::ffff:10.20.3.4", nets)  # dual-stack socket's spelling
    assert socks5.source_allowed("fd00::5", nets)
    assert not socks5.source_allowed("10.21.0.1", nets)
    assert not socks5.source_allowed("not-an-ip", nets)
    assert socks5.source_allowed("192.0.2.1", ())  # no ranges: every source
    assert nets[0] == ipaddress.ip_network("10.20.0.0/16")
    with pytest.raises(ValueError, match="--socks5-allow"):
        socks5.parse_allow(["10.20.0.1/16"])


def test_connect_flow_is_a_connect_to_the_target():
    from mitmproxy.test import tflow

    client = tflow.tclient_conn()
    f = socks5.connect_flow(client, "::1", 443, None)
    assert f.request.method == "CONNECT" and f.request.host == "::1" and f.request.port == 443
    assert "proxy-authorization" not in f.request.headers
    f = socks5.connect_flow(client, "api.example.com", 443, "Basic eA==")
    assert f.request.headers["proxy-authorization"] == "Basic eA=="


@pytest.mark.parametrize("args,message", [
    (["--socks5-allow", "127.0.0.1/32"], "give --socks5"),
    (["--socks5", "LISTEN"], "own port"),
    (["--socks5", "127.0.15.2:1080", "--admin", "127.0.15.2:1080"], "own port"),
    (["--socks5", "127.0.15.2:1080", "--socks5-allow", "10.0.0.1/8"], "--socks5-allow"),
    (["--socks5", "nohost"], "HOST:PORT"),
])
def test_bad_socks5_flags_refused_at_start(tmp_path, args, message, monkeypatch):
    monkeypatch.setenv("SANDGATE_ADMIN_TOKEN", "x")
    args = ["127.0.0.1:18080" if a == "LISTEN" else a for a in args]
    r = run_cli("run", "--policies", "tests/integration/policies", "--listen", "127.0.0.1:18080",
                "--confdir", str(tmp_path / "conf"), *args)
    assert r.returncode == 2
    assert message in r.stderr, r.stderr[-1500:]
