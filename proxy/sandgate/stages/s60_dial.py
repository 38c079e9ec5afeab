"""Choose the dial: resolve once, check the address, and dial only what was checked.

A request pins the address it was judged for (per connection, so keep-alive reuses one checked
answer); `server_connect`, the one place every upstream dial passes, lets only those addresses
go (and a passthrough tunnel's, checked and pinned at its CONNECT: `pin_tunnel`). Whether a
passthrough CONNECT is relayed unseen or intercepted is decided at its TLS ClientHello
(`passthrough_hello`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from mitmproxy import http, tcp, tls
from mitmproxy.proxy import server_hooks

from sandgate.audit.export.marks import FORWARDED, mark
from sandgate.errors import Refused
from sandgate.mitm.guards import dialorigin, tunnels, wirelimits
from sandgate.mitm.speedups import parking, relay
from sandgate.netguard import DialTarget, IPNetwork, choose_address, may_dial, resolve
from sandgate.request import same_host
from sandgate.stages.context import GateState, allowing_rule, record, via_gateway
from sandgate.stages.flow import Conn, DialApproval, FlowRecord

log = logging.getLogger("sandgate")


async def pin(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The dial stage: the checked address this request goes to, approved for the dial."""
    info = rec.info
    assert info is not None
    rule = allowing_rule(rec)
    private_cidrs = rule.private_cidrs if rule is not None else ()
    conn = st.conn(flow.client_conn)
    target = conn.pinned.get((info.host, info.port))
    # A `public: true` rule resolves afresh: a pin chosen for another rule may have skipped
    # a non-public address that this rule must refuse the host for.
    only_public = rule is not None and rule.public
    if target is None or only_public or not may_dial(target.ip, private_cidrs):
        target = await choose(st, info.host, info.port, private_cidrs, only_public)
        conn.pinned[(info.host, info.port)] = target
    rec.dialed = f"{target.ip}:{target.port}"
    if via_gateway(flow):
        # One gateway connection serves several upstreams. mitmproxy reuses an upstream
        # connection for any request to the same address, so two names sharing an IP would
        # share a TLS connection verified for one of them: the dial is keyed by name, and
        # server_connect dials the checked address with that name as SNI.
        rec.dial = DialApproval((info.host, info.port), target, info.host)
    else:
        # Dial exactly the checked address; the Host header and SNI keep the name.
        rec.dial = DialApproval((str(target.ip), target.port), target, info.host)
        flow.request.data.host = str(target.ip)
        rec.reuse = reuse_key(conn, flow, rec, str(target.ip), target.port, info.host)
    mark(rec, FORWARDED)


def reuse_key(conn: Conn, flow: http.HTTPFlow, rec: FlowRecord, ip: str, port: int,
              name: str) -> parking.PoolKey | None:
    """The key under which this request may take a parked upstream connection (and leave its
    own): HTTPS inside an intercepted CONNECT of an identified caller. Not captured
    connections, not gateway requests (dialled by name), not a passthrough or refused tunnel."""
    if rec.caller is None or flow.request.scheme != "https" or conn.captured is not None:
        return None
    tunnel = tunnels.get(conn, flow.client_conn, flow.server_conn)
    if tunnel is None or tunnel.passthrough or tunnel.refusal is not None:
        return None
    sockname = flow.client_conn.sockname
    listener = (str(sockname[0]), int(sockname[1])) if sockname else None
    return parking.key_for(rec.caller, listener, ip, port, name)


async def choose(st: GateState, host: str, port: int, private_cidrs: Iterable[IPNetwork],
                 only_public: bool = False) -> DialTarget:
    ips = await resolve(host, port, st.cfg.resolve_overrides)
    return choose_address(host, port, ips, private_cidrs, st.cfg.self_addresses, only_public)


async def pin_tunnel(st: GateState, flow: http.HTTPFlow) -> None:
    """A passthrough CONNECT: its address is checked (internal_address, self_address) and
    pinned now, so it is refused at the CONNECT, and the tunnel dials only that address."""
    conn = st.conn(flow.client_conn)
    tunnel = tunnels.get(conn, flow.client_conn, flow.server_conn)
    if tunnel is None or not tunnel.passthrough or tunnel.rule is None:
        return
    try:
        tunnel.target = await choose(st, tunnel.host, tunnel.port, tunnel.rule.private_cidrs)
    except Refused:
        conn.tunnels.pop(tunnels.key(flow.client_conn, flow.server_conn), None)  # no tunnel
        raise


async def server_connect(st: GateState, data: server_hooks.ServerConnectionHookData) -> None:
    """The one place every upstream dial passes: only approved, checked addresses go."""
    conn = st.conn(data.client)
    server = data.server
    address = server.address
    if address is None:
        server.error = "sandgate: no address"
        return
    key = (str(address[0]), int(address[1]))
    asker = dialorigin.take(server)
    approval = record(asker).dial if asker is not None else None
    if approval is not None and approval.address == key:
        if approval.address != approval.target.address:
            # a gateway request: dial the checked address, the connection's address stays the
            # name (mitmproxy keys reuse by it; no rename once open)
            wirelimits.dial_at(server, approval.target.address)
        # TLS verifies the name the request was judged for (we dial an IP)
        server.sni = approval.name
        return
    tunnel = tunnels.get(conn, data.client, server)
    if tunnel is not None and tunnel.passthrough and tunnel.rule is not None:
        if same_host(str(address[0]), tunnel.host) and address[1] == tunnel.port:
            target = tunnel.target or await choose(st, tunnel.host, tunnel.port,
                                                   tunnel.rule.private_cidrs)
            server.address = target.address
            wirelimits.exempt(server)  # raw bytes: the idle timeout applies, not the read one
            return
    server.error = "sandgate: connection was not approved"


def passthrough_hello(st: GateState, data: tls.ClientHelloData) -> None:
    """Relay a passthrough tunnel unseen only when its SNI names what the CONNECT named."""
    try:
        tunnel = tunnels.get(st.conn(data.context.client), data.context.client,
                             data.context.server)
        if tunnel is not None:
            tunnel.sni = data.client_hello.sni  # this tunnel's own (not the connection's)
        if tunnel is None or not tunnel.passthrough:
            return
        sni = data.client_hello.sni
        # Pass through only what the CONNECT named; otherwise intercept and let the request
        # hook refuse the disagreement with a readable answer.
        if sni is not None and same_host(sni, tunnel.host):
            data.ignore_connection = True
            relay.verified(data.context)  # relayed lean once the approved dial is up
    except Exception:
        log.exception("sandgate: tls_clienthello failed; intercepting instead")


def tunnel_tls_up(st: GateState, data: tls.TlsData) -> None:
    """The TLS inside a tunnel is up (TLS to the proxy port itself is no tunnel's)."""
    tunnel = tunnels.get(st.conn(data.context.client), data.context.client, data.context.server)
    if tunnel is not None:
        tunnel.tls = True


def raw_allowed(st: GateState, flow: tcp.TCPFlow) -> bool:
    """Raw bytes inside a CONNECT are relayed only where a passthrough rule allows them:
    there is nothing to judge in them (server_connect refuses the dial otherwise too)."""
    try:
        tunnel = tunnels.get(st.conn(flow.client_conn), flow.client_conn, flow.server_conn)
        if tunnel is not None and tunnel.passthrough:
            return True
    except Exception:
        log.exception("sandgate: tcp_message failed; dropping")
    return False
