"""`--audit-format ocsf`: every kind of audit event becomes a valid OCSF 1.8.0 event of the
fitting class, with Sandgate's own fields under `unmapped` (validated against the vendored
schema: tests/support/ocsf_schema.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from sandgate.audit import ocsf as audit_ocsf
from sandgate.audit.chain import Chain
from sandgate.audit.events import AuditLog
from tests.support.ocsf_schema import check, problems
from tests.unit.audit_log import fields
from tests.unit.test_audit_chain import KEY

DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def rpc_fields() -> dict[str, Any]:
    f = fields("agent", "POST", "https://mcp.example/mcp", rule="mcp-tools")
    f["rpc"] = [{"kind": "request", "method": "tools/call", "id": 7, "decision": "allow",
                 "tool": "search", "args_bytes": 12, "args_sha256": "ab" * 32}]
    return f


# (event, fields, expected class_uid, expected activity_id)
KINDS: list[tuple[str, dict[str, Any], int, int]] = [
    ("request", fields("agent", "GET", "https://api.example/v1?q=1", rule="api",
                       secrets=["api@3"], dialed="203.0.113.7:443"), 4002, 3),
    ("request", fields("agent", "POST", "http://api.example/v1", decision="deny",
                       code="no_rule"), 4002, 6),
    ("request", fields("agent", "PATCH", "https://api.example/v1", decision="report",
                       code="no_rule"), 4002, 9),
    ("request", fields("agent", "BREW", "https://api.example/v1"), 4002, 99),
    ("request", {**fields("agent", "GET", "https://api.example/v1", decision="deny",
                          code="exfiltration"), "exfiltration": ["api"]}, 4002, 3),
    ("request", fields(None, "GET", "https://api.example/", decision="deny",
                       code="auth_required"), 3002, 1),
    ("connect", fields("ghost", "CONNECT", "api.example:443", decision="deny",
                       code="unknown_identity"), 3002, 1),
    ("connect", fields(None, "CONNECT", "api.example:443", decision="challenge",
                       code="auth_required"), 3002, 1),
    ("connect", fields("agent", "CONNECT", "api.example:443", rule="tunnel"), 4001, 1),
    ("connect", fields("agent", "CONNECT", "api.example:443", decision="deny",
                       code="no_rule"), 4001, 5),
    ("websocket", fields("agent", "GET", "https://ws.example/socket", decision="deny",
                         code="exfiltration"), 4002, 99),
    ("request", rpc_fields(), 6003, 99),
    ("limit", {"code": "too_many_connections", "reason": "over 100 connections",
               "client": "10.0.0.2:4000"}, 4001, 5),
    ("lease", {"action": "mint", "outcome": "ok", "secret": "db", "identity": "agent",
               "sandbox": "sb1", "lease_id": "database/creds/ro/abc", "ttl": 60}, 6003, 1),
    ("lease", {"action": "renew", "outcome": "failed", "secret": "db", "error": "x"}, 6003, 3),
    ("lease", {"action": "revoke", "outcome": "ok", "secret": "db", "reason": "ended"},
     6003, 4),
    ("lease", {"action": "sandbox_end", "outcome": "ok", "sandbox": "sb1"}, 6003, 4),
    ("token", {"identity": "agent", "sandbox": None, "ttl": 600, "issued_by": "admin_api"},
     6003, 1),
    ("policy", {"outcome": "ok", "trigger": "start", "version": "abc", "previous": None,
                "files": ["p.yaml"], "problems": []}, 6002, 3),
    ("policy", {"outcome": "error", "trigger": "sighup", "version": "abc",
                "previous": "abc", "files": ["p.yaml"], "problems": ["bad"]}, 6002, 8),
    ("shutdown", {"policy_version": "abc", "drained": True, "unfinished": 0,
                  "drain_seconds": 0.1}, 6002, 4),
    ("rotate", {"file": "audit.jsonl", "previous_file": "audit.jsonl.20260101T000000.000000Z",
                "previous_last": "ab" * 32}, 1008, 5),
    ("retention", {"dropped_file": "audit.jsonl.20260101T000000.000000Z",
                   "dropped_last": "ab" * 32}, 1008, 2),
    ("dns", {"identity": "agent", "sandbox": None, "identity_source": "address",
             "client": "10.0.0.2:5353", "host": "api.example", "qtype": "AAAA",
             "decision": "allow", "rule": "api", "rcode": "NOERROR", "answers": 1}, 4003, 1),
    ("dns", {"identity": None, "client": "10.0.0.9", "host": "x.example", "qtype": "A",
             "decision": "deny", "code": "auth_invalid", "rcode": "REFUSED",
             "reason": "no sandbox is known at address 10.0.0.9"}, 4003, 1),
    ("approval", {"action": "requested", "approval": "ap-1", "identity": "agent",
                  "sandbox": "sb1", "method": "POST", "url": "https://api.example/x",
                  "rule": "ask-me", "tool": None, "body_sha256": "ab" * 32,
                  "body_size": 2}, 6003, 1),
    ("approval", {"action": "decided", "approval": "ap-1", "approver": "alice",
                  "decision": "allow"}, 6003, 3),
    ("something_new", {"detail": 1}, 6002, 99),
]


@pytest.mark.parametrize("event, f, class_uid, activity_id", KINDS,
                         ids=[f"{k[0]}-{k[2]}-{k[3]}" for k in KINDS])
def test_every_event_kind_is_a_valid_ocsf_event(event, f, class_uid, activity_id):
    buf = io.StringIO()
    log = AuditLog(buf, instance="sg-1", format="ocsf", chain=Chain(KEY, 1000, 3600))
    log.emit(event, **f)
    log.close()
    out = [json.loads(x) for x in buf.getvalue().splitlines()]
    for e in out:
        check(e)
    first, closing = out[0], out[-1]
    assert (first["class_uid"], first["activity_id"]) == (class_uid, activity_id)
    assert first["unmapped"]["event"] == event and first["metadata"]["event_code"] == event
    for k, v in f.items():  # nothing of Sandgate's is lost
        assert first["unmapped"][k] == v
    assert (closing["class_uid"], closing["unmapped"]["event"]) == (1008, "checkpoint")


def test_http_fields_land_where_a_siem_looks():
    rec = {"time": "2026-11-24T12:00:00.250Z", "event": "request",
           **fields("agent", "GET", "https://api.example/v1?key=s&x=1", rule="api",
                    dialed="203.0.113.7:443")}
    e = audit_ocsf.to_ocsf(rec)
    check(e)
    assert e["time"] == 1795521600250
    assert e["actor"]["user"]["name"] == "agent" and e["policy"]["name"] == "api"
    assert e["http_request"]["url"]["query_string"] == "key=REDACTED&x=REDACTED"
    assert e["dst_endpoint"] == {"name": "api.example", "hostname": "api.example",
                                 "port": 443, "ip": "203.0.113.7"}
    assert e["src_endpoint"]["ip"] == "127.0.0.1" and e["http_response"]["code"] == 200
    assert (e["action"], e["disposition"], e["status"]) == ("Allowed", "Allowed", "Success")
    denied = audit_ocsf.to_ocsf({**rec, "decision": "deny", "code": "no_rule"})
    assert (denied["action_id"], denied["disposition_id"], denied["status_code"]) == \
        (2, 2, "no_rule")


def test_the_validator_is_strict():
    e = audit_ocsf.to_ocsf({"time": "2026-11-24T12:00:00Z", "event": "request",
                            **fields("agent", "GET", "https://api.example/")})
    assert not problems(e)
    assert problems({**e, "made_up": 1})
    assert problems({**e, "activity_id": 42})
    assert problems({**e, "metadata": {"product": {"name": "x"}}})


def test_the_docs_tables_are_the_mapping():
    text = DOCS.read_text()
    assert audit_ocsf.mapping_table() in text, \
        "docs/audit.md: paste sandgate.audit.ocsf.mapping_table()"
    assert audit_ocsf.class_table() in text, \
        "docs/audit.md: paste sandgate.audit.ocsf.class_table()"
