"""The JSON-RPC call a request body carries, read as the proxy reads it: one function for the
proxy's call stage (sandgate.stages.rpccalls) and for `explain` given a body (`explain --batch`
lines with `body`), so that both judge the same call or refuse the same body.

Pure: no I/O, no policy. The decision is sandgate.decision's; this only turns the bytes and the
MCP metadata headers into the call it judges, or into the refusal the proxy answers.
"""

from __future__ import annotations

from sandgate.errors import BadRequest, Code, Refused
from sandgate.rpc import mcpheaders
from sandgate.rpc.jsonrpc import Call, CallError, parse
from sandgate.rpc.mcpheaders import HeaderMismatch, Lookup


def read_call(call_limit: int, body: bytes, content_encoding: str | None) -> Call:
    """The call in a non-empty body a rule with `mcp:`/`jsonrpc:` judges (at most `call_limit`
    bytes). Raises BadRequest as the proxy answers it: an encoded body (judged as sent), one
    larger than the rule's max_body, or one that is not a well-formed JSON-RPC call."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadRequest(Code.BAD_REQUEST, f"a JSON-RPC body must not be {encoding!r}-encoded: "
                         "Sandgate judges the call as sent")
    if len(body) > call_limit:
        raise BadRequest(Code.TOO_LARGE, f"the JSON-RPC body is larger than the rule allows "
                         f"({call_limit} bytes, mcp.max_body)",
                         hint="raise max_body in the rule's mcp:/jsonrpc: if such calls are "
                         "expected")
    try:
        return parse(body)
    except CallError as e:
        raise BadRequest(Code.BAD_REQUEST, f"the body is not a JSON-RPC call Sandgate can "
                         f"judge: {e}") from None


def header_mismatch(lookup: Lookup, call: Call | None, session_version: str | None = None
                    ) -> Refused | None:
    """MCP's Mcp-Method / Mcp-Name / MCP-Protocol-Version against the body (`call`; None: no
    body): the refusal when they disagree, whatever the policy says (sandgate.rpc.mcpheaders)."""
    try:
        mcpheaders.check(lookup, call, session_version)
    except HeaderMismatch as e:
        return Refused(Code.HEADER_MISMATCH, f"the MCP request's headers do not agree with "
                       f"its body: {e}", hint=mcpheaders.HINT)
    return None
