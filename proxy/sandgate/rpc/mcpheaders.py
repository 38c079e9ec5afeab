"""MCP's request metadata headers, checked against the body they mirror.

Streamable HTTP clients mirror body fields into headers so that intermediaries can route
without reading the body: `Mcp-Method` (the JSON-RPC `method`), `Mcp-Name` (`params.name` of
tools/call and prompts/get, `params.uri` of resources/read and the resource subscriptions) and
`MCP-Protocol-Version` (2025-06-18 on; in the 2026-07-28 stateless revision it must equal the
body's `params._meta["io.modelcontextprotocol/protocolVersion"]`). Sandgate judges the body;
a server, load balancer or WAF behind it may act on the headers. A header that disagrees with
the body would let the request judged differ from the request acted on, so it is refused
(the spec's `HeaderMismatch`), never corrected or dropped:

- each of the three headers at most once (a first-copy and a last-copy reader would disagree);
- `Mcp-Method` equals the method of every message of the body (a batch: of each of them; a
  response, or a request without a body, has no method to agree with);
- `Mcp-Name`, decoded from the spec's `=?base64?...?=` form, equals the name every message
  targets; on a method that names nothing it is refused;
- `MCP-Protocol-Version` is a revision Sandgate knows, equals the body's `_meta` version where
  the body has one, and the version negotiated for the session where Sandgate bound one;
- in the stateless revision `Mcp-Method` (every request) and `Mcp-Name` (tools/call,
  prompts/get, resources/read) are required, as the spec requires them.

Pure: no I/O, no policy. Messages quote header values only shortened, for the reason text.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Sequence

from sandgate.errors import InvalidInput
from sandgate.rpc.jsonrpc import NAMED, VERSION_META, Call, Message

METHOD_HEADER = "mcp-method"
NAME_HEADER = "mcp-name"
VERSION_HEADER = "mcp-protocol-version"
HEADERS = (VERSION_HEADER, METHOD_HEADER, NAME_HEADER)
SHOWN = {VERSION_HEADER: "MCP-Protocol-Version", METHOD_HEADER: "Mcp-Method",
         NAME_HEADER: "Mcp-Name"}

# The protocol revisions Sandgate knows, oldest first; the stateless one(s) carry the version
# in every request body and require the mirrored headers.
KNOWN_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28")
STATELESS_VERSIONS = frozenset({"2026-07-28"})
# The methods whose Mcp-Name the stateless revision requires (the spec's table); the resource
# subscriptions of 2025 name a uri too, checked when a client sends the header.
NAME_REQUIRED = frozenset({"tools/call", "prompts/get", "resources/read"})

# The JSON-RPC error code of a header that disagrees with the body (MCP's HeaderMismatch),
# answered with HTTP 400 as the spec requires of servers and intermediaries alike.
HEADER_MISMATCH_CODE = -32020

_SENTINEL = re.compile(r"=\?base64\?(?P<payload>.*)\?=", re.DOTALL)
# RFC 9110 field values: visible ASCII, space and tab (anything else is sent base64-encoded)
_PLAIN = re.compile(r"[\t\x20-\x7e]*")
HINT = ("send Mcp-Method, Mcp-Name and MCP-Protocol-Version once each, exactly as the body "
        "says (the MCP SDKs do so), or leave them out on a 2025 session")

Lookup = Callable[[str], Sequence[str]]


class HeaderMismatch(InvalidInput):
    """A metadata header that does not agree with the body (a safe, short reason)."""


def _shown(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:57] + "...")


def decode_name(value: str) -> str:
    """An Mcp-Name value as the name it stands for: the `=?base64?...?=` form decoded (strict,
    canonical base64 of UTF-8), a plain value as it is (visible ASCII only)."""
    m = _SENTINEL.fullmatch(value)
    if m is None:
        if not _PLAIN.fullmatch(value):
            raise HeaderMismatch("the Mcp-Name header contains characters a header value "
                                 "cannot carry plain (send it as =?base64?...?=)")
        return value
    payload = m.group("payload")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise HeaderMismatch("the Mcp-Name header's =?base64?...?= value is not base64"
                             ) from None
    if base64.b64encode(raw).decode("ascii") != payload:  # one spelling per name
        raise HeaderMismatch("the Mcp-Name header's =?base64?...?= value is not canonical "
                             "base64")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HeaderMismatch("the Mcp-Name header's =?base64?...?= value is not UTF-8"
                             ) from None


def _once(lookup: Lookup, name: str) -> str | None:
    values = list(lookup(name))
    if len(values) > 1:
        raise HeaderMismatch(f"the {SHOWN[name]} header is given {len(values)} times; a "
                             "server could read another copy than Sandgate judged")
    return values[0].strip() if values else None


def check(lookup: Lookup, call: Call | None, session_version: str | None = None
          ) -> str | None:
    """Check the request's metadata headers against its body (`call`; None: no body). Returns
    the protocol version the request declares (header or body), or None; raises
    HeaderMismatch when a header disagrees with the body, is repeated, or is missing where
    the stateless revision requires it. `session_version`: the version Sandgate bound to the
    request's session (None: no session, or none bound)."""
    version = _once(lookup, VERSION_HEADER)
    method = _once(lookup, METHOD_HEADER)
    raw_name = _once(lookup, NAME_HEADER)
    messages: tuple[Message, ...] = call.messages if call is not None else ()
    calls = [m for m in messages if m.kind != "response"]

    if version is not None and version not in KNOWN_VERSIONS:
        raise HeaderMismatch(f"MCP-Protocol-Version {_shown(version)} is not a protocol "
                             f"revision Sandgate knows ({', '.join(KNOWN_VERSIONS)})")
    if session_version is not None and version is not None and version != session_version:
        raise HeaderMismatch(f"MCP-Protocol-Version {_shown(version)} is not the version "
                             f"negotiated for this session ({session_version})")
    body_versions = {m.version for m in calls if m.version is not None}
    for v in sorted(body_versions):
        if version is None:
            raise HeaderMismatch(f"the body carries {VERSION_META} {_shown(v)} but the "
                                 "request has no MCP-Protocol-Version header")
        if v != version:
            raise HeaderMismatch(f"MCP-Protocol-Version {_shown(version)} does not match the "
                                 f"body's {VERSION_META} {_shown(v)}")
    declared = version
    stateless = declared in STATELESS_VERSIONS
    if stateless:
        missing = [m for m in calls if m.kind == "request" and m.version is None]
        if missing:
            raise HeaderMismatch(f"MCP-Protocol-Version {declared} needs "
                                 f"{VERSION_META} in params._meta of every request; "
                                 f"{missing[0].shown} has none")

    if method is not None:
        if not messages:
            raise HeaderMismatch(f"Mcp-Method {_shown(method)} is given but the request "
                                 "carries no JSON-RPC message")
        for m in messages:
            if m.method != method:
                body = "a response" if m.method is None else f"method {_shown(m.method)}"
                raise HeaderMismatch(f"Mcp-Method {_shown(method)} does not match the body's "
                                     f"{body}")
    elif stateless and any(m.kind == "request" for m in calls):
        raise HeaderMismatch(f"MCP-Protocol-Version {declared} requires the Mcp-Method "
                             "header on every request")

    if raw_name is not None:
        name = decode_name(raw_name)
        if not messages:
            raise HeaderMismatch("Mcp-Name is given but the request carries no JSON-RPC "
                                 "message")
        for m in messages:
            if m.method not in NAMED or m.name is None:
                body = "a response" if m.method is None else f"method {_shown(m.method)}"
                raise HeaderMismatch(f"Mcp-Name {_shown(name)} is given but the body's {body} "
                                     "names nothing (Mcp-Name goes with "
                                     f"{', '.join(sorted(NAMED))})")
            if m.name != name:
                raise HeaderMismatch(f"Mcp-Name {_shown(name)} does not match the "
                                     f"params.{NAMED[m.method]} of the body's {m.method}, "
                                     f"{_shown(m.name)}")
    elif stateless:
        named = [m for m in calls if m.kind == "request" and m.method in NAME_REQUIRED]
        if named:
            raise HeaderMismatch(f"MCP-Protocol-Version {declared} requires the Mcp-Name "
                                 f"header on {named[0].method}")
    return declared
