"""The traffic tools: `diff` and `suggest` over recorded audit logs, `explain --batch`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sandgate.cli.common import err as _err
from sandgate.cli.common import load_error, resolve_arg
from sandgate.cli.common import resolve as _resolve

if TYPE_CHECKING:
    from sandgate.jsonrpc import Call


def register(sub: Any) -> None:
    d = sub.add_parser("diff", help="what each identity can reach in NEW_DIR that it cannot in "
                       "OLD_DIR and the reverse (exit 1 when reach widens); with --traffic, "
                       "replay recorded traffic and list every decision that changes")
    d.add_argument("old", type=Path, metavar="OLD_DIR")
    d.add_argument("new", type=Path, metavar="NEW_DIR")
    d.add_argument("--traffic", type=Path, default=None, metavar="AUDIT.jsonl",
                   help="an audit log (JSON lines, as `sandgate run --audit` writes); - for "
                   "stdin")
    d.add_argument("--format", choices=("text", "json", "markdown"), default="text",
                   help="markdown: a pull-request comment (reach diff only)")
    d.add_argument("--fail-on-narrowing", action="store_true",
                   help="reach diff: exit 1 on any change of reach, not only on widening")
    resolve_arg(d)
    d.set_defaults(handler=cmd_diff)

    s = sub.add_parser("suggest", help="write a least-privilege policy from recorded traffic")
    s.add_argument("--from", dest="source", type=Path, required=True, metavar="AUDIT.jsonl",
                   help="an audit log (JSON lines); - for stdin")
    s.add_argument("--identity", action="append", default=None, metavar="NAME",
                   help="only this identity (repeatable; default: every identity recorded)")
    s.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="write the policy here (default: stdout)")
    s.add_argument("--collapse-deep", action="store_true",
                   help="collapse 3+ distinct paths under one first segment to "
                   "/<common prefix>/** (off: `**` is never written)")
    s.add_argument("--include-refused", action="store_true",
                   help="also grant requests the recorded policy refused (no_rule, "
                   "denied_by_rule); default: only what went out (allow, report)")
    s.set_defaults(handler=cmd_suggest)


def _open(path: Path) -> Iterator[str]:
    if str(path) == "-":
        yield from sys.stdin
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from f


def cmd_diff(args: argparse.Namespace) -> int:
    from sandgate.policy.loader import PolicyError, load_policy_dir
    from sandgate.policy.traffic import diff, format_diff, read_audit

    if args.traffic is None:
        from sandgate.cli.reach import cmd_reach_diff

        return cmd_reach_diff(args)
    if args.format == "markdown":
        return _err("--format markdown is for the reach diff (without --traffic)")
    try:
        resolve = _resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))

    policies = []
    for d in (args.old, args.new):
        try:
            policies.append(load_policy_dir(d))
        except PolicyError as e:
            load_error(d, e)
            return 2
    try:
        traffic = read_audit(_open(args.traffic), str(args.traffic))
    except OSError as e:
        return _err(f"--traffic {args.traffic}: {e.strerror or e}")
    res = diff(policies[0], policies[1], traffic, resolve)
    if args.format == "json":
        doc = {"old": str(args.old), "new": str(args.new), **res.as_dict()}
        print(json.dumps(doc, indent=2))
    else:
        print(format_diff(res, str(args.old), str(args.new)))
    return 1 if res.changes else 0


def cmd_suggest(args: argparse.Namespace) -> int:
    from sandgate.policy.suggest import suggest
    from sandgate.policy.traffic import read_audit

    try:
        traffic = read_audit(_open(args.source), str(args.source))
    except OSError as e:
        return _err(f"--from {args.source}: {e.strerror or e}")
    s = suggest(traffic, frozenset(args.identity) if args.identity else None,
                collapse_deep=args.collapse_deep, include_refused=args.include_refused)
    text = s.yaml(Path(str(args.source)).name)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            args.out.write_text(text, encoding="utf-8")
        except OSError as e:
            return _err(f"--out {args.out}: {e.strerror or e}")
    rules = sum(len(r) for r in s.rules.values())
    print(f"sandgate: {s.used} recorded request(s) -> {len(s.rules)} identities, {rules} "
          f"rule(s), {len(s.tests)} fixture(s); {len(s.notes)} event(s) not granted"
          + (" (listed at the end of the file)" if s.notes else ""), file=sys.stderr)
    if not s.rules:
        print("sandgate: nothing to grant: no allowed or reported request was recorded"
              + (" for the identities given" if args.identity else ""), file=sys.stderr)
        return 1
    return 0


@dataclass(frozen=True)
class BatchLine:
    """One `explain --batch` input: a request (with what the proxy judges besides its head:
    the caller's sandbox, the way in, the body or the call it carries, the MCP headers) or,
    with `dns`, a policy DNS query."""

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


# The fields of a JSON batch line (docs/traffic.md); any other is refused, so that a misspelt
# field is never silently dropped from what is judged.
BATCH_FIELDS = frozenset({"identity", "method", "url", "sandbox", "gateway", "body",
                          "body_file", "headers", "mcp_tool", "mcp_args", "rpc_method",
                          "mcp_resource", "websocket", "dns", "type"})


def parse_batch_line(text: str, sandbox: str | None = None, gateway: bool = False,
                     base: Path | None = None) -> BatchLine | None:
    """`IDENTITY METHOD URL` (a trailing `# comment` allowed) or a JSON object of
    BATCH_FIELDS; None for a blank or comment line. `sandbox` and `gateway` are the defaults
    (the command line's) a JSON line may override; `base` is where a `body_file` is relative
    to. ValueError says what is wrong with any other line."""
    body = text.strip()
    if not body or body.startswith("#"):
        return None
    if body.startswith("{"):
        return _json_line(body, sandbox, gateway, base)
    parts = body.split()
    if len(parts) > 3 and parts[3].startswith("#"):
        parts = parts[:3]
    if len(parts) != 3:
        raise ValueError(f"expected `IDENTITY METHOD URL` or a JSON object, got {len(parts)} "
                         "field(s)")
    return BatchLine(parts[0], parts[1], parts[2], sandbox, gateway)


def _json_line(text: str, sandbox: str | None, gateway: bool, base: Path | None
               ) -> BatchLine:
    from sandgate.call_cli import call_from_values
    from sandgate.jsonrpc import CallError, loads

    try:
        doc = loads(text.encode("utf-8", "surrogateescape"))  # strict: no duplicate keys
    except CallError as e:
        raise ValueError(str(e).replace("the body", "the line")) from None
    if not isinstance(doc, dict):
        raise ValueError("a JSON line must be an object")
    unknown = sorted(set(doc) - BATCH_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; a line has "
                         f"{', '.join(sorted(BATCH_FIELDS))}")
    identity = _text(doc, "identity")
    if identity is None:
        raise ValueError("the line needs \"identity\"")
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
            raise ValueError(f"a \"dns\" line is a name query: no {', '.join(extra)}")
        return BatchLine(identity, sandbox=sandbox, dns=dns, qtype=_text(doc, "type") or "A")
    if "type" in doc:
        raise ValueError("\"type\" goes with \"dns\"")
    method, url = _text(doc, "method"), _text(doc, "url")
    if method is None or url is None:
        raise ValueError("the line needs \"method\" and \"url\" (or \"dns\")")
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
    return BatchLine(identity, method, url, sandbox, gateway, call, raw,
                     _headers(doc.get("headers")), websocket)


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


def explain_batch(policy: Any, lines: Iterator[str], resolve: Mapping[str, str],
                  out: TextIO, err: TextIO, source: str, sandbox: str | None = None,
                  gateway: bool = False, base: Path | None = None) -> int:
    """One JSON object per request line (explain's fields plus `line`; a `dns` line: those of
    `explain --dns`); exit 1 if any line is denied (or reported, or refused by the policy
    DNS) or malformed. `sandbox` and `gateway` as for one `explain`, for every line that does
    not say otherwise: every URL is a gateway path with `gateway`."""
    from sandgate.explain import explain_name, explain_request
    from sandgate.policy.dnstypes import query_type

    failed = False
    for n, raw in enumerate(lines, 1):
        try:
            line = parse_batch_line(raw, sandbox, gateway, base)
            if line is None:
                continue
            if line.dns is not None:
                doc, allowed = explain_name(policy, line.identity, line.dns,
                                            query_type(line.qtype))
            else:
                doc, allowed = explain_request(policy, line.identity, line.method, line.url,
                                               resolve, line.sandbox, line.gateway, line.call,
                                               line.websocket, line.headers, line.body)
        except ValueError as e:
            failed = True
            msg = f"malformed: {e}"
            print(f"sandgate: {source}:{n}: {msg}", file=err)
            out.write(json.dumps({"line": n, "input": raw.rstrip("\r\n"), "error": msg}) + "\n")
            continue
        failed = failed or not allowed
        out.write(json.dumps({"line": n, **doc}) + "\n")
    return 1 if failed else 0


def cmd_explain_batch(args: argparse.Namespace, resolve: Mapping[str, str]) -> int:
    from sandgate.policy.loader import PolicyError, load_policy_dir

    if args.identity or args.method or args.url:
        return _err("--batch reads each request (IDENTITY METHOD URL, or a JSON object) from "
                    "the file; give no --identity, method or URL with it")
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        return explain_batch(policy, _open(args.batch), resolve, sys.stdout, sys.stderr,
                             str(args.batch), args.sandbox, args.gateway,
                             None if str(args.batch) == "-" else args.batch.parent)
    except OSError as e:
        return _err(f"--batch {args.batch}: {e.strerror or e}")
