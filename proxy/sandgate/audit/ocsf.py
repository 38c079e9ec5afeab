"""`--audit-format ocsf`: each audit event as an OCSF 1.8.0 event (one JSON object per line).

The mapping is data: `CLASSES` says which OCSF class an event becomes, `FIELDS` where each
Sandgate field goes. Every Sandgate field is also kept as it is under `unmapped` (so nothing
the JSON format says is lost, and a SIEM rule can always fall back on it). The table in
docs/audit.md is generated from this module (`mapping_table`).

Which class:
- a `request` (intercepted HTTP, gateway, SOCKS5 plain HTTP) and `websocket`: HTTP Activity
  (4002), the activity from the method;
- a `connect` (a CONNECT tunnel, a passthrough) and a `limit` (a connection refused before any
  request): Network Activity (4001), Open or Refuse;
- any of these refused for the proxy token (auth_required, auth_invalid, unknown_identity):
  Authentication (3002), Logon failed;
- a `request` (or a `websocket` message) carrying MCP / JSON-RPC messages (`rpc`): API
  Activity (6003), `api.operation` the (first) method, `api.service.name` the tool;
- `admin_login` (the web console's logins, logouts, expired sessions, a wrong admin API
  token: sandgate.admin.login): Authentication (3002), Logon / Logoff;
- `dns` (a query to the policy DNS): DNS Activity (4003), Query;
- `lease` (dynamic secrets at Vault), `token` (the admin API minting a proxy token) and
  `approval` (an `action: ask` request held for approval): API Activity (6003);
- `policy` and `shutdown`: Application Lifecycle (6002), Start / Update / Stop;
- the audit log's own `checkpoint`, `rotate` and `retention` lines: Event Log Activity (1008),
  Other / Rotate / Delete.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sandgate import __version__

OCSF_VERSION = "1.8.0"

AUTH_CODES = frozenset({"auth_required", "auth_invalid", "unknown_identity"})

# class_uid -> (class name, category_uid, category name)
CLASSES: dict[int, tuple[str, int, str]] = {
    1008: ("Event Log Activity", 1, "System Activity"),
    3002: ("Authentication", 3, "Identity & Access Management"),
    4001: ("Network Activity", 4, "Network Activity"),
    4002: ("HTTP Activity", 4, "Network Activity"),
    4003: ("DNS Activity", 4, "Network Activity"),
    6002: ("Application Lifecycle", 6, "Application Activity"),
    6003: ("API Activity", 6, "Application Activity"),
}

HTTP_ACTIVITY = {"CONNECT": (1, "Connect"), "DELETE": (2, "Delete"), "GET": (3, "Get"),
                 "HEAD": (4, "Head"), "OPTIONS": (5, "Options"), "POST": (6, "Post"),
                 "PUT": (7, "Put"), "TRACE": (8, "Trace"), "PATCH": (9, "Patch")}
OTHER = (99, "Other")

# event (and for lease the action) -> (class_uid, activity)
FIXED: dict[str, tuple[int, tuple[int, str]]] = {
    "limit": (4001, (5, "Refuse")),
    "token": (6003, (1, "Create")),
    "lease:mint": (6003, (1, "Create")),
    "lease:renew": (6003, (3, "Update")),
    "lease:expire": (6003, (4, "Delete")),
    "lease:revoke": (6003, (4, "Delete")),
    "lease:sandbox_end": (6003, (4, "Delete")),
    "policy:start": (6002, (3, "Start")),
    "policy": (6002, (8, "Update")),
    "shutdown": (6002, (4, "Stop")),
    "dns": (4003, (1, "Query")),
    "approval:requested": (6003, (1, "Create")),
    "approval:voted": (6003, (3, "Update")),
    "approval:decided": (6003, (3, "Update")),
    "approval:used": (6003, (2, "Read")),
    "approval:timed_out": (6003, (4, "Delete")),
    "admin_login:login": (3002, (1, "Logon")),
    "admin_login:failed": (3002, (1, "Logon")),
    "admin_login:logout": (3002, (2, "Logoff")),
    "admin_login:expired": (3002, (2, "Logoff")),
    "checkpoint": (1008, OTHER),
    "rotate": (1008, (5, "Rotate")),
    "retention": (1008, (2, "Delete")),
}

# Sandgate's decision -> (action_id, action, disposition_id, disposition, status_id, status)
DECISIONS: dict[str, tuple[int, str, int, str, int, str]] = {
    "allow": (1, "Allowed", 1, "Allowed", 1, "Success"),
    "deny": (2, "Denied", 2, "Blocked", 2, "Failure"),
    "report": (3, "Observed", 17, "Logged", 1, "Success"),  # refused by the rules, forwarded
    # a 407 asking for proxy credentials: the logon is not done yet (its retry is the logon)
    "challenge": (2, "Denied", 2, "Blocked", 2, "Failure"),
}


def classify(rec: Mapping[str, Any]) -> tuple[int, tuple[int, str]]:
    """The OCSF class and activity of one audit record."""
    event = str(rec.get("event"))
    if event in ("request", "connect", "websocket") and rec.get("code") in AUTH_CODES:
        return 3002, (1, "Logon")
    if event in ("request", "websocket") and rec.get("rpc"):
        return 6003, OTHER
    if event in ("request", "websocket"):
        method = str(rec.get("method") or "").upper()
        if event == "websocket":
            return 4002, OTHER
        return 4002, HTTP_ACTIVITY.get(method, OTHER)
    if event == "connect":
        return 4001, (1, "Open") if rec.get("decision") != "deny" else (5, "Refuse")
    if event in ("lease", "approval"):
        return FIXED.get(f"{event}:{rec.get('action')}", (6003, OTHER))
    if event == "admin_login":
        return FIXED.get(f"{event}:{rec.get('action')}", (3002, OTHER))
    if event == "policy" and rec.get("trigger") == "start":
        return FIXED["policy:start"]
    return FIXED.get(event, (6002, OTHER))


# ------------------------------------------------------------------------------- fields

def _epoch_ms(value: Any) -> int:
    try:
        return int(datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
                   * 1000)
    except ValueError:
        return 0


def _endpoint(addr: Any) -> dict[str, Any] | None:
    """`ip:port` (a client, the dialled address) as an OCSF network endpoint."""
    if not isinstance(addr, str) or ":" not in addr:
        return None
    ip, _, port = addr.rpartition(":")
    out: dict[str, Any] = {"uid": addr, "ip": ip.strip("[]")}
    if port.isdigit() and int(port) <= 65535:
        out["port"] = int(port)
    return out


def _url(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    host, path = rec.get("host"), rec.get("path")
    if not isinstance(host, str) or not isinstance(path, str):
        return None
    scheme = rec.get("scheme") or "http"
    port = rec.get("port")
    base, _, query = path.partition("?")
    out: dict[str, Any] = {"scheme": scheme, "hostname": host, "path": base or "/",
                           "url_string": f"{scheme}://{host}"
                                         f"{f':{port}' if isinstance(port, int) else ''}{path}"}
    if isinstance(port, int):
        out["port"] = port
    if query:
        out["query_string"] = query
    return out


@dataclass(frozen=True)
class Field:
    """One Sandgate field and where OCSF takes it (for the generated table: `doc`)."""

    source: str
    target: str
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("time", "time", "epoch milliseconds (the ISO time stays in unmapped.time)"),
    Field("event", "metadata.event_code", "Sandgate's event name; also picks the class"),
    Field("decision", "action_id, disposition_id, status_id",
          "allow: Allowed/Allowed/Success; deny: Denied/Blocked/Failure; "
          "report: Observed/Logged/Success; challenge (a 407 asking for proxy credentials): "
          "Denied/Blocked/Failure, severity Informational"),
    Field("code", "status_code", "Sandgate's refusal code (errors.Code)"),
    Field("reason", "status_detail, message", "why, in words"),
    Field("identity", "actor.user.name (user.name for Authentication)",
          "the identity the caller proved"),
    Field("client", "src_endpoint.ip, .port, .uid", "the sandbox's address"),
    Field("method", "http_request.http_method", "and the HTTP activity"),
    Field("scheme, host, port, path", "http_request.url, dst_endpoint.hostname/.port",
          "the path with query values REDACTED, as in the JSON format"),
    Field("rule", "policy.name", "the rule that decided"),
    Field("upstream_status", "http_response.code", ""),
    Field("bytes_in", "traffic.bytes_out", "request body bytes, sandbox to upstream"),
    Field("bytes_out", "traffic.bytes_in", "response body bytes, upstream to sandbox"),
    Field("duration_ms", "duration", "whole milliseconds"),
    Field("dialed", "dst_endpoint.ip", "the address actually dialled"),
    Field("exfiltration", "severity_id 4 (High)", "a secret or placeholder seen where not bound"),
    Field("rpc[0].method, rpc[0].tool", "api.operation, api.service.name",
          "MCP / JSON-RPC (API Activity)"),
    Field("action, secret, lease_id (lease)", "api.operation, api.service.name=vault, "
          "resources[0].name/.uid", "dynamic secret leases"),
    Field("host, qtype, rcode (dns)", "query.hostname, query.type, rcode_id/rcode",
          "the policy DNS"),
    Field("action, approval, approver (approval)", "api.operation, resources[0].uid, "
          "src_endpoint.name", "approvals"),
    Field("action, user, role, via, source (admin_login)", "activity Logon / Logoff, "
          "user.name, user.groups[0].name, service.name, src_endpoint.ip",
          "console and admin API logins (never the token)"),
    Field("previous_file (rotate), dropped_file (retention)", "file.name, log_name",
          "the audit log's own events"),
    Field("chain, seq, prev, key, sig", "unmapped.*, metadata.sequence",
          "the hash chain (docs/audit.md)"),
    Field("every field", "unmapped.<field>", "the JSON format's object, unchanged"),
)


def _severity(rec: Mapping[str, Any]) -> tuple[int, str]:
    if rec.get("exfiltration"):
        return 4, "High"
    decision = rec.get("decision")
    if decision == "deny" or rec.get("event") == "limit" or rec.get("outcome") == "failed":
        return 3, "Medium"
    if decision == "report":
        return 2, "Low"
    return 1, "Informational"


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    if value is None:
        return
    *parents, leaf = path.split(".")
    for p in parents:
        obj = obj.setdefault(p, {})
    obj[leaf] = value


_Filler = Callable[[dict[str, Any], Mapping[str, Any]], None]


def _network(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    _set(out, "src_endpoint", _endpoint(rec.get("client")))
    host, port = rec.get("host"), rec.get("port")
    if isinstance(host, str):
        dst: dict[str, Any] = {"name": host, "hostname": host}
        if isinstance(port, int) and 0 <= port <= 65535:
            dst["port"] = port
        dialed = _endpoint(rec.get("dialed"))
        if dialed is not None:
            dst["ip"] = dialed["ip"]
        out["dst_endpoint"] = dst
    if "src_endpoint" not in out and "dst_endpoint" not in out:  # OCSF needs one of them
        out["src_endpoint"] = {"name": "unknown"}
    traffic = {k: v for k, v in (("bytes_out", rec.get("bytes_in")),
                                 ("bytes_in", rec.get("bytes_out")))
               if isinstance(v, int)}
    if traffic and rec.get("event") != "limit":
        out["traffic"] = traffic
    if isinstance(rec.get("duration_ms"), int | float):
        out["duration"] = int(rec["duration_ms"])


def _http(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    _network(out, rec)
    request: dict[str, Any] = {}
    _set(request, "http_method", rec.get("method"))
    _set(request, "url", _url(rec))
    if request:
        out["http_request"] = request
    if isinstance(rec.get("upstream_status"), int):
        out["http_response"] = {"code": rec["upstream_status"]}


def _api(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    event = rec.get("event")
    if event == "lease":
        out["api"] = {"operation": f"lease/{rec.get('action')}", "service": {"name": "vault"}}
        if rec.get("secret"):
            res = {"name": str(rec["secret"]), "type": "secret"}
            if rec.get("lease_id"):
                res["uid"] = str(rec["lease_id"])
            out["resources"] = [res]
        out["src_endpoint"] = {"name": "sandgate"}
    elif event == "approval":
        out["api"] = {"operation": f"approval/{rec.get('action')}",
                      "service": {"name": "sandgate-approvals"}}
        if rec.get("approval"):
            out["resources"] = [{"uid": str(rec["approval"]), "type": "approval"}]
        out["src_endpoint"] = {"name": str(rec.get("approver") or "sandgate")}
    elif event == "token":
        out["api"] = {"operation": "token/issue", "service": {"name": "sandgate-admin"}}
        out["src_endpoint"] = {"name": str(rec.get("issued_by") or "admin_api")}
    else:  # an MCP / JSON-RPC call
        _http(out, rec)
        out.pop("traffic", None)  # not an attribute of API Activity (unmapped keeps the sizes)
        calls = rec.get("rpc") or [{}]
        first = calls[0] if isinstance(calls[0], dict) else {}
        api: dict[str, Any] = {"operation": str(first.get("method") or "unknown")}
        if first.get("tool") or first.get("name"):
            api["service"] = {"name": str(first.get("tool") or first.get("name"))}
        out["api"] = api
        out.setdefault("src_endpoint", {"name": "unknown"})


# DNS response codes by name (dnspython's spelling) -> OCSF rcode_id
RCODES = {"NOERROR": (0, "NoError"), "FORMERR": (1, "FormError"), "SERVFAIL": (2, "ServError"),
          "NXDOMAIN": (3, "NXDomain"), "NOTIMP": (4, "NotImp"), "REFUSED": (5, "Refused")}


def _dns(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    src = _endpoint(rec.get("client"))
    if src is None and isinstance(rec.get("client"), str):
        src = {"uid": rec["client"], "ip": rec["client"]}
    out["src_endpoint"] = src or {"name": "unknown"}
    if isinstance(rec.get("host"), str):
        query: dict[str, Any] = {"hostname": rec["host"]}
        if isinstance(rec.get("qtype"), str):
            query["type"] = rec["qtype"]
        out["query"] = query
    rcode = RCODES.get(str(rec.get("rcode")))
    if rcode is not None:
        out["rcode_id"], out["rcode"] = rcode
    elif rec.get("rcode") is not None:
        out["rcode_id"], out["rcode"] = 99, str(rec["rcode"])


def _admin_login(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    user: dict[str, Any] = {"name": str(rec["user"])} if rec.get("user") else \
        {"uid": "unknown"}
    if rec.get("role"):
        user["groups"] = [{"name": str(rec["role"])}]
    out["user"] = user
    source = str(rec.get("source") or "unknown")
    try:
        out["src_endpoint"] = {"uid": source, "ip": str(ipaddress.ip_address(source))}
    except ValueError:  # a unix socket's listener: no address
        out["src_endpoint"] = {"name": source}
    out["service"] = {"name": f"sandgate-{rec.get('via') or 'admin'}"}
    out["auth_protocol_id"] = 99
    out["auth_protocol"] = "Sandgate admin token"


def _auth(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    if rec.get("event") == "admin_login":
        _admin_login(out, rec)
        return
    _network(out, rec)
    out.pop("traffic", None)
    out.pop("duration", None)
    out["user"] = {"name": str(rec["identity"])} if rec.get("identity") else \
        {"uid": "unauthenticated"}
    out["service"] = {"name": str(rec.get("host") or "sandgate")}
    out["auth_protocol_id"] = 99
    out["auth_protocol"] = "Sandgate proxy token"


def _lifecycle(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    out["app"] = {"name": "Sandgate", "vendor_name": "Sandgate", "version": __version__}


def _eventlog(out: dict[str, Any], rec: Mapping[str, Any]) -> None:
    out["log_name"] = "sandgate-audit"
    name = rec.get("previous_file") or rec.get("dropped_file")
    if isinstance(name, str):
        out["file"] = {"name": name, "type_id": 1}


FILLERS: dict[int, _Filler] = {4002: _http, 4001: _network, 4003: _dns, 3002: _auth,
                               6003: _api, 6002: _lifecycle, 1008: _eventlog}


def to_ocsf(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The OCSF event of one audit record (the JSON format's object)."""
    class_uid, (activity_id, activity) = classify(rec)
    class_name, category_uid, category_name = CLASSES[class_uid]
    severity_id, severity = _severity(rec)
    profiles = ["host", "security_control"]
    out: dict[str, Any] = {
        "time": _epoch_ms(rec.get("time")),
        "class_uid": class_uid, "class_name": class_name,
        "category_uid": category_uid, "category_name": category_name,
        "activity_id": activity_id, "activity_name": activity,
        "type_uid": class_uid * 100 + activity_id,
        "type_name": f"{class_name}: {activity}",
        "severity_id": severity_id, "severity": severity,
        "metadata": {"version": OCSF_VERSION, "profiles": profiles,
                     "event_code": str(rec.get("event")), "log_name": "sandgate-audit",
                     "product": {"name": "Sandgate", "vendor_name": "Sandgate",
                                 "version": __version__}},
    }
    decision = rec.get("decision")
    if decision in DECISIONS:
        action_id, action, disp_id, disp, status_id, status = DECISIONS[str(decision)]
        out.update(action_id=action_id, action=action, disposition_id=disp_id,
                   disposition=disp, status_id=status_id, status=status)
    elif rec.get("event") == "limit":
        out.update(action_id=2, action="Denied", disposition_id=2, disposition="Blocked",
                   status_id=2, status="Failure")
    elif rec.get("outcome") is not None:
        ok = rec.get("outcome") == "ok"
        out.update(status_id=1 if ok else 2, status="Success" if ok else "Failure")
    _set(out, "status_code", rec.get("code"))
    if isinstance(rec.get("reason"), str):
        out["status_detail"] = out["message"] = rec["reason"]
    if rec.get("rule"):
        out["policy"] = {"name": str(rec["rule"])}
    if rec.get("identity") and class_uid != 3002:
        out["actor"] = {"user": {"name": str(rec["identity"])}}
    FILLERS[class_uid](out, rec)
    out["unmapped"] = dict(rec)
    return out


# For the docs: which event becomes which class and activity (classify() decides).
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("request", "intercepted HTTP (proxy, gateway, SOCKS5)", "HTTP Activity 4002, by method: "
     "Get 3, Post 6, Put 7, Delete 2, Patch 9, Head 4, Options 5, Trace 8, else Other 99"),
    ("request, websocket", "with MCP / JSON-RPC messages (`rpc`)",
     "API Activity 6003, Other 99"),
    ("request, connect, websocket", "code auth_required, auth_invalid or unknown_identity",
     "Authentication 3002, Logon 1 (status Failure)"),
    ("websocket", "a frame refused (exfiltration); a WebSocket closed as unjudgeable on a "
     "rule with mcp:/jsonrpc:", "HTTP Activity 4002, Other 99"),
    ("connect", "a CONNECT tunnel or passthrough", "Network Activity 4001, Open 1 "
     "(allowed) or Refuse 5"),
    ("limit", "a connection refused before any request", "Network Activity 4001, Refuse 5"),
    ("dns", "a query to the policy DNS (--dns)", "DNS Activity 4003, Query 1 (`query`, "
     "`rcode_id`)"),
    ("admin_login", "the web console's login / failed login / logout / expired session; a "
     "wrong admin API token", "Authentication 3002: Logon 1 (login, failed: status Failure), "
     "Logoff 2 (logout, expired)"),
    ("lease", "dynamic secret at Vault", "API Activity 6003: mint Create 1, renew Update 3, "
     "revoke / expire / sandbox_end Delete 4"),
    ("token", "the admin API issued a proxy token", "API Activity 6003, Create 1"),
    ("approval", "an `action: ask` request held for approval", "API Activity 6003: requested "
     "Create 1, voted / decided Update 3, used Read 2, timed_out Delete 4"),
    ("policy", "start / reload", "Application Lifecycle 6002, Start 3 / Update 8"),
    ("shutdown", "", "Application Lifecycle 6002, Stop 4"),
    ("checkpoint, rotate, retention", "the audit log's own lines",
     "Event Log Activity 1008: Other 99, Rotate 5, Delete 2"),
    ("anything else", "", "Application Lifecycle 6002, Other 99"),
)


def class_table() -> str:
    """The docs' event -> class table (Markdown)."""
    rows = ["| Event | When | OCSF class, activity |", "| --- | --- | --- |"]
    rows += [f"| `{e}` | {w} | {c} |" for e, w, c in ROUTES]
    return "\n".join(rows)


def mapping_table() -> str:
    """The docs' field-by-field table (Markdown), from FIELDS and the class routing."""
    rows = ["| Sandgate field | OCSF attribute | Note |", "| --- | --- | --- |"]
    rows += [f"| `{f.source}` | `{f.target}` | {f.doc} |" for f in FIELDS]
    return "\n".join(rows)
