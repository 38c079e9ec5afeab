"""Judge the head: the request line and headers, before any body is read.

Bounded first (header count and bytes), then identified (s10_identify; on the gateway listener
from the token header the route names), parsed once (sandgate.request), decided once
(sandgate.decision), and held to the origin and protocol that were judged. A gateway request is
re-targeted here to the upstream request it stands for, so every later stage, mitmproxy and the
audit see only that. A CONNECT (HTTP or SOCKS5) is judged here too, on host and port; its
tunnel is the state every request inside is held to.
"""

from __future__ import annotations

import dataclasses

from mitmproxy import http
from mitmproxy.net.http import url

from sandgate.decision import decide, decide_connect, reported
from sandgate.errors import BadRequest, Code, LimitExceeded
from sandgate.gateway import route, take_token
from sandgate.limits import LimitsConfig
from sandgate.mitm.guards import tunnels, wirelimits
from sandgate.policy.hosts import normalise_host
from sandgate.policy.model import Policy
from sandgate.request import RequestInfo, check_head, check_tunnel, parse_proxied
from sandgate.stages.context import GateState, via_gateway
from sandgate.stages.flow import FlowRecord, Tunnel
from sandgate.stages.forward import check_authority, check_upgrade, upgrade_asked
from sandgate.stages.s10_identify import (
    connection_of,
    count_connection,
    identify,
    identify_proxied,
)
from sandgate.stages.s80_refuse import refusal_for
from sandgate.stages.s90_audit import check_writable

# Refusals of a CONNECT that are answered inside the tunnel instead (see Tunnel.refusal).
DEFERRABLE = frozenset({Code.NO_RULE, Code.DENIED_BY_RULE, Code.UNKNOWN_IDENTITY})

# A refused request announcing a larger body is killed rather than read only to be refused.
SMALL_BODY = 64 * 1024


async def judge(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The head stage: refuses (raises) or leaves rec.caller, rec.info and rec.decision set."""
    check_writable(st)
    req = flow.request
    check_head_size(st.cfg.limiter.config, req)
    policy = st.flow_policy(rec)
    if via_gateway(flow):
        info = gateway_head(st, flow, rec, policy)
    else:
        tunnel = identify_proxied(st, flow, rec)
        check_wire(req)
        if tunnel is not None and tunnel.policy is not policy:
            rejudge_tunnel(tunnel, policy)
        info = rec.info = parse(flow, rec, tunnel)
    upgrade = upgrade_asked(req)
    if upgrade is not None:  # a rule judging calls refuses it unless it says websocket: true
        info = rec.info = dataclasses.replace(info, upgrade=upgrade)
    caller = rec.caller
    assert caller is not None
    await count_connection(st, flow, caller, policy)  # once per connection
    ident = policy.identities.get(caller.identity)
    if ident is not None:  # an unknown identity is refused by decide()
        await st.counts.admit(caller.identity, ident.limits)
    d = rec.decision = decide(policy, caller.identity, info)
    if not d.allowed:
        if not reported(policy, caller.identity, d):
            raise d.refused()
        rec.reported = True  # forwarded without credentials; audited as `report`
    check_authority(req, info)
    check_upgrade(req)
    declared = declared_length(req)
    if declared is not None:  # a chunked body is measured as it is received (s30_body)
        check_size(st, declared, body_limit(st, rec))


def gateway_head(st: GateState, flow: http.HTTPFlow, rec: FlowRecord,
                 policy: Policy) -> RequestInfo:
    """A request on the gateway listener, turned into the proxied request it stands for:
    the upstream and the path after the prefix, the identity from the token header (which
    is removed). From here on it is judged and forwarded exactly as a proxied request."""
    req = flow.request
    if st.cfg.gateway_tls and not flow.client_conn.tls_established:
        raise BadRequest(Code.NOT_TLS, "this gateway takes TLS only: use https:// in the "
                         "SDK's base URL")
    check_wire(req)
    if req.authority and not (req.is_http2 or req.is_http3):
        raise BadRequest(Code.BAD_REQUEST, "the gateway takes origin-form targets only "
                         "(a path such as /anthropic/v1/messages), not absolute URLs")
    routed = route(policy.gateways, req.method, req.path)
    gw = routed.gateway
    rec.gateway = gw.prefix
    rec.info = routed.info  # refusals from here on name the upstream request
    client_ip = flow.client_conn.peername[0]
    identifier = st.cfg.identifier
    token = take_token(req.headers, gw, identifier.address_known(client_ip))
    rec.caller = identifier.identify_token(token, client_ip, None,
                                           connection_of(flow.client_conn))
    # Re-target: from now on mitmproxy, the hooks and the audit see the upstream request.
    req.data.scheme = b"https"
    req.data.host = gw.host
    req.data.port = gw.port
    req.data.path = routed.path.encode("latin-1", "surrogateescape")
    req.host_header = url.hostport("https", gw.host, gw.port)
    return routed.info


def parse(flow: http.HTTPFlow, rec: FlowRecord, tunnel: Tunnel | None) -> RequestInfo:
    """The request as the policy sees it; refuses one that disagrees with its tunnel."""
    req = flow.request
    try:
        info = parse_proxied(req.scheme, req.host, req.port, req.method, req.path,
                             req.host_header)
        rec.info = info
        if tunnel is not None:
            check_tunnel(info, tunnel.host, tunnel.port, tunnel.tls, tunnel.sni)
        elif req.scheme == "https":
            # https without a CONNECT (e.g. a TLS client talking to the proxy port directly)
            raise BadRequest(Code.BAD_REQUEST, "https requests must arrive through CONNECT")
    except BadRequest:
        if tunnel is not None and tunnel.refusal is not None:
            raise tunnel.refusal from None  # the CONNECT's refusal comes first
        raise
    if tunnel is not None and tunnel.refusal is not None:
        raise tunnel.refusal
    return info


def rejudge_tunnel(tunnel: Tunnel, policy: Policy) -> None:
    """A reload happened since the CONNECT: its (deferred) refusal follows the new policy.
    Requests inside are judged by the new policy anyway; passthrough is fixed at CONNECT."""
    tunnel.policy = policy
    if tunnel.passthrough:
        return
    d = decide_connect(policy, tunnel.caller.identity, tunnel.host, tunnel.port)
    tunnel.refusal = None
    if not d.allowed and not reported(policy, tunnel.caller.identity, d):
        tunnel.refusal = d.refused()


async def judge_connect(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """A CONNECT (or a SOCKS5 CONNECT's stand-in flow): identify, decide on host and port, and
    record the tunnel every request inside is held to. A policy refusal is deferred into the
    tunnel (answered to the first request inside, where clients show it)."""
    req = flow.request
    check_head_size(st.cfg.limiter.config, req)
    caller = rec.caller = identify(st, flow, req.headers.get("proxy-authorization"))
    await count_connection(st, flow, caller, st.flow_policy(rec))
    try:
        host = normalise_host(req.host)
    except ValueError as e:
        raise BadRequest(Code.BAD_REQUEST, f"bad CONNECT host: {e}") from None
    rec.info = RequestInfo("https", host, req.port, "CONNECT", "")
    policy = st.flow_policy(rec)
    d = rec.decision = decide_connect(policy, caller.identity, host, req.port)
    tunnel = Tunnel(caller=caller, host=host, port=req.port, rule=d.rule,
                    passthrough=d.tunnel,
                    policy=policy)
    if tunnel.passthrough:
        check_writable(st)  # a passthrough tunnel is forwarded at CONNECT, unseen after
    if not d.allowed:
        if d.code not in DEFERRABLE:
            raise d.refused()
        tunnel.rule = None
        if reported(policy, caller.identity, d):
            rec.reported = True  # intercepted; each request inside is judged (and reported)
        else:
            tunnel.refusal = d.refused()
            rec.refusal = refusal_for(st, flow, tunnel.refusal)
    tunnels.put(st.conn(flow.client_conn), flow.client_conn, flow.server_conn, tunnel)


def check_head_size(lim: LimitsConfig, req: http.Request) -> None:
    """Bounded before trusted: the head's size and header count, before anything else.
    (HTTP/1 heads past the byte limit never get this far: sandgate.mitm.guards.wirelimits.)"""
    count = len(req.headers.fields)
    if count > lim.max_headers:
        raise LimitExceeded(Code.HEADERS_TOO_LARGE, f"the request has {count} header "
                            f"fields; at most {lim.max_headers} are accepted",
                            hint="send fewer headers")
    size = wirelimits.head_bytes(req)
    if size > lim.max_header_bytes:
        raise LimitExceeded(Code.HEADERS_TOO_LARGE, f"the request head is {size} bytes; "
                            f"at most {lim.max_header_bytes} are accepted",
                            hint="send smaller headers (cookies, tokens)")


def check_wire(req: http.Request) -> None:
    """The head's bytes as received (not mitmproxy's reading of them) pass the one parser."""
    check_head(req.data.method.decode("latin-1"), req.data.path.decode("latin-1"),
               req.headers.fields)


def declared_length(req: http.Request) -> int | None:
    """The Content-Length the head declares, or None (chunked, or no body announced)."""
    if "transfer-encoding" in req.headers:
        return None
    try:
        return int(req.headers.get("content-length", "0") or 0)
    except ValueError:
        return None  # mitmproxy refuses a malformed length itself (validate_inbound_headers)


def body_expected(req: http.Request) -> int:
    """How many body bytes the head announces (a chunked body: unknown, so "large")."""
    if "transfer-encoding" in req.headers:
        return 1 << 62
    try:
        return int(req.headers.get("content-length", "0") or 0)
    except ValueError:
        return 1 << 62


def body_limit(st: GateState, rec: FlowRecord) -> int:
    """The request body limit: --max-request-body, or the allowing rule's
    max_request_bytes when smaller (report mode: no rule allowed, so the proxy's)."""
    d = rec.decision
    rule = d.rule if d is not None and d.allowed and not rec.reported else None
    if rule is not None and rule.max_request_bytes is not None:
        return min(st.cfg.max_request_body, rule.max_request_bytes)
    return st.cfg.max_request_body


def check_size(st: GateState, size: int, limit: int) -> None:
    if size > limit:
        which = ("this proxy accepts" if limit == st.cfg.max_request_body
                 else "the rule allowing it accepts (max_request_bytes)")
        raise BadRequest(Code.TOO_LARGE, f"the request body is larger than {which} "
                         f"({limit} bytes)")


def large_body(req: http.Request) -> bool:
    """Refused at the head with a body too large to read only to refuse it: kill instead."""
    return body_expected(req) > SMALL_BODY

