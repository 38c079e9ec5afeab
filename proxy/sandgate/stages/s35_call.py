"""Judge the call: the JSON-RPC / MCP messages a complete body carries, where a rule with
`mcp:` or `jsonrpc:` matched the head (Decision.call_limit).

The body is parsed strictly and the request decided again with the call, by the one decide()
that explain, fixtures and proofs use (sandgate.stages.rpccalls holds the call layer: the parse,
the judgement, the JSON-RPC error answer, and the response side that s70_scrub calls: session
binding and list filtering). A refused well-formed call is answered here as JSON-RPC errors
(one per request id, in the transport the client asked for), which ends the request path;
anything else refused is raised as the HTTP refusal.

It runs after s30_body (size as received, credential leaks) and before anything is prepared,
injected or dialled. When the call picks another allow rule than the head did (the head's
rule does not allow this call, a later one does), the body stage runs again for that rule: its
body limit and the secrets it binds are the ones that count.
"""

from __future__ import annotations

from mitmproxy import http

from sandgate.stages import s30_body
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord
from sandgate.stages.rpccalls import answer_call, judge_call
from sandgate.stages.s80_refuse import refusal_for


async def judge(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The call stage: nothing to do unless a matching rule judges calls."""
    head, was_reported = rec.decision, rec.reported
    assert head is not None
    refused = judge_call(rec, flow.request, st.flow_policy(rec), st.session_key)
    if refused is not None:
        answer_call(flow, rec, refusal_for(st, flow, refused))  # rec.refused: the path ends
        return
    d = rec.decision
    assert d is not None
    if d.rule is not head.rule or rec.reported != was_reported:
        await s30_body.check(st, flow, rec)  # the rule that forwards it: its limit, its secrets
