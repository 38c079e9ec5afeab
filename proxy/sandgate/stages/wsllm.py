"""One rule, every transport, for LLM calls: the Responses API's WebSocket transport (Codex's
`GET /v1/responses` with an upgrade) on a rule with `llm:` and `websocket: true` (without it the
upgrade is refused by decide(), upgrade_refused).

From the client, each message is one JSON object with a `type`. A `response.create` carries
the body a `POST /v1/responses` would (plus its type): it is read strictly
(sandgate.llm.llmcall.read_call) and decided by the one decide() with the call, exactly as the
POST's body is (stages/s37_llm): a model outside `llm.models` or a cap over `max_tokens` is
refused (`on_max_tokens: lower`: the message is forwarded with the cap lowered). A refused
call is not forwarded: the client gets the Responses API's WebSocket `error` event, in the
API's error shape with Sandgate's refusal under `sandgate` (what Codex reports as an HTTP
error). Each judged call is audited as a `websocket` event with the call's `llm` fields. A
message that cannot be judged (a binary frame, one in several frames, one over the size limit,
not a JSON object, another `type`) closes the WebSocket both ways with 1008 (policy
violation): what is judged must be what is forwarded.

From the server, messages are scrubbed, and the text the client joins across
`response.output_text.delta` events too (stages/s70_scrub, scrub/wsjoin.py), as on any
WebSocket. Budgets are not counted on a WebSocket: a rule with `llm.budget` cannot say
`websocket: true` (sandgate.policy.llm).

The credentials on the WebSocket are the ones injected into its upgrade, by the rule that
allowed it: a call allowed only by a rule binding other secrets is refused, as in wsrpc.

The pure part (`judge_client`) takes no flow; `client_message` applies its verdict to
mitmproxy's message and audits it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.websocket import WebSocketMessage

from sandgate.audit import events as A
from sandgate.decision import Decision, decide, reported
from sandgate.errors import Code, Refused
from sandgate.llm.llmcall import CallUnreadable, LlmCall, read_ws_message, with_max_tokens
from sandgate.llm.spend import LlmFlow
from sandgate.mitm.guards import wscontrol
from sandgate.policy.model import Policy
from sandgate.refusal import provider_doc
from sandgate.request import RequestInfo
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord
from sandgate.stages.s80_refuse import refusal_for
from sandgate.stages.wsrpc import (
    Inject,
    audit_message,
    audit_unavailable,
    close,
    held,
    inject_to_client,
    other_credentials,
)

STATE_KEY = "sandgate.wsllm"  # flow.metadata: the WebSocket's WsLlm
CREATE = "response.create"  # the one message type that makes a call


@dataclass
class WsLlm:
    """One WebSocket's LLM layer: who opened it, under which decision."""

    head: Decision  # the upgrade's decision: its rule's credentials ride on the WebSocket
    head_reported: bool  # the upgrade went on uninjected (report mode)
    policy: Policy
    identity: str
    info: RequestInfo  # the upgrade's request
    limit: int  # the largest message judged (the request body limit)


@dataclass
class Verdict:
    """What becomes of one client message."""

    forward: bool
    call: LlmCall | None = None
    decision: Decision | None = None
    content: bytes | None = None  # forwarded instead (the cap lowered)
    refused: Refused | None = None  # answered with an `error` event
    reported: bool = False  # refused by the rules, forwarded anyway (mode: report)
    close: Refused | None = None  # not judgeable: the WebSocket is closed


def _unjudgeable(code: Code, reason: str) -> Verdict:
    return Verdict(False, close=Refused(code, reason, "send each response.create as one JSON "
                                        "text frame, as the Responses API's WebSocket "
                                        "transport does"))


def judge_client(ws: WsLlm, content: bytes, text: bool, fragmented: bool) -> Verdict:
    """A message from the client, judged as the POST body of the same call would be."""
    if not text:
        return _unjudgeable(Code.BAD_REQUEST, "a binary WebSocket frame cannot be judged on a "
                            "rule with llm:")
    if fragmented:
        return _unjudgeable(Code.BAD_REQUEST, "a WebSocket message in several frames is not "
                            "judged on a rule with llm:")
    if len(content) > ws.limit:
        return _unjudgeable(Code.TOO_LARGE, f"the WebSocket message is larger than a request "
                            f"body may be ({ws.limit} bytes)")
    try:
        kind, call = read_ws_message(content)
    except CallUnreadable as e:
        return _unjudgeable(Code.BAD_REQUEST, f"the WebSocket message is not an LLM call "
                            f"Sandgate can judge: {e}")
    if call is None:
        return _unjudgeable(Code.BAD_REQUEST, f"a {kind[:60]!r} message is not judged on a "
                            f"rule with llm: (only {CREATE} is)")
    d = decide(ws.policy, ws.identity, ws.info, None, None, call)
    v = Verdict(True, call, d)
    if d.allowed:
        refused = held(d, "a call") or other_credentials(ws.head, ws.head_reported, d)
        if refused is not None:
            v.forward, v.refused = False, refused
        elif d.lower_max_tokens is not None:
            v.content = with_max_tokens(call.api, content, d.lower_max_tokens)
            v.call = dataclasses.replace(call, max_tokens=d.lower_max_tokens)
        return v
    if reported(ws.policy, ws.identity, d):
        v.reported = True  # forwarded (the upgrade's credentials, if any, were not)
        return v
    v.forward, v.refused = False, d.refused()
    return v


def error_event(status: int, doc: dict[str, Any]) -> bytes:
    """The Responses API's WebSocket error event (`type: error`, the HTTP status, the API's
    error object): its clients raise it as they would the HTTP error."""
    return json.dumps({"type": "error", "status": status, **doc}).encode()


# ------------------------------------------------------------------------ on the flow


def start(st: GateState, rec: FlowRecord, flow: http.HTTPFlow) -> WsLlm | None:
    """The WebSocket's LLM layer, when its upgrade was allowed by a rule with `llm:` (which,
    having let the upgrade through, says `websocket: true`)."""
    d = rec.decision
    if d is None or d.rule is None or d.rule.llm is None or rec.caller is None \
            or rec.info is None or d.rule.call is not None:
        return None
    limit = st.cfg.max_request_body
    if d.rule.max_request_bytes is not None:
        limit = min(limit, d.rule.max_request_bytes)
    ws = WsLlm(d, rec.reported, st.flow_policy(rec), rec.caller.identity, rec.info, limit)
    flow.metadata[STATE_KEY] = ws
    return ws


def state(flow: http.HTTPFlow) -> WsLlm | None:
    ws = flow.metadata.get(STATE_KEY)
    return ws if isinstance(ws, WsLlm) else None


def client_message(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, ws: WsLlm,
                   message: WebSocketMessage, inject: Inject | None = None) -> None:
    """Judge a client's message (already checked for leaks); drop it unless it may go on.
    `inject`: how an answer reaches the client (default: inject_to_client)."""
    v = judge_client(ws, message.content, message.is_text, wscontrol.fragmented(flow, True))
    if v.close is not None:
        close(st, flow, rec, message, v.close)
        return
    if v.content is not None:
        message.content = v.content
    if not _audit(st, flow, rec, message, v):
        close(st, flow, rec, message, audit_unavailable())
        return
    if v.forward:
        return
    message.drop()
    assert v.refused is not None
    refusal = refusal_for(st, flow, v.refused)
    (inject or inject_to_client)(flow, error_event(refusal.status,
                                                   provider_doc("openai", refusal)))


def _audit(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, message: WebSocketMessage,
           v: Verdict) -> bool:
    """The call's `websocket` event, with its `llm` fields (as a POST's request event has
    them); False: it could not be audited."""
    assert v.decision is not None and v.call is not None
    call = v.call

    def llm_fields() -> dict[str, Any]:
        llm = LlmFlow(call.api, call)
        if v.content is not None:
            llm.notes.append(f"max_tokens lowered to {call.max_tokens}")
        return {A.LLM: llm.doc(rec.policy.prices if rec.policy is not None else ())}

    return audit_message(st, flow, rec, message, v.decision, v.refused, v.reported, v.forward,
                         llm_fields)
