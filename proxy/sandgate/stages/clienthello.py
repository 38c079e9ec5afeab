"""A captured TLS connection's ClientHello, judged as the CONNECT to `SNI:original port` it
stands for: the same functions as an HTTP CONNECT (identify, decide, pin a passthrough's
address, audit a `connect` event). See sandgate/stages/s15_capture.py for the whole story.
"""

from __future__ import annotations

import logging
import time

from mitmproxy import connection, http, tls

from sandgate.errors import BadRequest, Code, Refused
from sandgate.policy.hosts import normalise_host
from sandgate.stages import s20_head, s60_dial, s80_refuse, s90_audit
from sandgate.stages.context import GateState, record
from sandgate.stages.s15_capture import (
    captured,
    check_destination,
    check_source,
    is_captured,
    port_of,
)

log = logging.getLogger("sandgate")


def stand_in(client: connection.Client, server: connection.Server, host: str,
             port: int) -> http.HTTPFlow:
    """The CONNECT a captured ClientHello stands for, on the connection's own Server (the key
    of its tunnel record). Never sent anywhere; no Proxy-Authorization (no token travels)."""
    flow = http.HTTPFlow(client, server)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    now = time.time()
    flow.request = http.Request(host, port, b"CONNECT", b"", authority.encode("utf-8",
                                "surrogateescape"), b"", b"HTTP/1.1", http.Headers(), b"",
                                None, now, now)
    return flow


async def hello(st: GateState, data: tls.ClientHelloData) -> None:
    """Judge a captured connection at its (outer) ClientHello. Granted: the connection is a
    tunnel to SNI:port from here on. Refused: the refusal waits for the first request inside
    the TLS (which the client completes with a certificate from Sandgate's CA)."""
    client = data.context.client
    if not is_captured(client):
        return
    cap = captured(st, client)
    if cap.hello_seen:
        return  # TLS inside the TLS: the tunnel's own rules apply
    cap.hello_seen = True
    orig_ip, port = cap.original[0], port_of(cap, tls=True)
    sni = data.client_hello.sni
    server = data.context.server
    flow = stand_in(client, server, sni or orig_ip, port)
    try:
        check_source(st, client)
        if sni is None:
            raise BadRequest(Code.BAD_REQUEST, f"the TLS handshake to {orig_ip}:{port} "
                             "carried no SNI: a captured TLS connection is judged by the host "
                             "name it names", hint="connect by host name, not by address")
        try:
            host = normalise_host(sni)
        except ValueError as e:
            raise BadRequest(Code.BAD_REQUEST, f"bad TLS SNI: {e}") from None
        await check_destination(st, cap, host, "TLS SNI")
        # From here on the connection is a CONNECT tunnel to host:port: the inner requests'
        # host, the dial and a passthrough's relay all follow the judged name.
        server.address = (host, port)
        flow.request.host = host
        await s20_head.judge_connect(st, flow, record(flow))
        await s60_dial.pin_tunnel(st, flow)
    except Refused as e:
        cap.refusal = e
        s80_refuse.refused(st, flow, e)
    except Exception:
        log.exception("sandgate: judging a captured ClientHello failed; refusing")
        cap.refusal = Refused(Code.INTERNAL_ERROR, "Sandgate hit an internal error; nothing "
                              "was sent")
        s80_refuse.refused(st, flow, cap.refusal)
    finally:
        s90_audit.audit(st, flow, event="connect")
