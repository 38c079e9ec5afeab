"""Identify: who is calling, before anything unbounded is read on their behalf.

A connection is admitted (--max-connections, --socks5-allow) before one byte of it is parsed;
the caller then comes from the Proxy-Authorization (or the SOCKS5 username/password that stand
for it), from the tunnel a request arrives in, or from a gateway's token header (that one is
read by the head stage, s20_head, once the route names the header). The connection counts for
its identity from its first CONNECT or request on.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, http
from mitmproxy.proxy.layers import modes

from sandgate.errors import Code, IdentityError, Refused
from sandgate.identity.base import Caller
from sandgate.mitm.guards import admission, tunnels
from sandgate.mitm.guards.socks5 import basic_credentials, connect_flow, is_socks5, source_allowed
from sandgate.policy.model import Policy
from sandgate.stages.context import GateState, record
from sandgate.stages.flow import FlowRecord, Tunnel
from sandgate.stages.s80_refuse import refused
from sandgate.stages.s90_audit import audit, audit_limit

log = logging.getLogger("sandgate")


def admit_client(st: GateState, client: connection.Client) -> bool:
    """Past --max-connections (or --max-unidentified-per-source) a new client connection is
    closed at once (and audited)."""
    try:
        refused = admission.admit(st.cfg.limiter, client)  # also per source, unidentified
        if refused is None:
            return True
        reason = refused
    except Exception:
        log.exception("sandgate: client_connected failed; closing")
        reason = "Sandgate hit an internal error"
    client.error = f"sandgate: {reason}"
    audit_limit(st, Code.TOO_MANY_CONNECTIONS, reason, client)
    return False


def admit_socks_source(st: GateState, client: connection.Client) -> None:
    """--socks5-allow: a SOCKS5 client from another source is dropped before one byte of its
    handshake is read (audited as auth_invalid: no sandbox is served from there)."""
    try:
        if not is_socks5(client) or source_allowed(client.peername[0], st.cfg.socks5_allow):
            return
        client.error = "sandgate: source address outside --socks5-allow"
        socks_refused(st, connect_flow(client, "", 0, None), IdentityError(
            Code.AUTH_INVALID, f"the SOCKS5 listener does not serve address "
            f"{client.peername[0]} (outside --socks5-allow)"))
    except Exception:
        log.exception("sandgate: client_connected failed; dropping the client")
        client.error = "sandgate: internal error"


def socks_auth(st: GateState, data: modes.Socks5AuthData) -> None:
    """The SOCKS5 username/password are the identity and the token of Proxy-Authorization;
    no credentials is auth_required even where an address source would vouch."""
    data.valid = False
    flow = connect_flow(data.client_conn, "", 0, None)
    try:
        header = basic_credentials(data.username, data.password)
        if header is None:
            raise IdentityError(Code.AUTH_REQUIRED, "proxy authentication required: the "
                                "SOCKS5 listener needs username/password authentication "
                                "with the identity as user and a proxy token as password")
        record(flow).caller = identify(st, flow, header)
        st.conn(data.client_conn).socks_auth = header
        data.valid = True
    except Refused as e:
        socks_refused(st, flow, e)
    except Exception:
        log.exception("sandgate: socks5_auth failed; refusing")
        socks_refused(st, flow, Refused(Code.INTERNAL_ERROR, "Sandgate hit an internal "
                                        "error; nothing was sent"))


def socks_refused(st: GateState, flow: http.HTTPFlow, error: Refused) -> None:
    """A SOCKS5 step refused: answered and audited as the CONNECT it stands for."""
    try:
        refused(st, flow, error)
    finally:
        audit(st, flow, event="connect")


def identify(st: GateState, flow: http.HTTPFlow, proxy_authorization: str | None) -> Caller:
    client = flow.client_conn
    return st.cfg.identifier.identify(proxy_authorization, client.peername[0],
                                      client.proxy_mode.custom_listen_port, connection_of(client))


def connection_of(client: connection.Client) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The client connection's (peer, local) address and port: with --agent-dir, the process
    holding the client's end decides who calls (sandgate.identity.agents)."""
    peer, local = client.peername, client.sockname
    if not peer or not local or len(peer) < 2 or len(local) < 2:
        return None
    return (str(peer[0]), int(peer[1])), (str(local[0]), int(local[1]))


def identify_proxied(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> Tunnel | None:
    """A proxied request's caller: its tunnel's, or its own Proxy-Authorization's (removed
    from the request either way: it is never forwarded). Returns the tunnel it arrived in."""
    auth = flow.request.headers.pop("proxy-authorization", None)
    tunnel = tunnels.get(st.conn(flow.client_conn), flow.client_conn, flow.server_conn)
    if tunnel is None and is_socks5(flow.client_conn):
        raise IdentityError(Code.AUTH_REQUIRED, "no SOCKS5 CONNECT was granted")
    rec.caller = tunnel.caller if tunnel is not None else identify(st, flow, auth)
    return tunnel


async def count_connection(st: GateState, flow: http.HTTPFlow, caller: Caller,
                           policy: Policy) -> None:
    """The connection counts for its identity from its first CONNECT or request on; a
    sandbox the fleet has ended is refused (its tokens end with it: sandgate.state.fleet)."""
    if caller.sandbox is not None and await st.counts.sandbox_ended(caller.sandbox):
        raise IdentityError(Code.AUTH_INVALID, f"sandbox '{caller.sandbox}' has ended: its "
                            "proxy tokens are no longer accepted")
    ident = policy.identities.get(caller.identity)
    await st.counts.identified(flow.client_conn.id, caller.identity,
                               ident.limits if ident is not None else None)
    admission.identified(flow.client_conn)  # no admission deadline from here on
