"""Scrub the response: no secret comes back through any channel, in any encoding.

The request asks for plain bytes (`ask_plain`, the last step before forwarding); the response
head is cleaned and its body streamed through the scrubber (or, small and of known length,
scrubbed whole), trailers cleaned or dropped; WebSocket messages and control frames (ping, pong,
close: mitm/guards/wscontrol.py) are scrubbed one by one, and one leaving with a credential is not
relayed and ends the stream; on a rule with mcp:/jsonrpc: each message is then judged as a call
(stages/wsrpc.py), with llm: as an LLM call (stages/wsllm.py). The set scrubbed is the flow's
own (`GateState.secrets(rec)`): what was injected into it stays scrubbed whatever the cache does
(scrub/flowsecrets.py).
"""

from __future__ import annotations

import functools
import logging

from mitmproxy import ctx, http

from sandgate.errors import Code, Refused
from sandgate.inject import find_leaks_in
from sandgate.llm.llmcall import UsageReader
from sandgate.mitm.guards import wscontrol
from sandgate.mitm.guards.corrections import READ_WHOLE
from sandgate.refusal import Refusal
from sandgate.scrub.stream import (
    ResponseScrubber,
    answer_instead,
    clean_head,
    scrub_headers,
    scrub_whole,
    scrub_whole_candidate,
)
from sandgate.scrub.unwrap import scrub_unwrapped
from sandgate.scrub.wsjoin import WsJoin
from sandgate.stages import rpccalls, wsllm, wsrpc
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord
from sandgate.stages.forward import is_websocket_upgrade
from sandgate.stages.s30_body import exfiltration, leak_names
from sandgate.stages.s80_refuse import drop_response, refusal_for, refuse
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
    if resp.status_code == 101 and not (
            is_websocket_upgrade(flow.request)
            and resp.headers.get("upgrade", "").strip().lower() == "websocket"):
        drop_response(st, flow, Refused(
            Code.UPSTREAM_ERROR, "the upstream switched to a protocol other than the "
            "WebSocket that was asked for"))
        return
    secrets = st.secrets(rec)
    rec.redactions += clean_head(resp, secrets)
    # the MCP session id, already scrubbed, wrapped: bound to its identity and server (and
    # its protocol version: the answer to initialize is read whole to learn it)
    if rpccalls.response_headers(rec, resp, st.session_key):
        flow.metadata[READ_WHOLE] = True  # buffered, so held to the body size limit
        resp.headers.pop("transfer-encoding", None)  # sent with its length
        rec.scrub_whole = True
        return
    if flow.request.method == "HEAD" or resp.status_code in (204, 304) or (
        resp.status_code < 200
    ):
        return  # no body: nothing to stream or reframe
    if scrub_whole_candidate(resp, secrets):
        rec.scrub_whole = True  # small and of known length: buffered, scrubbed in response
        return
    if rec.llm is not None and rec.llm.drop_usage_chunk:
        resp.headers.pop("content-length", None)  # the usage chunk Sandgate asked for goes
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    scrubber = ResponseScrubber(secrets, encoding, resp, flow.request.http_version,
                                flow.request.path)
    if scrubber.refuse_reason:  # a readable 502, not a cut connection
        rec.refusal = refusal_for(st, flow, Refused(Code.UPSTREAM_ERROR, scrubber.refuse_reason))
        resp.stream = answer_instead(resp, rec.refusal, flow.client_conn.alpn != b"h2")
        return

    reader = _usage_reader(flow, rec)

    def stream(chunk: bytes) -> bytes | list[bytes]:
        try:
            out = scrubber(chunk)
            if reader is not None:  # an LLM call's usage read from what the client gets
                out = [p for p in [*(reader.feed(c) for c in out), *(
                    [] if chunk else [reader.end()])] if p]
        except Exception as e:  # fail closed: nothing more of this body reaches the client
            # the type only: a message could quote the body
            log.error("sandgate: scrubbing a response body failed (%s); cutting it",
                      type(e).__name__)
            rec.refusal = Refusal(Code.UPSTREAM_ERROR, "the upstream's response could not be "
                                  "scrubbed; the rest of it was not sent")
            if flow.killable:
                flow.kill()
            return []
        rec.redactions = scrubber.replacements
        rec.bytes_out += sum(len(c) for c in out)
        return out

    resp.stream = rpccalls.wrap_stream(rec, flow, stream)  # MCP list answers filtered


def _usage_reader(flow: http.HTTPFlow, rec: FlowRecord) -> UsageReader | None:
    """An LLM call's answer (stages/s37_llm.py): its usage read as it passes (sandgate.llm.llmcall),
    the OpenAI usage chunk Sandgate asked for taken out. Error answers carry none."""
    resp = flow.response
    if rec.llm is None or resp is None or resp.status_code >= 300 or rec.refused:
        return None
    rec.llm.reader = UsageReader(rec.llm.api, resp.headers.get("content-type", ""),
                                 flow.request.path, rec.llm.drop_usage_chunk)
    return rec.llm.reader


def finish(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The whole response: a buffered body scrubbed, trailers scrubbed (HTTP/2) or dropped.
    Should this fail, the flow is killed: nothing of the response is sent."""
    try:
        resp = flow.response
        if resp is not None and rec.scrub_whole and not rec.refused:
            try:
                rec.redactions += scrub_whole(resp, st.secrets(rec), flow.request.path)
            except ValueError as e:  # undecodable: a readable 502 instead of its body
                refuse(flow, refusal_for(st, flow, Refused(Code.UPSTREAM_ERROR, str(e))))
            if not rec.refused:
                rpccalls.filter_whole(rec, resp)  # MCP list answers filtered
                reader = _usage_reader(flow, rec)
                if reader is not None:  # an LLM call's usage
                    kept = reader.feed(resp.raw_content or b"") + reader.end()
                    if reader.dropped:
                        resp.content = kept
            rec.bytes_out = len(resp.raw_content or b"")
        if resp is not None and resp.trailers and rec.refused:
            resp.trailers = None  # the upstream's answer was replaced: none of it goes
        if resp is not None and resp.trailers and not rec.refused:
            if flow.client_conn.alpn == b"h2":
                rec.redactions += scrub_headers(resp.trailers, st.secrets(rec))
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
    ws = None
    wl = None
    try:
        # a rule with mcp:/jsonrpc:/llm: (websocket: true): messages are judged. Started here
        # if websocket_start did not (a hook mitmproxy only logs the failure of): never
        # unjudged
        ws = wsrpc.state(flow) or wsrpc.start(rec, flow)
        wl = wsllm.state(flow) or wsllm.start(st, rec, flow)
        if rec.websocket_closed:
            message.drop()
            return
        if message.injected:
            # Sandgate's own: a held message sent again (scrub/wsjoin.py: scrubbed there; it
            # recognises only its own payloads), or the JSON-RPC error answering a refused
            # call (wsrpc)
            if rec.ws_join is not None:
                rec.ws_join.message(message)
            return
        if not message.from_client:
            secrets = st.secrets(rec)
            clean, n = scrub_unwrapped(secrets, message.content)
            if n:
                message.content = clean
                rec.redactions += n
            if ws is not None:
                wsrpc.server_message(st, flow, rec, ws, message)  # list answers filtered
            if message.dropped:
                return
            if rec.ws_join is None and not secrets.empty:
                rec.ws_join = WsJoin(secrets, functools.partial(_inject, flow))
            if rec.ws_join is not None:
                before = rec.ws_join.replacements
                rec.ws_join.message(message)
                rec.redactions += rec.ws_join.replacements - before
            return
        if _websocket_leaks(st, flow, rec, message.content):
            message.drop()
        elif ws is not None:
            wsrpc.client_message(st, flow, rec, ws, message)
        elif wl is not None:
            wsllm.client_message(st, flow, rec, wl, message)
    except Exception:
        log.exception("sandgate: websocket_message failed; dropping the stream")
        rec.websocket_closed = True
        message.drop()
        if ws is not None or wl is not None or rec.call is not None:  # judged calls
            wscontrol.close(flow, wsrpc.POLICY_VIOLATION, "sandgate: internal_error")


def _inject(flow: http.HTTPFlow, payload: bytes, is_text: bool) -> None:
    """A message to the client, after those injected before it (scrub/wsjoin.py)."""
    ctx.master.commands.call("inject.websocket", flow, True, payload, is_text)


def _websocket_leaks(st: GateState, flow: http.HTTPFlow, rec: FlowRecord,
                     content: bytes) -> bool:
    """Does what the client sends carry a credential? If so the stream goes silent and the
    exfiltration is audited."""
    rule = rec.decision.rule if rec.decision is not None and not rec.reported else None
    bound = rule.secrets if rule is not None else frozenset()
    placeholders = rec.placeholders if rec.policy is not None else st.placeholders
    leaks = find_leaks_in(content, "websocket", placeholders, st.secrets(rec), bound)
    if leaks:
        rec.websocket_closed = True
        rec.exfiltration = leak_names(leaks)
        audit_event(st, flow, "websocket", exfiltration(leaks, rule))
    return bool(leaks)


def websocket_start(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The WebSocket's control frames are judged by `_websocket_control` (mitm/guards/wscontrol);
    on a rule with mcp:/jsonrpc:, its messages by stages/wsrpc; with llm:, by stages/wsllm."""
    flow.metadata[wscontrol.HANDLER_KEY] = functools.partial(_websocket_control, st, flow, rec)
    wsrpc.start(rec, flow)
    wsllm.start(st, rec, flow)


def _websocket_control(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, from_client: bool,
                       payload: bytes) -> bytes | None:
    """A ping, pong or close payload: scrubbed from the server, judged like a message from the
    client (None: not relayed)."""
    if not from_client:
        clean, n = scrub_unwrapped(st.secrets(rec), payload)
        rec.redactions += n
        return clean
    if rec.websocket_closed or _websocket_leaks(st, flow, rec, payload):
        return None
    return payload
