"""Forward: make the head the upstream receives exactly the one that was judged.

Origin form, hop-by-hop and reserved headers removed, trailers dropped, framing recomputed
(sandgate.stages.forward.prepare); the sandbox's `traceparent`/`tracestate` removed unless the
rule forwards them (sandgate.audit.export.traceparent). It runs before injection (s50): what
Sandgate adds itself is not the client's to strip, and must not be stripped by this clean-up
either.
"""

from __future__ import annotations

from mitmproxy import http

from sandgate.audit.export import traceparent
from sandgate.stages.context import GateState, allowing_rule
from sandgate.stages.flow import FlowRecord
from sandgate.stages.forward import is_websocket_upgrade, prepare


async def prepare_head(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The forward stage: only the judged protocol switch (WebSocket) survives."""
    req = flow.request
    prepare(req, is_websocket_upgrade(req), rec.info)  # rec.info: the judged Host
    rule = allowing_rule(rec)  # the sandbox's trace context stays here unless the rule says
    rec.trace = traceparent.take(req.headers, rule is not None and rule.forward_trace_context)
