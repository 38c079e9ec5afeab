"""The SOCKS5 listener (`sandgate run --socks5 HOST:PORT`): a way in that reaches the same gate.

mitmproxy 11.0.2 has a SOCKS5 mode, but it asks for a username and password only when its own
`proxyauth` option is set (Sandgate pins that unset: it authenticates callers itself), and it has
no hook between the client's CONNECT command and the reply, so nothing could judge the target
before the tunnel is granted. Sandgate therefore replaces the mode's top layer with
`SandgateSocks5`, a subclass that keeps mitmproxy's parser and changes three things:

1. The greeting always selects username/password authentication (RFC 1929). A client that does
   not offer it is refused (`auth_required`, audited through the `socks5_auth` hook with empty
   credentials) even when an address source (Docker labels, `--identity-cidr`) would vouch for
   it: the SOCKS5 listener has no anonymous path.
2. The username/password are the identity (or sandbox id) and the proxy token, exactly as in
   `Proxy-Authorization: Basic`; the gate checks them in `socks5_auth` with the same function.
3. Before the reply to the CONNECT command, the `socks5_connect` hook (`Socks5ConnectHook`) hands
   the target to the gate, which judges it as an HTTP CONNECT (same function, same per-connection
   tunnel state). A refusal is a SOCKS failure reply (`reply` code) and a closed connection;
   policy refusals that an HTTP CONNECT answers inside the tunnel are answered inside this one.

What follows the reply is mitmproxy's usual stack for a CONNECT tunnel (TLS interception, HTTP in
transparent mode), so every request inside passes the same request hooks.

`install()` puts the layer in place once; `installed()` lets a unit test pin it.
"""

from __future__ import annotations

import base64
import ipaddress
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy import commands, layer, mode_servers
from mitmproxy.proxy.commands import StartHook
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.mode_specs import Socks5Mode

from sandgate.netguard import IPNetwork, in_ranges, unmap

# RFC 1928 reply codes Sandgate sends.
REP_GENERAL_FAILURE = 0x01
REP_NOT_ALLOWED = 0x02  # "connection not allowed by ruleset": every policy or auth refusal

_METHOD_USER_PASSWORD = modes.SOCKS5_METHOD_USER_PASSWORD_AUTHENTICATION
_MARK = "_sandgate_socks5"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


@dataclass
class Socks5ConnectData:
    """The target of a SOCKS5 CONNECT command, before it is answered.

    `host` is a domain name as the client sent it (socks5h: Sandgate resolves it) or an IP
    literal; `reply` is None to grant the tunnel, or the RFC 1928 reply code refusing it.
    """

    client_conn: connection.Client
    host: str
    port: int
    reply: int | None = REP_GENERAL_FAILURE  # fail closed: no hook answered, nothing granted


@dataclass
class Socks5ConnectHook(StartHook):
    """A SOCKS5 client asked for a tunnel to `data.host:data.port`: grant it by setting
    `data.reply = None`."""

    data: Socks5ConnectData


def basic_credentials(username: str, password: str) -> str | None:
    """The `Proxy-Authorization` value the SOCKS5 username/password stand for (None: none given),
    so that the one Basic parser and token check judge both listeners."""
    if not username and not password:
        return None
    raw = f"{username}:{password}".encode("utf-8", "surrogateescape")
    return "Basic " + base64.b64encode(raw).decode("ascii")


def is_socks5(client: connection.Client) -> bool:
    return isinstance(client.proxy_mode, Socks5Mode)


def connect_flow(client: connection.Client, host: str, port: int,
                 proxy_authorization: str | None) -> http.HTTPFlow:
    """The HTTP CONNECT a SOCKS5 step stands for ("" / 0: no target yet), so that the HTTP
    listener's CONNECT hook judges and audits it. It is never sent anywhere."""
    server = connection.Server(address=(host, port) if host else None)
    flow = http.HTTPFlow(client, server)
    headers = http.Headers()
    if proxy_authorization is not None:
        headers["proxy-authorization"] = proxy_authorization
    authority = "" if not host else f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    now = time.time()
    flow.request = http.Request(host, port, b"CONNECT", b"", authority.encode("utf-8",
                                "surrogateescape"), b"", b"SOCKS/5", headers, b"", None, now,
                                now)
    return flow


def parse_allow(specs: Sequence[str]) -> tuple[IPNetwork, ...]:
    """--socks5-allow CIDR values (ValueError with the fix when one is not a network)."""
    out: list[IPNetwork] = []
    for spec in specs:
        try:
            out.append(ipaddress.ip_network(spec.strip(), strict=True))
        except ValueError as e:
            raise ValueError(f"--socks5-allow {spec!r}: expected a network such as "
                             f"10.20.0.0/16 or 127.0.0.1/32 ({e})") from None
    return tuple(out)


def source_allowed(client_ip: str, allow: Iterable[IPNetwork]) -> bool:
    """Whether --socks5-allow admits this source (no ranges given: every source)."""
    ranges = tuple(allow)
    if not ranges:
        return True
    try:
        ip = unmap(ipaddress.ip_address(client_ip.split("%", 1)[0]))
    except ValueError:
        return False
    return in_ranges(ip, ranges)


class SandgateSocks5(modes.Socks5Proxy):
    """mitmproxy's SOCKS5 layer with authentication always required and the CONNECT judged."""

    _refusal_reply: int | None = None

    def state_greet(self) -> layer.CommandGenerator[None]:
        if len(self.buf) < 2:
            return
        if self.buf[0] != modes.SOCKS5_VERSION:
            yield from self.socks_err(f"not a SOCKS5 greeting (version byte {self.buf[0]:#x})")
            return
        n_methods = self.buf[1]
        if len(self.buf) < 2 + n_methods:
            return
        offered = self.buf[2:2 + n_methods]
        self.buf = self.buf[2 + n_methods:]
        if _METHOD_USER_PASSWORD not in offered:
            # Audited as auth_required by the gate; `valid` is ignored: never anonymous.
            yield modes.Socks5AuthHook(modes.Socks5AuthData(self.context.client, "", ""))
            yield commands.SendData(self.context.client, bytes(
                [modes.SOCKS5_VERSION, modes.SOCKS5_METHOD_NO_ACCEPTABLE_METHODS]))
            yield from self.socks_err("the client did not offer username/password "
                                      "authentication (the proxy token)")
            return
        yield commands.SendData(self.context.client,
                                bytes([modes.SOCKS5_VERSION, _METHOD_USER_PASSWORD]))
        self.state = self.state_auth
        yield from self.state()

    state: Callable[..., layer.CommandGenerator[None]] = state_greet

    def finish_start(self) -> layer.CommandGenerator[str | None]:
        address = self.context.server.address
        assert address is not None
        data = Socks5ConnectData(self.context.client, str(address[0]), int(address[1]))
        yield Socks5ConnectHook(data)
        if data.reply is not None:
            self._refusal_reply = data.reply
            self._handle_event = self.done
            return "refused by Sandgate"
        return (yield from super().finish_start())

    def state_connect(self) -> layer.CommandGenerator[None]:
        # mitmproxy's parser, with its fixed "host unreachable" failure reply replaced by the
        # code the gate chose.
        gen = super().state_connect()
        sent: Any = None
        try:
            while True:
                cmd = gen.send(sent)
                if (self._refusal_reply is not None and isinstance(cmd, commands.SendData)
                        and cmd.data[:2] == bytes([modes.SOCKS5_VERSION,
                                                   modes.SOCKS5_REP_HOST_UNREACHABLE])):
                    cmd = commands.SendData(cmd.connection, bytes(
                        [modes.SOCKS5_VERSION, self._refusal_reply]) + cmd.data[2:])
                sent = yield cmd
        except StopIteration:
            return


def _make_top_layer(self: Any, context: Any) -> layer.Layer:
    return SandgateSocks5(context)


def install() -> None:
    """Serve the SOCKS5 mode with SandgateSocks5 (idempotent)."""
    cls: Any = mode_servers.Socks5Instance
    if getattr(cls, _MARK, False):
        return
    cls.make_top_layer = _make_top_layer
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(mode_servers.Socks5Instance, _MARK, False))
