"""Judge what a signature covers: a rule that signs with SigV4 (`inject: {sign: NAME}`) signs
only what it judged, so the headers and parameters AWS acts on beyond the request line (the
operation in X-Amz-Target or Action, a copy source, presigned parameters, any x-amz-* header)
are judged here, once the body is complete (an Action may be in a form body).

The request is decided again with them (sandgate.secrets.aws_request read them) by the one
decide() that explain and fixtures use; a signing rule that does not judge all of them does not
match (403 no_rule naming why, unless a later rule allows it). The head stage decided without
them; s55_sign signs only a request judged here (rec.aws), and only the headers judged.
"""

from __future__ import annotations

from mitmproxy import http

from sandgate.decision import decide, reported
from sandgate.secrets.aws_request import parse
from sandgate.stages import s30_body
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord


def signs(rec: FlowRecord) -> bool:
    """Will the request be signed: allowed (not only reported) by a rule with `sign`?"""
    d = rec.decision
    return (d is not None and d.allowed and not rec.reported and d.rule is not None
            and d.rule.inject is not None and d.rule.inject.sign is not None)


async def judge(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The SigV4 stage: nothing to do unless a signing rule allowed the request."""
    if not signs(rec):
        return
    head = rec.decision
    assert head is not None and rec.caller is not None and rec.info is not None
    req = flow.request
    parts = parse(req.headers.items(multi=True), rec.info.query, req.raw_content or b"",
                  req.headers.get("content-type"),
                  req.headers.get("content-encoding", "identity").strip().lower()
                  not in ("", "identity"), rec.info.path)
    policy = st.flow_policy(rec)
    call = rec.call.call if rec.call is not None else None
    d = rec.decision = decide(policy, rec.caller.identity, rec.info, call, parts)
    if not d.allowed:
        if not reported(policy, rec.caller.identity, d):
            raise d.refused()
        rec.reported = True  # forwarded without credentials; audited as `report`
    elif signs(rec):
        rec.aws = parts
    if d.rule is not head.rule or rec.reported:
        await s30_body.check(st, flow, rec)  # the rule that forwards it: its limit, its secrets
