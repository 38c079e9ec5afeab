"""Scrub the response: no secret comes back through any channel, in any encoding.

The request asks for plain bytes (`ask_plain`, the last step before forwarding); the response
head is cleaned and its body streamed through the scrubber (or, small and of known length,
scrubbed whole), trailers cleaned or dropped; WebSocket messages are scrubbed one by one, and
one leaving with a credential is dropped and ends the stream.
"""

from __future__ import annotations

import logging

from mitmproxy import http

from sandgate.addons import calls
from sandgate.addons.forward import is_websocket_upgrade
from sandgate.addons.state import FlowRecord
from sandgate.addons.stream import (
    ResponseScrubber,
    clean_head,
    scrub_headers,
    scrub_whole,
    scrub_whole_candidate,
)
from sandgate.errors import Code, Refused
from sandgate.inject import find_leaks_in
from sandgate.refusal import Refusal
from sandgate.stages.context import GateState
from sandgate.stages.s30_body import exfiltration, leak_names
from sandgate.stages.s80_refuse import drop_response
from sandgate.stages.s90_audit import audit_event

log = logging.getLogger("sandgate")


async def ask_plain(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """Scrubbing needs plain bytes: ask the upstream not to compress."""
    flow.request.headers["accept-encoding"] = "identity"


def response_headers(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The response head: a protocol switch nobody asked for is dropped; the head is cleaned;
    the body is set to be scrubbed whole or as it streams."""
    resp = flow.response
    if resp is None or rec.refused:
        return
    calls.response_headers(rec, resp, st.sessions)  # the MCP session id bound to its identity
    if resp.status_code == 101 and not (
            is_websocket_upgrade(flow.request)
            and resp.headers.get("upgrade", "").strip().lower() == "websocket"):
        drop_response(st, flow, Refused(
            Code.UPSTREAM_ERROR, "the upstream switched to a protocol other than the "
            "WebSocket that was asked for"))
        return
    secrets = st.secrets()
    rec.redactions += clean_head(resp, secrets)
    if flow.request.method == "HEAD" or resp.status_code in (204, 304) or (
        resp.status_code < 200
    ):
        return  # no body: nothing to stream or reframe
    if scrub_whole_candidate(resp, secrets):
        rec.scrub_whole = True  # small and of known length: buffered, scrubbed in response
        return
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    scrubber = ResponseScrubber(secrets, encoding, resp, flow.request.http_version)
    if scrubber.refuse_reason:
        drop_response(st, flow, Refused(Code.UPSTREAM_ERROR, scrubber.refuse_reason))
        return

    def stream(chunk: bytes) -> bytes | list[bytes]:
        out = scrubber(chunk)
        rec.redactions = scrubber.replacements
        rec.bytes_out += sum(len(c) for c in out)
        return out

    resp.stream = calls.wrap_stream(rec, flow, stream)  # MCP list answers filtered


def finish(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The whole response: a buffered body scrubbed, trailers scrubbed (HTTP/2) or dropped.
    Should this fail, the flow is killed: nothing of the response is sent."""
    try:
        resp = flow.response
        if resp is not None and rec.scrub_whole and not rec.refused:
            rec.redactions += scrub_whole(resp, st.secrets())
            calls.filter_whole(rec, resp)  # MCP list answers filtered
            rec.bytes_out = len(resp.raw_content or b"")
        if resp is not None and resp.trailers and not rec.refused:
            if flow.client_conn.alpn == b"h2":
                rec.redactions += scrub_headers(resp.trailers, st.secrets())
            else:  # HTTP/1 clients get no trailers (mitmproxy cannot send them anyway)
                resp.trailers = None
    except Exception:
        log.exception("sandgate: response hook failed; killing")
        rec.refusal = Refusal(Code.UPSTREAM_ERROR, "the upstream's response "
                              "could not be scrubbed; nothing of it was sent")
        if flow.killable:
            flow.kill()


def websocket_message(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """Scrub what the upstream sends; drop, and stop the stream, on anything leaving that
    carries a credential. Messages arrive whole (mitmproxy reassembles fragments)."""
    assert flow.websocket is not None
    message = flow.websocket.messages[-1]
    try:
        if rec.websocket_closed:
            message.drop()
            return
        secrets = st.secrets()
        if not message.from_client:
            clean, n = secrets.scrub(message.content)
            if n:
                message.content = clean
                rec.redactions += n
            return
        rule = rec.decision.rule if rec.decision is not None and not rec.reported else None
        bound = rule.secrets if rule is not None else frozenset()
        placeholders = rec.placeholders if rec.policy is not None else st.placeholders
        leaks = find_leaks_in(message.content, "websocket", placeholders, secrets, bound)
        if leaks:
            message.drop()
            rec.websocket_closed = True
            rec.exfiltration = leak_names(leaks)
            audit_event(st, flow, "websocket", exfiltration(leaks, rule))
    except Exception:
        log.exception("sandgate: websocket_message failed; dropping the stream")
        rec.websocket_closed = True
        message.drop()
