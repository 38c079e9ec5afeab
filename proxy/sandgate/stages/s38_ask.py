"""Hold for approval: a request an `action: ask` rule decided (Decision.ask) waits here until
people approve it (sandgate.approvals), or is refused (403 approval_denied / approval_timeout;
202 approval_pending in mode async, 429/503 past the pending limits).

It runs once the request is completely judged (head, body, credential leaks: s30_body; tool
calls: s35_call, which may pick the ask rule) and before anything is prepared, injected or
dialled: nothing is sent upstream and no secret is read while a request waits, and what is
approved is exactly what was judged. The body waits buffered, within the body limits s20/s30
already applied. The approval request carries who, what and why (identity, sandbox, method, the
URL with query values redacted as the audit redacts them, the tool, the rule, the body's sha256
and size, the forwarded headers scrubbed and their sha256), never a secret or the body.

The headers are bound as they stand here, before s40-s70 change them: those stages only remove
what `approvals.headers.bound_fields` leaves out and set what `approvals.headers.replaced`
names, so a retry that sends the same headers gets the same digest (approvals/bound_headers.py).
"""

from __future__ import annotations

import hashlib

from mitmproxy import http
from mitmproxy.connection import ConnectionState

from sandgate.approvals import bound_headers as H
from sandgate.approvals.service import Request
from sandgate.audit.events import redact_path
from sandgate.policy.query_audit import kept_query_names
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord
from sandgate.stages.forward import is_websocket_upgrade


async def hold(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The ask stage: returns when approved (or remembered); raises ApprovalRefused."""
    d = rec.decision
    if d is None or not d.ask or not d.allowed or rec.reported:
        return
    rule, caller, info = d.rule, rec.caller, rec.info
    assert rule is not None and rule.ask is not None and caller is not None and info is not None
    policy = st.flow_policy(rec)
    req = flow.request
    body = req.raw_content or b""
    origin = f"{info.scheme}://{_authority(info.host, info.port, info.scheme)}"
    # as the audit shows a path: query values redacted, any known secret value scrubbed
    secrets = st.secrets(rec)
    shown = secrets.scrub_text(origin + redact_path(req.path, kept_query_names(policy)))[0]
    fields = H.bound_fields(req.headers.fields, H.replaced(rule))
    scrub = H.scrubber(secrets, rec.placeholders)
    how = await st.cfg.approvals.ask(policy, rule, Request(
        identity=caller.identity, sandbox=caller.sandbox, method=info.method, url=shown,
        full_url=origin + req.path, host=info.host, tool=_tool(rec),
        body_sha256=hashlib.sha256(body).hexdigest(), body_size=len(body),
        headers_sha256=H.digest(fields, is_websocket_upgrade(req)),
        headers=H.shown(fields, scrub), headers_injected=H.injected(rule)), d.reason,
        gone=lambda: not flow.client_conn.state & ConnectionState.CAN_READ)
    rec.approval = how


def _authority(host: str, port: int, scheme: str) -> str:
    h = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return h if port == default else f"{h}:{port}"


def _tool(rec: FlowRecord) -> str | None:
    """The tool (or JSON-RPC method) the body calls, for the approvers to see."""
    call = rec.call.call if rec.call is not None else None
    if call is None:
        return None
    names = [m.name if m.method == "tools/call" and m.name else m.method
             for m in call.messages if m.method]
    return ", ".join(n for n in names if n) or None
