"""Transparent capture: a connection nftables redirected to `--transparent`, judged as a CONNECT.

A sandbox with no proxy settings connects to an upstream's address; the sandbox network's
nftables rules redirect the connection to Sandgate's transparent listener, and mitmproxy reports
where it was going (SO_ORIGINAL_DST). No token travels: the caller is the source address
(`--identity-cidr`, Docker labels) or nobody.

- TLS: the ClientHello's SNI stands for the CONNECT host, the original port for its port. The
  stand-in CONNECT is judged, pinned and audited by the CONNECT code itself
  (sandgate.stages.clienthello), after `check_destination`: the name must resolve (as Sandgate
  resolves it) to the address the sandbox connected to, otherwise a client could name an allowed
  host in its SNI while connecting anywhere. From then on the connection is a CONNECT tunnel to
  `SNI:port`: the Host header must agree with the SNI, passthrough rules stay passthrough, and
  Sandgate dials only its own checked resolution of the name, never the address the sandbox
  chose.
- Plain HTTP: the Host header names the host (the same destination check), the original port
  is the port; the request is then judged as a proxied `http://` request.

A connection DNATed in the sandbox's own namespace (a Kubernetes pod, compose) arrives
addressed to the listener itself: its original destination is unknown here, so only the name is
judged, with the scheme's port (443 for TLS, 80 for plain HTTP; a pod's table captures only
those two), and Sandgate still dials only its own resolution of the name.

A refusal at the ClientHello (unknown source, no SNI, a name that does not resolve to the
destination, any CONNECT refusal) cannot be answered there: the TLS handshake completes with a
certificate from Sandgate's CA and every request inside gets the refusal (`head`), so the
client can read it.
"""

from __future__ import annotations

import ipaddress

from mitmproxy import connection, http
from mitmproxy.net.http import url
from mitmproxy.proxy.mode_specs import TransparentMode

from sandgate.errors import BadRequest, Code, IdentityError
from sandgate.mitm.guards import tunnels
from sandgate.netguard import resolve
from sandgate.policy.hosts import normalise_host
from sandgate.stages.context import GateState
from sandgate.stages.flow import Captured, FlowRecord


def is_captured(client: connection.Client) -> bool:
    """Did this connection arrive on the transparent listener?"""
    return isinstance(client.proxy_mode, TransparentMode)


def captured(st: GateState, client: connection.Client) -> Captured:
    """The connection's capture record (mitmproxy set client.sockname to the original
    destination before any hook ran)."""
    conn = st.conn(client)
    if conn.captured is None:
        host, port = client.sockname[:2]
        original = (str(host), int(port))
        conn.captured = Captured(original=original, known=redirected_here(client, original))
    return conn.captured


def port_of(cap: Captured, tls: bool) -> int:
    """The port judged: where the sandbox connected to, or, when that is unknown here (DNATed
    in the pod's own namespace), the scheme's: 443 for TLS, 80 for plain HTTP (which is why a
    pod's table captures only those two ports, sandgate.capture.nftables)."""
    if cap.known:
        return cap.original[1]
    return 443 if tls else 80


def check_source(st: GateState, client: connection.Client) -> None:
    """No token travels over a captured connection: an address source must vouch for it."""
    ip = client.peername[0]
    if not st.cfg.identifier.address_known(ip):
        raise IdentityError(Code.AUTH_INVALID, f"no sandbox is known at address {ip}: "
                            "transparently captured connections are identified by their "
                            "source address only (--identity-cidr, Docker labels)")


def redirected_here(client: connection.Client, original: tuple[str, int]) -> bool:
    """Was the connection redirected on this host (so SO_ORIGINAL_DST is where the sandbox
    connected to)? A connection DNATed in another network namespace (a Kubernetes pod, the
    compose sandbox) arrives addressed to the listener itself: its destination is unknown here,
    and only the name is judged (Sandgate dials the name's checked resolution either way)."""
    mode = client.proxy_mode
    port = mode.custom_listen_port
    if port is None or original[1] != port:
        return True
    host = mode.custom_listen_host or ""
    return bool(host) and host not in ("0.0.0.0", "::") and not same_ip(host, original[0])


def same_ip(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    if isinstance(y, ipaddress.IPv6Address) and y.ipv4_mapped is not None:
        y = y.ipv4_mapped
    return x == y


async def check_destination(st: GateState, cap: Captured, host: str, what: str) -> None:
    """The name judged must resolve, as Sandgate resolves it, to the address the sandbox
    connected to: otherwise a name could be judged while the client meant another address."""
    if not cap.known:
        return
    addrs = await resolve(host, cap.original[1], st.cfg.resolve_overrides)
    if not any(same_ip(str(a), cap.original[0]) for a in addrs):
        raise BadRequest(Code.BAD_REQUEST, f"the {what} names {host[:100]}, which does not "
                         f"resolve to {cap.original[0]}, the address the connection was made to "
                         "(Sandgate judges the name, so the name and the address must agree)",
                         hint="resolve names with the sandbox's resolver (Sandgate's DNS)")


async def head(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The capture stage: a captured request's refusal from its ClientHello, its identity
    check, and (plain HTTP) its destination from the Host header. Other flows: nothing."""
    client = flow.client_conn
    if not is_captured(client):
        return
    cap = captured(st, client)
    if cap.refusal is not None:
        raise cap.refusal
    flow.request.headers.pop("proxy-authorization", None)  # no token travels; never forwarded
    check_source(st, client)
    if tunnels.get(st.conn(client), client, flow.server_conn) is not None:
        return  # TLS: judged as the CONNECT to SNI:port (sandgate.stages.clienthello)
    if client.tls_established or flow.request.scheme != "http":
        raise BadRequest(Code.BAD_REQUEST, "a TLS connection without a judged ClientHello")
    req = flow.request
    header = req.host_header
    if not header:
        raise BadRequest(Code.BAD_REQUEST, "the request has no Host header: a captured "
                         "plain-HTTP request is judged by the host it names")
    try:
        host = normalise_host(url.parse_authority(header, check=True)[0])
    except ValueError:
        raise BadRequest(Code.BAD_REQUEST, f"bad Host header {header[:100]!r}") from None
    await check_destination(st, cap, host, "Host header")
    req.data.host = host  # judged as http://HOST:PORT (the port: where it was going)
    req.data.port = port_of(cap, tls=False)
