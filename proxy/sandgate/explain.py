"""What the policy says about one request: `sandgate explain` and `POST /v1/explain` both print
what `explain` returns, so the two can never disagree. The verdict is `decision.judge`: the
proxy's request parser, decision and (where the address is known) address step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandgate.decision import judge, reported
from sandgate.jsonrpc import Call
from sandgate.policy.calls import call_fields
from sandgate.policy.model import Policy

_NO_OVERRIDES: Mapping[str, str] = {}


def explain(policy: Policy, identity: str, method: str, url: str,
            resolve: Mapping[str, str] = _NO_OVERRIDES,
            call: Call | None = None) -> tuple[dict[str, Any], bool]:
    """(the explanation, allowed). Raises ValueError (a BadRequest) for a request that cannot
    be judged. Secrets appear by name only. `resolve` pins names as `sandgate run --resolve`
    does, so that the address step can be shown. `call`: the JSON-RPC call the body carries
    (judged by the rules' mcp:/jsonrpc:, as the proxy judges the body)."""
    v = judge(policy, identity, method, url, resolve, call)
    d = v.decision
    report = reported(policy, identity, d)
    ident = policy.identities.get(identity)
    out: dict[str, Any] = {
        "identity": identity,
        "request": v.request,
        "decision": "allow" if d.allowed else ("report" if report else "deny"),
        "rule": d.rule_name,
        "rule_source": str(d.rule.source) if d.rule else None,
        "code": str(d.code) if d.code else None,
        "reason": d.reason,
        "hint": d.hint,
        "detail": d.detail,
        "address": v.address,
    }
    if v.connect:
        out["passthrough"] = v.passthrough
    out.update(call_fields(d, call))
    if ident is not None and ident.mode != "enforce":
        out["mode"] = ident.mode
    if report:
        out["report"] = ("identity in report mode: forwarded without any credential and "
                         "audited as `report`; address and safety checks still apply")
    if d.allowed and d.rule is not None and not v.connect:
        inj = d.rule.inject
        would: list[str] = []
        if inj is not None:
            would += [f"header {n}: from secret(s) {', '.join(sorted(t.secrets)) or '-'}"
                      for n, t in inj.headers]
            if inj.basic is not None:
                s = inj.basic[0].secrets | inj.basic[1].secrets
                would.append(f"basic auth: from secret(s) {', '.join(sorted(s))}")
            would += [f"query {n}: from secret(s) {', '.join(sorted(t.secrets))}"
                      for n, t in inj.query]
        out["inject"] = would
        out["placeholders_honoured"] = sorted(d.rule.secrets)
    if d.rule is not None:
        out["private_cidrs"] = [str(n) for n in d.rule.private_cidrs]
        if d.allowed and d.rule.max_request_bytes is not None:
            out["max_request_bytes"] = d.rule.max_request_bytes  # the proxy's limit may be lower
        if d.rule.public:
            out["public"] = ("any host that resolves only to public addresses: the proxy "
                             "refuses the host if any of its addresses is non-public")
    return out, d.allowed
