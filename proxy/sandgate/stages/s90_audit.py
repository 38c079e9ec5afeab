"""Audit: one event per flow, written once, whatever path the flow took.

Every stage may end here (a refusal is audited like a forwarded request). The audit log's own
health is checked before anything is forwarded (`check_writable`): fail closed.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, http

from sandgate.audit import events as A
from sandgate.errors import Code, Refused
from sandgate.llm import spend
from sandgate.stages.context import GateState, record
from sandgate.stages.s80_refuse import refusal_for

log = logging.getLogger("sandgate")


def check_writable(st: GateState) -> None:
    """Nothing is forwarded that cannot be audited (unless run with --audit-best-effort)."""
    if not st.cfg.audit.healthy and not st.cfg.audit_best_effort:
        raise Refused(Code.AUDIT_UNAVAILABLE, "Sandgate cannot write its audit log; nothing "
                      "is forwarded until it can", hint="retry later")


def audit(st: GateState, flow: http.HTTPFlow, event: str = "request") -> None:
    """The flow's one event (a second call is a no-op: several hooks may end a flow)."""
    rec = record(flow)
    if rec.audited:
        return
    rec.audited = True
    try:
        # an LLM call's reservation: what it really spent (nothing, if never sent upstream)
        spend.settle(st.counts, rec.llm,
                     rec.refused and flow.server_conn.timestamp_start is None)
        fields = A.scrub_fields(A.flow_fields(flow, rec), st.secrets(rec))
        st.cfg.audit.emit(event, **fields)
        if st.cfg.flow_audited is not None:  # --otlp: the flow's span (sandgate.audit.export)
            st.cfg.flow_audited(event, flow, rec, fields, st.secrets(rec))
    except Exception:
        log.exception("sandgate: audit failed")


def audit_event(st: GateState, flow: http.HTTPFlow, event: str, error: Refused) -> None:
    """An event of its own (after the flow's request event was written)."""
    rec = record(flow)
    refusal = refusal_for(st, flow, error)
    saved, rec.refusal = rec.refusal, refusal
    try:
        st.cfg.audit.emit(event, **A.scrub_fields(A.flow_fields(flow, rec),
                                                    st.secrets(rec)))
    except Exception:
        log.exception("sandgate: audit failed")
    finally:
        rec.refusal = saved


def audit_limit(st: GateState, code: Code, reason: str, client: connection.Client) -> None:
    """A limit met where there is no flow (a connection, a head that never ended)."""
    peer = client.peername
    try:
        st.cfg.audit.emit("limit", code=str(code), reason=reason,
                          client=f"{peer[0]}:{peer[1]}" if peer else None)
    except Exception:
        log.exception("sandgate: audit failed")
