"""RFC 5424 syslog messages of audit events, framed by octet counting (RFC 6587 3.4.1, which
RFC 5425 requires over TLS). Pure functions: property-tested in tests/unit/test_export_syslog.py.

A message is

    <PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID [sandgate@32473 k="v" ...] BOM{json}

PRI is facility 13 (log audit) with severity info for allowed events and notice for the rest.
The structured data carries a few fields a collector can index without parsing the message; the
message is the whole event as one JSON object, as in the audit file: Sandgate's JSON, or with
`--audit-format ocsf` the OCSF event (sandgate.audit.ocsf), so a collector gets what the file
holds. 32473 is the enterprise
number RFC 5612 reserves for examples: Sandgate has none of its own, and a collector matches on
the SD-ID as a string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

FACILITY_AUDIT = 13  # RFC 5424 6.2.1: "log audit"
SEVERITY_INFO = 6
SEVERITY_NOTICE = 5
SD_ID = "sandgate@32473"
BOM = "\ufeff"  # RFC 5424 6.4: a UTF-8 MSG starts with the BOM
NILVALUE = "-"

# The event fields copied into the structured data (all short; names are SD-NAME safe).
SD_FIELDS = ("event", "decision", "code", "identity", "sandbox", "rule", "host", "method",
             "upstream_status", "worker", "instance")

# RFC 5424 6.2.4/6.2.5/6.2.6: header fields are PRINTUSASCII (33..126), of bounded length
_HEADER_MAX = {"hostname": 255, "app": 48, "procid": 128, "msgid": 32}
_NOT_PRINTUSASCII = re.compile(r"[^\x21-\x7e]")


def header_field(value: str | None, kind: str) -> str:
    """A header field as RFC 5424 allows it: printable US-ASCII without spaces, truncated;
    empty or missing is the NILVALUE."""
    if not value:
        return NILVALUE
    clean = _NOT_PRINTUSASCII.sub("_", value)[:_HEADER_MAX[kind]]
    return clean or NILVALUE


def escape_param(value: str) -> str:
    """RFC 5424 6.3.3: inside a PARAM-VALUE, '"', '\\' and ']' are escaped by a backslash."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


def unescape_param(escaped: str) -> str:
    """The inverse of escape_param (a backslash before any other character stays)."""
    out: list[str] = []
    i = 0
    while i < len(escaped):
        c = escaped[i]
        if c == "\\" and i + 1 < len(escaped) and escaped[i + 1] in '"\\]':
            out.append(escaped[i + 1])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def sd_value(value: object) -> str:
    """A PARAM-VALUE: control characters (a sandbox's Host or path may hold a newline, which
    would split the message in a line-based store) become U+FFFD, then the three escaped.
    The MSG's JSON keeps the exact value."""
    return escape_param(_CONTROL.sub("\ufffd", str(value)))


def structured_data(fields: Mapping[str, Any]) -> str:
    """One SD-ELEMENT with the indexable fields that have a value, or the NILVALUE."""
    params = [f'{name}="{sd_value(fields[name])}"' for name in SD_FIELDS
              if fields.get(name) is not None]
    return f"[{SD_ID} {' '.join(params)}]" if params else NILVALUE


def severity(fields: Mapping[str, Any]) -> int:
    return SEVERITY_INFO if fields.get("decision") in (None, "allow") and not fields.get(
        "code") else SEVERITY_NOTICE


def timestamp(at: datetime) -> str:
    """RFC 5424 6.2.3 (RFC 3339, UTC, milliseconds)."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message(event: str, fields: Mapping[str, Any], *, hostname: str, procid: str,
            at: datetime, app: str = "sandgate", audit_format: str = "json") -> bytes:
    """One RFC 5424 message (without framing) of one audit event; the MSG in the audit
    format ("json" or "ocsf"), the structured data from Sandgate's fields either way."""
    record = {"time": timestamp(at), "event": event, **fields}
    pri = FACILITY_AUDIT * 8 + severity(record)
    head = " ".join((f"<{pri}>1", timestamp(at), header_field(hostname, "hostname"),
                     header_field(app, "app"), header_field(procid, "procid"),
                     header_field(event, "msgid"), structured_data(record)))
    if audit_format == "ocsf":
        from sandgate.audit.ocsf import to_ocsf

        body = json.dumps(to_ocsf(record), default=str, ensure_ascii=False,
                          separators=(",", ":"))
    else:
        body = json.dumps(record, default=str, ensure_ascii=False, separators=(",", ":"))
    return f"{head} {BOM}{body}".encode()


def frame(msg: bytes) -> bytes:
    """Octet-counting framing: the message's length in bytes, a space, the message."""
    return b"%d %b" % (len(msg), msg)


def unframe(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete frames at the start of `data` and what is left (a receiver's view; the
    tests use it as the oracle of `frame`). Raises ValueError on a malformed length."""
    out: list[bytes] = []
    while data:
        length, space, rest = data.partition(b" ")
        if not space:
            if not length.isdigit():
                raise ValueError("malformed octet count")
            break
        if not length.isdigit() or length.startswith(b"0"):
            raise ValueError("malformed octet count")
        n = int(length)
        if len(rest) < n:
            break
        out.append(rest[:n])
        data = rest[n:]
    return out, data
