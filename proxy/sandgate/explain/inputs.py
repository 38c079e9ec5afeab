"""One `explain` input as fields: an `explain --batch` JSON line and the admin API's
`POST /v1/explain` body are read by `parse_input` and judged by `explain_input`, so both take
every input the proxy judges (the caller's sandbox, the way in, the body or the call it carries,
the headers, a policy DNS name and type) in one spelling, checked one way (docs/traffic.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandgate.policy.model import Policy
from sandgate.rpc.call_cli import call_from_values
from sandgate.rpc.jsonrpc import Call


@dataclass(frozen=True)
class ExplainInput:
    """A request (with what the proxy judges besides its head: the caller's sandbox, the way
    in, the body or the call it carries, its headers) or, with `dns`, a policy DNS query."""

    identity: str
    method: str = ""
    url: str = ""
    sandbox: str | None = None
    gateway: bool = False
    call: Call | None = None
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()  # (lower-case name, value), as sent
    websocket: bool = False
    dns: str | None = None
    qtype: str = "A"


# The fields of an input (docs/traffic.md); any other is refused, so that a misspelt field is
# never silently dropped from what is judged.
FIELDS = frozenset({"identity", "method", "url", "sandbox", "gateway", "body", "body_file",
                    "headers", "mcp_tool", "mcp_args", "rpc_method", "mcp_resource",
                    "websocket", "dns", "type"})


def parse_input(doc: Mapping[str, Any], sandbox: str | None = None, gateway: bool = False,
                base: Path | None = None, files: bool = True) -> ExplainInput:
    """The input a JSON object of FIELDS describes. `sandbox` and `gateway` are the defaults
    (a command line's) the object may override; `base` is where a `body_file` is relative to;
    `files`: whether `body_file` may be read at all (never for the admin API: it would read
    the proxy's files). Raises ValueError saying what is wrong."""
    known = FIELDS if files else FIELDS - {"body_file"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; the fields are "
                         f"{', '.join(sorted(known))}")
    identity = _text(doc, "identity")
    if identity is None:
        raise ValueError("\"identity\" is required")
    if "sandbox" in doc:
        if doc["sandbox"] is not None and not isinstance(doc["sandbox"], str):
            raise ValueError("\"sandbox\" must be a string or null (no sandbox)")
        sandbox = doc["sandbox"]
    if "gateway" in doc:
        if not isinstance(doc["gateway"], bool):
            raise ValueError("\"gateway\" must be true or false")
        gateway = doc["gateway"]
    dns = _text(doc, "dns")
    if dns is not None:
        extra = sorted(set(doc) - {"identity", "dns", "type", "sandbox"})
        if extra:
            raise ValueError(f"a \"dns\" input is a name query: no {', '.join(extra)}")
        return ExplainInput(identity, sandbox=sandbox, dns=dns,
                            qtype=_text(doc, "type") or "A")
    if "type" in doc:
        raise ValueError("\"type\" goes with \"dns\"")
    method, url = _text(doc, "method"), _text(doc, "url")
    if method is None or url is None:
        raise ValueError("\"method\" and \"url\" are required (or \"dns\")")
    call = call_from_values(doc.get("mcp_tool"), doc.get("mcp_args"), doc.get("rpc_method"),
                            resource=doc.get("mcp_resource"))
    raw: bytes | None = None
    if "body" in doc and "body_file" in doc:
        raise ValueError("give \"body\" or \"body_file\", not both")
    if "body" in doc:
        value = doc["body"]
        # a string is the body as sent; JSON (a JSON-RPC message or batch) is sent as JSON
        raw = value.encode("utf-8") if isinstance(value, str) else json.dumps(
            value, separators=(",", ":")).encode()
    elif "body_file" in doc:
        name = _text(doc, "body_file")
        if name is None:
            raise ValueError("\"body_file\" must be a file name")
        path = Path(name) if base is None else base / name
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ValueError(f"body_file {name}: {e.strerror or e}") from None
    websocket = doc.get("websocket", False)
    if not isinstance(websocket, bool):
        raise ValueError("\"websocket\" must be true or false")
    if raw is not None and (call is not None or websocket):
        raise ValueError("give the body or the call (mcp_tool, rpc_method, mcp_resource, a "
                         "WebSocket message), not both")
    return ExplainInput(identity, method, url, sandbox, gateway, call, raw,
                        _headers(doc.get("headers")), websocket)


def explain_input(policy: Policy, inp: ExplainInput, resolve: Mapping[str, str]
                  ) -> tuple[dict[str, Any], bool]:
    """(the explanation, allowed or resolves): `explain_request`, or `explain_name` for a
    `dns` input. Raises ValueError for a request that cannot be judged."""
    from sandgate.explain.answer import explain_name, explain_request
    from sandgate.policy.dnstypes import query_type

    if inp.dns is not None:
        return explain_name(policy, inp.identity, inp.dns, query_type(inp.qtype))
    return explain_request(policy, inp.identity, inp.method, inp.url, resolve, inp.sandbox,
                           inp.gateway, inp.call, inp.websocket, inp.headers, inp.body)


def _text(doc: Mapping[str, object], key: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"\"{key}\" must be a non-empty string")
    return value


def _headers(value: object) -> tuple[tuple[str, str], ...]:
    """{"Name": "value" or ["value", ...]} as the (name, value) pairs `explain -H` gives
    (sandgate.request.parse_header: lower-case names, checked as the proxy would see them)."""
    from sandgate.request import parse_header

    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError("\"headers\" must be an object of name: value (or [values])")
    out: list[tuple[str, str]] = []
    for name, v in value.items():
        values = [v] if isinstance(v, str) else v
        if not isinstance(values, list) or not all(isinstance(x, str) for x in values):
            raise ValueError(f"header {name[:60]!r}: a value must be a string or a list of "
                             "strings")
        out += [parse_header(name, x) for x in values]
    return tuple(out)
