"""The JSON-RPC call options of `sandgate explain`: --mcp-tool, --mcp-args, --rpc-method,
--mcp-resource.

`explain --identity bash-tool --mcp-tool delete_repo POST https://mcp.example.com/mcp` judges
the request as carrying that tools/call, through the same decide() the proxy runs on the body.
"""

from __future__ import annotations

import argparse
import json

from sandgate.rpc.jsonrpc import Call, method_call, tool_call


def add_call_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mcp-tool", metavar="NAME", default=None,
                        help="the request carries an MCP tools/call of this tool (judged by "
                        "the rules' mcp:)")
    parser.add_argument("--mcp-args", metavar="JSON", default=None,
                        help="with --mcp-tool: the tool's arguments as a JSON object, checked "
                        "against `arguments:` constraints (default: {}, no arguments, as the "
                        "proxy would see a call without them)")
    parser.add_argument("--rpc-method", metavar="METHOD", default=None,
                        help="the request carries a JSON-RPC (or MCP) request of this method")
    parser.add_argument("--mcp-resource", metavar="URI", default=None,
                        help="the request carries an MCP resources/read of this URI (judged "
                        "by the rules' mcp: resources)")
    parser.add_argument("--websocket", action="store_true",
                        help="the request (a GET) opens a WebSocket, refused by a rule with "
                        "mcp:/jsonrpc: unless it says websocket: true; with --mcp-tool or "
                        "--rpc-method, the call is a message on that WebSocket")


def call_from_args(args: argparse.Namespace) -> Call | None:
    """The call the options describe, or None. Raises ValueError for contradictory ones."""
    raw = args.mcp_args
    arguments: object = None
    if raw is not None:
        try:
            arguments = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"--mcp-args is not JSON: {e}") from None
    return call_from_values(args.mcp_tool, arguments, args.rpc_method, "--", args.mcp_resource)


def call_from_values(tool: object, arguments: object, method: object,
                     prefix: str = "", resource: object = None) -> Call | None:
    """The call from explain's options (CLI) or fields (`POST /v1/explain` and `explain
    --batch` lines: mcp_tool, mcp_args, rpc_method, mcp_resource)."""
    name = {k: f"{prefix}{k.replace('_', '-') if prefix else k}"
            for k in ("mcp_tool", "mcp_args", "rpc_method", "mcp_resource")}
    for key, value in (("mcp_tool", tool), ("rpc_method", method), ("mcp_resource", resource)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name[key]} must be a non-empty string")
    given = [name[k] for k, v in (("mcp_tool", tool), ("rpc_method", method),
                                  ("mcp_resource", resource)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give {' or '.join(given)}, not both" if len(given) == 2 else
                         f"give one of {', '.join(given)}")
    if arguments is not None and tool is None:
        raise ValueError(f"{name['mcp_args']} goes with {name['mcp_tool']}")
    if arguments is not None and not isinstance(arguments, dict):
        raise ValueError(f"{name['mcp_args']} must be a JSON object")
    if isinstance(tool, str):
        return tool_call(tool, arguments if isinstance(arguments, dict) else {})
    if isinstance(method, str):
        return method_call(method)
    if isinstance(resource, str):
        return method_call("resources/read", resource)
    return None
