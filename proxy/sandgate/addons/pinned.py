"""The mitmproxy options the security argument depends on, pinned: `--set` cannot move them.

Each entry says why. An operator's `--set` of a pinned option is refused before start
(`check_sets`), and the `Pinned` addon refuses any later change (`configure` raises, which makes
mitmproxy roll the change back).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mitmproxy import ctx, exceptions

# name -> (value, why). Values that depend on the run's configuration are filled by `pinned()`.
_PINNED: dict[str, tuple[Any, str]] = {
    "mode": (["regular"], "regular (and regular@HOST:PORT per --role-listen), plus "
             "socks5@HOST:PORT for --socks5 and one reverse listener for --gateway: the only "
             "modes whose every request passes Sandgate's hooks (socks5 "
             "only with Sandgate's own layer, mitm/guards/socks5.py, which requires the token and "
             "judges the CONNECT; the gateway's every request is re-targeted by its `gateways:` "
             "prefix or refused; dns resolves in-process, transparent/wireguard and other "
             "reverse targets change what is judged)"),
    "connection_strategy": ("lazy", "never dial before the request is judged"),
    "upstream_cert": (False, "it would dial at CONNECT, before anything is judged"),
    "stream_large_bodies": (None, "a streamed request reaches the upstream before the request "
                            "hook can judge it"),
    "validate_inbound_headers": (True, "mitmproxy's Content-Length/Transfer-Encoding and header "
                                 "name checks against request smuggling"),
    "websocket": (True, "with it off a 101 becomes a raw relay that no hook sees"),
    "rawtcp": (True, "raw bytes stay TCP flows that the tcp hooks drop unless passthrough"),
    "http3": (False, "QUIC is not judged by Sandgate"),
    "ignore_hosts": ([], "ignored connections bypass every hook"),
    "allow_hosts": ([], "connections outside it bypass every hook"),
    "tcp_hosts": ([], "it turns HTTP into raw TCP that no request hook sees"),
    "udp_hosts": ([], "it turns traffic into raw UDP that no hook sees"),
    "ssl_insecure": (False, "credentials are injected only over verified TLS"),
    "proxyauth": (None, "Sandgate authenticates callers itself"),
    "stickyauth": (None, "it copies Authorization across clients and identities"),
    "stickycookie": (None, "it copies cookies across clients and identities"),
    "anticache": (False, "it rewrites requests after they were judged"),
    "anticomp": (False, "it rewrites requests after they were judged"),
    "map_local": ([], "it answers requests from local files, outside the policy"),
    "map_remote": ([], "it rewrites targets after they were judged"),
    "modify_headers": ([], "it rewrites requests after they were judged"),
    "modify_body": ([], "it rewrites requests after they were judged"),
    "block_list": ([], "it answers requests outside the policy"),
    "server_replay": ([], "it answers requests outside the policy"),
    "client_replay": ([], "it sends requests nobody judged"),
    "scripts": ([], "more addons could change what was judged"),
    "onboarding": (False, "mitm.it would answer outside the policy"),
    "save_stream_file": (None, "it would write requests with injected secrets to disk"),
    "hardump": ("", "it would write requests with injected secrets to disk"),
    "proxy_debug": (False, "it logs frames and headers, injected secrets included"),
    "add_upstream_certs_to_client_chain": (False, "upstream certificates are not the sandbox's"),
    "keep_host_header": (False, "the Host header must be the judged one"),
    "upstream_auth": (None, "no credentials other than the rule's may be added"),
    "client_certs": (None, "a client certificate would be sent to every upstream"),
    "body_size_limit": (None, "bounds what is buffered before a request is judged "
                        "(--max-request-body)"),
    "ssl_verify_upstream_trusted_ca": (None, "upstream trust roots (--upstream-ca)"),
    "emudhra": (False, "it signs the sandboxes' certificates with a publicly known (compromised) "
                "CA key: anyone could then impersonate any upstream to a sandbox"),
    "emudhra_old": (False, "as emudhra (the same compromised key, another chain order)"),
    "store_streamed_bodies": (False, "it keeps every streamed body whole in memory: requests "
                              "with injected credentials, responses of any size"),
    "tcp_timeout": (600, "the idle timeout of every connection is --idle-timeout (whole "
                    "seconds, rounded up; 0: mitmproxy's 600 s)"),
}


def gateway_mode(host: str, port: int, tls_name: str | None) -> str:
    """The mitmproxy mode of the gateway listener: a reverse proxy whose fixed target is never
    dialled (the gate re-targets every request or refuses it, and `server_connect` refuses any
    dial it did not approve). The target's name is the one the listener's certificate carries
    (besides the client's SNI) when it serves TLS."""
    name = tls_name or "gateway.sandgate.invalid"
    name = f"[{name}]" if ":" in name else name
    return f"reverse:http://{name}:1@{host}:{port}"  # mitmproxy splits at the last ':'


def pinned(max_request_body: str, upstream_ca_bundle: str | None,
           socks5: tuple[str, int] | None = None, gateway: str | None = None,
           role_listens: Sequence[tuple[str, int]] = (),
           transparent: tuple[str, int] | None = None,
           idle_timeout: float | None = None) -> dict[str, Any]:
    """The pinned option values for one run: `mode` is exactly the configured listeners
    (`socks5`: the SOCKS5 listen address; `gateway`: the gateway listener's mode;
    `role_listens`: pattern 1's tool/other listeners, regular proxies, sandgate.identity.roles;
    `idle_timeout`: --idle-timeout, None for off)."""
    values = {name: value for name, (value, _) in _PINNED.items()}
    modes = ["regular"]
    if socks5 is not None:
        # mitmproxy splits the listen address at the last ':' (no brackets for IPv6)
        modes.append(f"socks5@{socks5[0]}:{socks5[1]}")
    if gateway is not None:
        modes.append(gateway)
    modes += [f"regular@{host}:{port}" for host, port in role_listens]
    if transparent is not None:  # judged by stages/clienthello.py and stages/s15_capture.py
        modes.append(f"transparent@{transparent[0]}:{transparent[1]}")
    values["mode"] = modes
    values["body_size_limit"] = max_request_body
    values["ssl_verify_upstream_trusted_ca"] = upstream_ca_bundle
    if idle_timeout:  # mitmproxy's watchdog takes whole seconds
        values["tcp_timeout"] = max(1, math.ceil(idle_timeout))
    return values


def why(name: str) -> str:
    return _PINNED[name][1]


def check_sets(sets: Sequence[str]) -> None:
    """Refuse an operator's `--set NAME=VALUE` of a pinned option (ValueError says why)."""
    for spec in sets:
        name = spec.split("=", 1)[0].strip()
        if name in _PINNED:
            raise ValueError(f"--set {name}: this option is pinned by Sandgate ({why(name)})")


class Pinned:
    """Refuses any change of a pinned option once mitmproxy runs."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = dict(values)

    def configure(self, updated: set[str]) -> None:
        for name in sorted(updated & self.values.keys()):
            if getattr(ctx.options, name) != self.values[name]:
                raise exceptions.OptionsError(
                    f"{name} is pinned by Sandgate ({why(name)}); it cannot be changed")
