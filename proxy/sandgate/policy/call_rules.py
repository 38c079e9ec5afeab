"""`mcp:` / `jsonrpc:` of a rule and of a fixture: file format -> compiled CallFilter / Call.

Kept apart from the compiler so that the call layer's checks sit in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sandgate.policy.model import DEFAULT_CALL_BODY, CallFilter, glob_matches
from sandgate.policy.schema import CallTestSpec, JsonRpcSpec, McpSpec, RuleSpec, TestSpec
from sandgate.rpc.jsonrpc import Call, method_call, tool_call
from sandgate.text import has_control_chars

if TYPE_CHECKING:
    from sandgate.decision import Decision

Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]

# A body is judged whole in memory: at most this, whatever a rule says.
MAX_CALL_BODY = 16 * 1024 * 1024


def _globs(values: Sequence[str] | None, loc: Loc, rep: Report,
           what: str) -> tuple[str, ...] | None:
    if values is None:
        return None
    out: list[str] = []
    for j, v in enumerate(values):
        if not v or has_control_chars(v) or v != v.strip():
            rep((*loc, j), f"{what} {v!r} is not a name or glob",
                f"write the {what} as the server spells it, e.g. list_issues or 'get_*' "
                "('*' any run of characters, '?' one)")
            continue
        out.append(v)
    return tuple(out)


def compile_call(rs: RuleSpec, loc: Loc, rep: Report,
                 parse_size: Callable[[int | str], int | None]) -> CallFilter | None:
    """The rule's call filter, or None when it has neither `mcp:` nor `jsonrpc:`."""
    spec: JsonRpcSpec | None = rs.mcp if rs.mcp is not None else rs.jsonrpc
    if spec is None:
        if rs.websocket is not None and rs.llm is None:  # with `llm:`: sandgate.policy.llm
            rep((*loc, "websocket"), "`websocket` goes with `mcp:`, `jsonrpc:` or `llm:`: a "
                "rule without them relays a WebSocket's messages unjudged (scrubbed) anyway",
                "remove `websocket`, or add the rule's `mcp:`/`jsonrpc:`/`llm:`")
        return None
    key = "mcp" if rs.mcp is not None else "jsonrpc"
    cloc: Loc = (*loc, key)
    if rs.mcp is not None and rs.jsonrpc is not None:
        rep((*loc, "jsonrpc"), "a rule carries either `mcp:` or `jsonrpc:`, not both",
            "keep `mcp:` for an MCP server (it is JSON-RPC with MCP's tool names)")
    if rs.action == "deny":
        rep(cloc, f"a deny rule cannot have `{key}:`: it would refuse only the calls it "
            "describes and let others of the same request through unread",
            f"put deny_methods{' / deny_tools' if key == 'mcp' else ''} in the `{key}:` of "
            "the allow rule for this server (deny entries win over every allow)")
    websocket = bool(rs.websocket)
    if websocket and rs.action == "ask":
        rep((*loc, "websocket"), "an `action: ask` rule cannot take `websocket: true`: an "
            "approval holds one HTTP request, and a WebSocket's messages cannot be held",
            "remove `websocket` (calls then go as POSTs, each held for approval)")
    elif websocket and rs.methods is not None and "GET" not in {m.upper() for m in rs.methods}:
        rep((*loc, "websocket"), "`websocket: true` has no effect: a WebSocket is opened by a "
            "GET, and the rule's `methods` does not list GET", "add GET to `methods`, or "
            "remove `websocket`")
    max_body = DEFAULT_CALL_BODY
    if spec.max_body is not None:
        size = parse_size(spec.max_body)
        if size is None or size > MAX_CALL_BODY:
            rep((*cloc, "max_body"), f"{spec.max_body!r} is not a size between 1 byte and "
                "16m", "write a size such as 64k or 1m")
        else:
            max_body = size
    methods = _globs(spec.methods, (*cloc, "methods"), rep, "method")
    deny_methods = _globs(spec.deny_methods, (*cloc, "deny_methods"), rep, "method") or ()
    if not isinstance(spec, McpSpec):
        return CallFilter("jsonrpc", methods, deny_methods, max_body=max_body,
                          websocket=websocket)
    tools = _globs(spec.tools, (*cloc, "tools"), rep, "tool")
    deny_tools = _globs(spec.deny_tools, (*cloc, "deny_tools"), rep, "tool") or ()
    arguments: list[tuple[str, str]] = []
    for name, pattern in (spec.arguments or {}).items():
        if not name or has_control_chars(name) or has_control_chars(pattern):
            rep((*cloc, "arguments", name), f"argument constraint {name!r}: {pattern!r} is "
                "not a plain name and glob", "write e.g. {repo: 'acme/*'}")
            continue
        arguments.append((name, pattern))
    f = CallFilter(
        "mcp", methods, deny_methods, tools, deny_tools, tuple(arguments),
        _globs(spec.resources, (*cloc, "resources"), rep, "resource"),
        _globs(spec.prompts, (*cloc, "prompts"), rep, "prompt"), max_body, websocket,
        spec.ask_housekeeping)
    if spec.ask_housekeeping and rs.action != "ask":
        rep((*cloc, "ask_housekeeping"), f"`ask_housekeeping` only applies to `action: ask` "
            f"rules, and rule '{rs.name}' is `action: {rs.action}`",
            "write `action: ask` to hold the rule's calls for approval, or remove "
            "`ask_housekeeping`")
    allowed = f.allowed_methods
    calls_tools = allowed is None or any(glob_matches(m, "tools/call") for m in allowed)
    if not calls_tools and (spec.tools is not None or spec.arguments is not None):
        which = "tools" if spec.tools is not None else "arguments"
        rep((*cloc, which), f"`{which}` has no effect: `methods` does not allow tools/call",
            "add tools/call to `methods`, or remove `" + which + "`")
    return f


def compile_test_call(spec: TestSpec, loc: Loc, rep: Report) -> tuple[bool, Call | None]:
    """The call a fixture's request carries: (ok, call)."""
    c: CallTestSpec | None = spec.mcp if spec.mcp is not None else spec.jsonrpc
    if c is None:
        return True, None
    key = "mcp" if spec.mcp is not None else "jsonrpc"
    if spec.mcp is not None and spec.jsonrpc is not None:
        rep((*loc, "jsonrpc"), "a fixture carries `mcp:` or `jsonrpc:`, not both",
            "keep one of them")
        return False, None
    if (c.tool is None) == (c.method is None):
        rep((*loc, key), "give exactly one of `tool` (a tools/call) and `method`",
            "write e.g. `mcp: {tool: delete_repo}` or `jsonrpc: {method: eth_sendTransaction}`")
        return False, None
    if c.tool is not None:
        if c.name is not None:
            rep((*loc, key, "name"), "`name` goes with `method`; a tool call names its tool "
                "in `tool`", "remove `name`")
            return False, None
        args: dict[str, Any] = dict(c.arguments or {})
        return True, tool_call(c.tool, args)
    assert c.method is not None
    if c.arguments is not None:
        rep((*loc, key, "arguments"), "`arguments` are a tool call's", "use `tool`, or remove "
            "`arguments`")
        return False, None
    if c.method == "tools/call":
        rep((*loc, key, "method"), "a tools/call is written `tool: NAME`",
            "write e.g. `mcp: {tool: list_issues}`")
        return False, None
    if c.method in ("prompts/get", "resources/read") and c.name is None:
        rep((*loc, key, "name"), f"{c.method} needs `name` (the prompt name or resource uri)",
            "add e.g. `name: summarise`")
        return False, None
    return True, method_call(c.method, c.name)


def describe(call: Call) -> str:
    """The call in a few words, for explain and check output."""
    shown = [m.shown for m in call.messages]
    return ("batch of " if call.batch else "") + ", ".join(shown)



def describe_filter(f: CallFilter) -> str:
    """A rule's mcp:/jsonrpc: in one line, for the reach diff and report."""
    tools = (f", tools {', '.join(f.tools) if f.tools is not None else 'any'}"
             if f.protocol == "mcp" else "")
    deny = [*f.deny_methods, *(f.deny_tools if f.protocol == "mcp" else ())]
    args = "".join(f", argument {n} {g}" for n, g in f.arguments) if f.protocol == "mcp" else ""
    return (f"{f.protocol}: methods "
            f"{', '.join(f.allowed_methods) if f.allowed_methods is not None else 'any'}"
            f"{tools}{args}{', never ' + ', '.join(deny) if deny else ''}"
            f"{', WebSocket too' if f.websocket else ''}")


def call_fields(d: Decision, call: Call | None) -> dict[str, Any]:
    """What explain adds for the call layer: the call judged, or that one will be."""
    out: dict[str, Any] = {}
    if call is not None:
        out["call"] = describe(call)
        if d.tunnel:
            out["call"] += (" (tunnelled uninspected: the proxy never sees the body, so no "
                            "rule judges the call)")
        elif d.allowed and d.rule is not None and d.rule.call is None:
            out["call"] += (f" (rule '{d.rule.name}' has no mcp:/jsonrpc:, so it does not "
                            "judge calls; deny entries of the identity's other matching rules "
                            "would still refuse it)")
    elif d.allowed and d.call_limit is not None:
        out["call"] = (f"not given: the proxy judges each JSON-RPC call in the body (at most "
                       f"{d.call_limit} bytes) by the rules' mcp:/jsonrpc:; pass --mcp-tool "
                       "NAME or --rpc-method METHOD to judge one")
    f = d.rule.call if d.rule is not None else None
    if f is not None:
        out[f.protocol] = {
            "methods": list(f.allowed_methods) if f.allowed_methods is not None else "any",
            "deny_methods": list(f.deny_methods),
            **({"tools": list(f.tools) if f.tools is not None else "any",
                "deny_tools": list(f.deny_tools),
                "arguments": dict(f.arguments)} if f.protocol == "mcp" else {}),
            "max_body": f.max_body,
            "websocket": websocket_text(f),
        }
    return out


def websocket_text(f: CallFilter) -> str:
    """What the rule does with a protocol upgrade, for explain."""
    if f.websocket:
        return ("websocket: true: a WebSocket may be opened; each message on it is judged as "
                "a body is (a refused call answered with a JSON-RPC error on the WebSocket), "
                "and each answer filtered and scrubbed")
    return ("a WebSocket or any other protocol upgrade is refused (upgrade_refused); "
            "`websocket: true` allows a WebSocket whose messages are judged one by one")
