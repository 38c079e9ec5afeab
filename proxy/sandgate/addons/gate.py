"""The Sandgate addon: mitmproxy's hooks, in the order a request meets them, and nothing else.

Each hook calls the stages of sandgate.stages (one module per stage, listed in the order a
request takes them); `HEAD_PATH` and `REQUEST_PATH` below are the request's path, one line per
stage. To add a stage, see sandgate/stages/__init__.py.

Every hook that judges is wrapped by `guarded`: a `Refused` raised anywhere below becomes the
sandbox's refusal (s80_refuse) and nothing else does, and any other exception refuses too
(internal_error). mitmproxy itself only logs a hook's exception and lets the flow continue, which
for a security proxy would mean forwarding a request nobody judged.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mitmproxy import connection, dns, http, tcp, tls, udp
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layers import modes

from sandgate.errors import Refused
from sandgate.llm import spend
from sandgate.mitm.guards import readable
from sandgate.mitm.guards.socks5 import REP_NOT_ALLOWED, Socks5ConnectData, connect_flow
from sandgate.mitm.speedups import relay
from sandgate.stages import (
    clienthello,
    s10_identify,
    s15_capture,
    s20_head,
    s30_body,
    s35_call,
    s36_sigv4,
    s37_llm,
    s38_ask,
    s40_forward,
    s50_inject,
    s55_sign,
    s60_dial,
    s70_scrub,
    s80_refuse,
    s90_audit,
)
from sandgate.stages.context import GateConfig, GateState, via_gateway
from sandgate.stages.context import record as _record
from sandgate.stages.flow import FlowRecord

log = logging.getLogger("sandgate")

F = TypeVar("F", bound=Callable[..., Awaitable[None]])
Stage = Callable[[GateState, http.HTTPFlow, FlowRecord], Awaitable[None]]

# Judged from the head alone, before any body is read (requestheaders; request again when a
# flow skipped it). A stage that needs only the head goes here.
HEAD_PATH: tuple[Stage, ...] = (
    s15_capture.head,  # transparent capture: the ClientHello's refusal; Host vs destination
    s20_head.judge,  # identifies (s10_identify) and decides
)

# The complete request, judged and made ready to forward, in order.
REQUEST_PATH: tuple[Stage, ...] = (
    s30_body.check,
    s35_call.judge,
    s36_sigv4.judge,  # a signing rule judges what the signature covers (operation, sources)
    s37_llm.judge,  # an LLM call: model, output cap, budget reserved (sandgate.llm.spend)
    s38_ask.hold,  # `action: ask`: waits for approval; nothing prepared, injected or dialled
    s40_forward.prepare_head,
    s50_inject.inject,
    s55_sign.sign,
    s60_dial.pin,
    s70_scrub.ask_plain,
)

__all__ = ["HEAD_PATH", "REQUEST_PATH", "Gate", "GateConfig", "_record", "guarded",
           "via_gateway"]


def guarded(fn: F) -> F:
    """Run a hook; a `Refused` becomes the refusal, any other exception refuses as well."""

    @functools.wraps(fn)
    async def wrapper(self: Gate, obj: Any) -> None:
        try:
            await fn(self, obj)
        except Refused as e:
            s80_refuse.refused(self, obj, e)
        except Exception:
            log.exception("sandgate: %s hook failed; refusing", fn.__name__)
            s80_refuse.fail(obj)

    return wrapper  # type: ignore[return-value]


async def _run(st: GateState, path: tuple[Stage, ...], flow: http.HTTPFlow) -> None:
    rec = _record(flow)
    for stage in path:
        await stage(st, flow, rec)
        if rec.refused:
            return  # the stage answered the flow itself (s35_call: JSON-RPC errors)


class Gate(GateState):
    # ---------------------------------------------------------------- connections

    def client_connected(self, client: connection.Client) -> None:
        if s10_identify.admit_client(self, client):
            s10_identify.admit_socks_source(self, client)

    def client_disconnected(self, client: connection.Client) -> None:
        self.conns.pop(client.id, None)
        self.counts.disconnected(client.id)
        relay.forget(client)

    # ---------------------------------------------------------------- CONNECT and SOCKS5
    # Each SOCKS5 step is judged on a CONNECT flow built from it (mitm/guards/socks5.py), by the
    # HTTP listener's code: the same identity check, decision, tunnel and `connect` event.

    @guarded
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        await s20_head.judge_connect(self, flow, _record(flow))
        await s60_dial.pin_tunnel(self, flow)  # passthrough: its address checked at CONNECT
        s90_audit.audit(self, flow, event="connect")

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        s90_audit.audit(self, flow, event="connect")

    def socks5_auth(self, data: modes.Socks5AuthData) -> None:
        s10_identify.socks_auth(self, data)

    async def socks5_connect(self, data: Socks5ConnectData) -> None:
        """A SOCKS5 CONNECT is an HTTP CONNECT: granted unless http_connect answered it."""
        data.reply = REP_NOT_ALLOWED
        flow = connect_flow(data.client_conn, data.host, data.port,
                            self.conn(data.client_conn).socks_auth)
        await self.http_connect(flow)
        if flow.response is None and _record(flow).caller is not None:
            data.reply = None  # granted (a deferred policy refusal is answered inside)
        else:
            s90_audit.audit(self, flow, event="connect")

    async def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        await clienthello.hello(self, data)  # a captured connection: its stand-in CONNECT first
        s60_dial.passthrough_hello(self, data)

    def tls_established_client(self, data: tls.TlsData) -> None:
        s60_dial.tunnel_tls_up(self, data)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        if not s60_dial.raw_allowed(self, flow):
            s80_refuse.drop_raw(flow)

    def udp_message(self, flow: udp.UDPFlow) -> None:
        s80_refuse.drop_raw(flow)

    def dns_request(self, flow: dns.DNSFlow) -> None:
        s80_refuse.refuse_dns(flow)

    # ---------------------------------------------------------------- dialling

    @guarded
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        await s60_dial.server_connect(self, data)

    # ---------------------------------------------------------------- requests

    @guarded
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Judge the head before any body is read: nothing unbounded before identity is known."""
        if flow.error is not None:
            return  # mitmproxy is refusing it already (invalid head, body over the limit)
        try:
            await _run(self, HEAD_PATH, flow)
        except Refused as e:
            s80_refuse.refused(self, flow, e)
            # answered now, its body unread (HTTP/1); else do not buffer a large body to refuse it
            if not readable.answer_early(flow) and s20_head.large_body(flow.request):
                flow.kill()

    @guarded
    async def request(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        if rec.refused:
            return  # answered at requestheaders
        if rec.decision is None:
            await _run(self, HEAD_PATH, flow)  # never forward what requestheaders did not judge
        await _run(self, REQUEST_PATH, flow)

    # ---------------------------------------------------------------- responses

    @guarded
    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        s70_scrub.response_headers(self, flow, _record(flow))

    def response(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        s70_scrub.finish(self, flow, rec)
        # an LLM call's reservation settled from its usage: started here, before the client is
        # sent the end of the answer (mitmproxy sends it after this hook), so that a next call
        # finds it settled (sandgate.llm.spend)
        spend.settle(self.counts, rec.llm, False)
        s90_audit.audit(self, flow)

    def error(self, flow: http.HTTPFlow) -> None:
        s80_refuse.upstream_error(flow)
        s90_audit.audit(self, flow)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        s70_scrub.websocket_start(self, flow, _record(flow))

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        s70_scrub.websocket_message(self, flow, _record(flow))
