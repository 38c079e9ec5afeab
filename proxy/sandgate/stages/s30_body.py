"""Judge the body (and the call it makes): the request once it is complete.

The head once more (this is the authoritative point: mitmproxy may have changed it while the
body was read), the body's size as received (a chunked body has no length up front), and no
credential in any form that the allowing rule does not bind to this destination. Rules about
what the body asks for (tool calls) belong in a stage of their own right after this one.
"""

from __future__ import annotations

from mitmproxy import http

from sandgate.errors import Code, Refused
from sandgate.inject import Leak, find_leaks
from sandgate.policy.model import Rule
from sandgate.secrets.body import BodyPlan, Unresolved
from sandgate.secrets.body import plan as plan_body
from sandgate.stages.context import GateState, allowing_rule
from sandgate.stages.flow import FlowRecord
from sandgate.stages.forward import inspectable_body
from sandgate.stages.s20_head import body_limit, check_size, check_wire


async def check(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The body stage: refuses (raises) a body too large or carrying a credential."""
    req = flow.request
    rule = allowing_rule(rec)
    bound = rule.secrets if rule is not None else frozenset()
    check_wire(req)
    limit = body_limit(st, rec)
    check_size(st, len(req.raw_content or b""), limit)
    body = inspectable_body(req, limit)
    leaks = find_leaks(req, body, rec.placeholders, st.secrets(), bound)
    if leaks:
        rec.exfiltration = leak_names(leaks)
        raise exfiltration(leaks, rule)
    if rule is not None and rule.substitute_body:
        rec.body_plan = body_plan(req, body, rule, rec)


def body_plan(req: http.Request, body: bytes, rule: Rule, rec: FlowRecord) -> BodyPlan | None:
    """Where a `substitute_body` rule's placeholders are in the body (before any Vault read);
    an unresolved one refuses the request (secrets/body.py)."""
    mine = {p: n for p, n in rec.placeholders.items() if n in rule.substitute}
    try:
        return plan_body(body, req.headers.get("content-type"),
                         req.headers.get("content-encoding", "identity").strip().lower()
                         not in ("", "identity"), mine)
    except Unresolved as e:
        rec.exfiltration = sorted(f"{n}:placeholder:body" for n in e.names)
        raise


def leak_names(leaks: list[Leak]) -> list[str]:
    """What the audit names of a leak: secret, kind and where; never the value."""
    return sorted({f"{lk.secret}:{lk.kind}:{lk.where}" for lk in leaks})


def exfiltration(leaks: list[Leak], rule: Rule | None) -> Refused:
    names = ", ".join(sorted({lk.secret for lk in leaks}))
    binds = (f"rule '{rule.name}' does not bind" if rule is not None
             else "no rule allowing this request binds")
    return Refused(
        Code.EXFILTRATION,
        f"the request carries a credential for secret(s) {names} that {binds} "
        "to this destination",
        hint="placeholders are only honoured on the requests their rule binds",
    )
