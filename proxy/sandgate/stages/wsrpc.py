"""One rule, every transport: the messages of a WebSocket opened on a rule with `mcp:` or
`jsonrpc:` (which needs `websocket: true`; without it the upgrade is refused by decide(),
upgrade_refused), judged and filtered exactly as a POSTed body and its answer are.

From the client, each message is one JSON-RPC message or batch: parsed strictly
(sandgate.rpc.jsonrpc.parse), decided by the one decide() with the call (deny entries win, a batch
is refused whole), and audited as a `websocket` event with the same `rpc` fields as a POST. A
refused call is not forwarded; each of its request ids is answered on the WebSocket with the
JSON-RPC error the POST path returns (sandgate.stages.rpccalls.rpc_errors). A message that cannot
be judged (a binary frame, a message in several frames, text that is not a JSON-RPC message,
one over the rule's max_body) closes the WebSocket both ways with 1008 (policy violation):
what is judged must be what is forwarded, and a stream that stops being judgeable stops.

From the server, each message must be one JSON text frame too (a binary or unreadable one
closes the WebSocket: it could not be filtered); it is scrubbed first (s70_scrub), then an
answer to a list call the client made on this WebSocket keeps only the entries the identity
may call (sandgate.stages.rpccalls.filter_message).

The credentials on the WebSocket are the ones injected into its upgrade, by the rule that
allowed the upgrade: a message allowed only by a rule binding other secrets is refused (over
POST it would get that rule's credentials; here it would run with the wrong ones).

The pure part (`judge_client`, `from_server`) takes no flow; `client_message` and
`server_message` apply its verdict to mitmproxy's message and audit it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.websocket import WebSocketMessage

from sandgate.audit import events as A
from sandgate.decision import Decision, decide, reported
from sandgate.errors import Code, Refused
from sandgate.mitm.guards import wscontrol
from sandgate.rpc.jsonrpc import Call, CallError, id_key, loads, parse
from sandgate.stages.context import GateState
from sandgate.stages.flow import CallState, FlowRecord
from sandgate.stages.rpccalls import LISTS, filter_message, outcomes, rpc_errors
from sandgate.stages.s80_refuse import refusal_for
from sandgate.stages.s90_audit import audit_event

log = logging.getLogger("sandgate")

# RFC 6455 7.4.1: "an endpoint is terminating the connection because it has received a message
# that violates its policy"
POLICY_VIOLATION = 1008
# List calls awaiting their answer on one WebSocket; more is refused, not forgotten (a
# forgotten id would let its answer through unfiltered).
MAX_PENDING_LISTS = 1024

STATE_KEY = "sandgate.wsrpc"  # flow.metadata: the WebSocket's WsRpc

Inject = Callable[[http.HTTPFlow, bytes], None]
"""(flow, text): send a text message to the client on the flow's WebSocket."""


@dataclass
class WsRpc:
    """One WebSocket's call layer: who opened it, under which decision, and the list calls
    whose answers are still to be filtered (`lists.lists`: id -> list method)."""

    head: Decision  # the upgrade's decision: its rule's credentials ride on the WebSocket
    head_reported: bool  # the upgrade went on uninjected (report mode)
    lists: CallState  # policy, identity, info of the upgrade; list ids pending


@dataclass
class Verdict:
    """What becomes of one client message."""

    forward: bool
    call: Call | None = None
    decision: Decision | None = None
    outcomes: list[str] = field(default_factory=list)
    refused: Refused | None = None  # answered with JSON-RPC errors (or audited only)
    reported: bool = False  # refused by the rules, forwarded anyway (mode: report)
    close: Refused | None = None  # not judgeable: the WebSocket is closed


def _unjudgeable(code: Code, reason: str, hint: str) -> Verdict:
    return Verdict(False, close=Refused(code, reason, hint))


def judge_client(ws: WsRpc, content: bytes, text: bool, fragmented: bool,
                 limit: int) -> Verdict:
    """A message from the client, judged as a POST body of the upgrade's request would be."""
    one_frame = ("send each JSON-RPC message (or batch) as one text frame, as the JSON-RPC "
                 "WebSocket transports do")
    if not text:
        return _unjudgeable(Code.BAD_REQUEST, "a binary WebSocket frame cannot be judged on a "
                            "rule with mcp:/jsonrpc:", one_frame)
    if fragmented:
        return _unjudgeable(Code.BAD_REQUEST, "a WebSocket message in several frames is not "
                            "judged on a rule with mcp:/jsonrpc:", one_frame)
    if len(content) > limit:
        return _unjudgeable(Code.TOO_LARGE, f"the WebSocket message is larger than the rule "
                            f"allows ({limit} bytes, mcp.max_body)", "raise max_body in the "
                            "rule's mcp:/jsonrpc: if such calls are expected")
    try:
        call = parse(content)
    except CallError as e:
        return _unjudgeable(Code.BAD_REQUEST, f"the WebSocket message is not a JSON-RPC call "
                            f"Sandgate can judge: {e}", one_frame)
    st = ws.lists
    d = decide(st.policy, st.identity, st.info, call)
    verdict = Verdict(True, call, d, outcomes(st, call, d.allowed))
    if d.allowed:
        refused = held(d) or other_credentials(ws.head, ws.head_reported, d)
        if refused is not None:
            verdict.forward, verdict.refused = False, refused
            verdict.outcomes = ["deny"] * len(call.messages)
            return verdict
        pending = [m for m in call.messages
                   if m.kind == "request" and m.method in LISTS and m.id is not None]
        if len(st.lists) + len(pending) > MAX_PENDING_LISTS:
            return _unjudgeable(Code.TOO_LARGE, f"more than {MAX_PENDING_LISTS} list calls "
                                "await their answer on this WebSocket", "wait for the answers "
                                "to list calls before sending more")
        for m in pending:
            assert m.method is not None and m.id is not None
            st.lists[id_key(m.id)] = m.method
        return verdict
    if reported(st.policy, st.identity, d):
        verdict.reported = True  # forwarded (the upgrade's credentials, if any, were not)
        return verdict
    verdict.forward, verdict.refused = False, d.refused()
    return verdict


def held(d: Decision, what: str = "a message") -> Refused | None:
    """A decision that would hold `what` for approval: refused (a WebSocket message cannot
    wait for an approver; sent unheld it would skip one). Shared with stages/wsllm."""
    if not d.ask:
        return None
    return Refused(Code.DENIED_BY_RULE, f"{d.reason}; {what} on a WebSocket cannot be held "
                   "for approval", "send the call as a POST request, which can be held")


def other_credentials(head_decision: Decision, head_reported: bool,
                      d: Decision) -> Refused | None:
    """A message allowed by another rule than the upgrade's must not run with the upgrade
    rule's credentials when the two bind different secrets. Shared with stages/wsllm."""
    head = head_decision.rule
    if head_reported or d.rule is None or head is None or d.rule is head \
            or d.rule.secrets == head.secrets:
        return None
    return Refused(
        Code.NO_RULE, f"{d.reason}, but this WebSocket was opened under rule '{head.name}' "
        "with other credentials; the call is not sent with them",
        f"open the WebSocket on a URL that rule '{d.rule.name}' allows, or send the call as a "
        "POST request")


def from_server(ws: WsRpc, content: bytes, text: bool, fragmented: bool
                ) -> tuple[bytes | None, Refused | None]:
    """A message from the server (already scrubbed): (its content filtered, or None when
    unchanged; a refusal when it cannot be read, and the WebSocket is closed)."""
    if not text or fragmented:
        what = "a binary frame" if not text else "a message in several frames"
        return None, Refused(Code.UPSTREAM_ERROR, f"the upstream sent {what} on a WebSocket "
                             "whose answers are filtered; it cannot be", None)
    try:
        doc = loads(content)
    except CallError as e:
        return None, Refused(Code.UPSTREAM_ERROR, f"the upstream sent a WebSocket message that "
                             f"is not JSON ({e}); it cannot be filtered", None)
    pending = ws.lists.lists
    answered = [k for msg in (doc if isinstance(doc, list) else [doc])
                if isinstance(msg, dict) and "method" not in msg
                and isinstance(mid := msg.get("id"), int | str) and not isinstance(mid, bool)
                and (k := id_key(mid)) in pending]
    if not answered:
        return None, None
    try:
        new = filter_message(ws.lists, content)
    except CallError as e:
        return None, Refused(Code.UPSTREAM_ERROR, f"the upstream's answer to a list call "
                             f"cannot be read ({e})", None)
    for k in answered:
        pending.pop(k, None)  # answered: its id may be used again
    return new, None


# ------------------------------------------------------------------------ on the flow


def start(rec: FlowRecord, flow: http.HTTPFlow) -> WsRpc | None:
    """The WebSocket's call layer, when its upgrade matched a rule judging calls."""
    d = rec.decision
    if rec.call is None or d is None or d.call_limit is None:
        return None
    ws = WsRpc(d, rec.reported, CallState(rec.call.policy, rec.call.identity, rec.call.info))
    flow.metadata[STATE_KEY] = ws
    return ws


def state(flow: http.HTTPFlow) -> WsRpc | None:
    ws = flow.metadata.get(STATE_KEY)
    return ws if isinstance(ws, WsRpc) else None


def inject_to_client(flow: http.HTTPFlow, text: bytes) -> None:
    """mitmproxy's own injection: the message reaches the client after the one being held."""
    ctx.master.commands.call("inject.websocket", flow, True, text, True)


def client_message(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, ws: WsRpc,
                   message: WebSocketMessage, inject: Inject | None = None) -> None:
    """Judge a client's message (already checked for leaks); drop it unless it may go on.
    `inject`: how an answer reaches the client (default: inject_to_client)."""
    assert rec.decision is not None
    v = judge_client(ws, message.content, message.is_text,
                     wscontrol.fragmented(flow, True), rec.decision.call_limit or 0)
    if v.close is not None:
        close(st, flow, rec, message, v.close)
        return
    if not _audit(st, flow, rec, ws, message, v):
        close(st, flow, rec, message, audit_unavailable())
        return
    if v.forward:
        return
    message.drop()
    assert v.call is not None and v.refused is not None
    if v.call.ids:
        errors = rpc_errors(v.call, refusal_for(st, flow, v.refused))
        (inject or inject_to_client)(flow,
                                     json.dumps(errors if v.call.batch else errors[0]).encode())


def server_message(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, ws: WsRpc,
                   message: WebSocketMessage) -> None:
    """Filter a server's message (already scrubbed); close the WebSocket on one that cannot be
    read."""
    new, refused = from_server(ws, message.content, message.is_text,
                               wscontrol.fragmented(flow, False))
    if refused is not None:
        close(st, flow, rec, message, refused)
        return
    if new is not None:
        message.content = new


def close(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, message: WebSocketMessage,
          why: Refused) -> None:
    """Drop `message` and close the WebSocket both ways with 1008, audited: a message that
    cannot be judged or filtered ends the stream. Shared with stages/wsllm."""
    message.drop()
    rec.websocket_closed = True  # nothing after it goes either way
    wscontrol.close(flow, POLICY_VIOLATION, f"sandgate: {why.code}")
    audit_event(st, flow, "websocket", why)


def _audit(st: GateState, flow: http.HTTPFlow, rec: FlowRecord, ws: WsRpc,
           message: WebSocketMessage, v: Verdict) -> bool:
    """The message's `websocket` event, with its `rpc` fields (as a POST's request event has
    them); False: it could not be audited."""
    assert v.call is not None and v.decision is not None
    return audit_message(st, flow, rec, message, v.decision, v.refused, v.reported, v.forward,
                  lambda: CallState(ws.lists.policy, ws.lists.identity, ws.lists.info, v.call,
                                    v.outcomes).fields())


def audit_message(st: GateState, flow: http.HTTPFlow, rec: FlowRecord,
                  message: WebSocketMessage, d: Decision, refused: Refused | None,
                  reported: bool, forward: bool,
                  call_fields: Callable[[], dict[str, Any]]) -> bool:
    """A judged message's `websocket` event: the upgrade's fields, with this message's
    decision and the call's own fields (`call_fields`: `rpc` here, `llm` in stages/wsllm).
    False when it could not be written, or the audit log cannot be written at all (and
    --audit-best-effort is off): then nothing more may be forwarded on this WebSocket, as no
    new request is (s90_audit.check_writable). Shared with stages/wsllm."""
    try:
        fields: dict[str, Any] = A.flow_fields(flow, rec)
        refusal = refusal_for(st, flow, refused) if refused is not None else None
        fields.update({
            A.RULE: d.rule_name,
            A.DECISION: "report" if reported else "allow" if forward else "deny",
            A.CODE: str(refusal.code) if refusal else (str(d.code) if d.code else None),
            A.REASON: refusal.reason if refusal else d.reason,
            A.UPSTREAM_STATUS: None,
            A.BYTES_IN: len(message.content),
            A.BYTES_OUT: 0,
            **call_fields(),
        })
        st.cfg.audit.emit("websocket", **A.scrub_fields(fields, st.secrets(rec)))
    except Exception:
        log.exception("sandgate: audit failed")
        return st.cfg.audit_best_effort
    return st.cfg.audit.healthy or st.cfg.audit_best_effort


def audit_unavailable() -> Refused:
    """Why a WebSocket whose messages cannot be audited is closed."""
    return Refused(Code.AUDIT_UNAVAILABLE, "Sandgate cannot write its audit log; nothing more is "
                   "forwarded on this WebSocket", hint="open it again once the audit log works")
