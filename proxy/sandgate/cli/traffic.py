"""The traffic tools: `diff` and `suggest` over recorded audit logs, `explain --batch`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sandgate.cli.common import err as _err
from sandgate.cli.common import load_error, resolve_arg
from sandgate.cli.common import resolve as _resolve

if TYPE_CHECKING:
    from sandgate.explain.inputs import ExplainInput


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
    from sandgate.review.traffic import diff, format_diff, read_audit

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
    from sandgate.review.suggest import suggest
    from sandgate.review.traffic import read_audit

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


def parse_batch_line(text: str, sandbox: str | None = None, gateway: bool = False,
                     base: Path | None = None) -> ExplainInput | None:
    """`IDENTITY METHOD URL` (a trailing `# comment` allowed) or a JSON object of
    sandgate.explain.inputs's FIELDS; None for a blank or comment line. `sandbox` and `gateway`
    are the defaults (the command line's) a JSON line may override; `base` is where a
    `body_file` is relative to. ValueError says what is wrong with any other line."""
    from sandgate.explain.inputs import ExplainInput, parse_input
    from sandgate.rpc.jsonrpc import CallError, loads

    body = text.strip()
    if not body or body.startswith("#"):
        return None
    if body.startswith("{"):
        try:
            doc = loads(body.encode("utf-8", "surrogateescape"))  # strict: no duplicate keys
        except CallError as e:
            raise ValueError(str(e).replace("the body", "the line")) from None
        if not isinstance(doc, dict):
            raise ValueError("a JSON line must be an object")
        return parse_input(doc, sandbox, gateway, base)
    parts = body.split()
    if len(parts) > 3 and parts[3].startswith("#"):
        parts = parts[:3]
    if len(parts) != 3:
        raise ValueError(f"expected `IDENTITY METHOD URL` or a JSON object, got {len(parts)} "
                         "field(s)")
    return ExplainInput(parts[0], parts[1], parts[2], sandbox, gateway)


def explain_batch(policy: Any, lines: Iterator[str], resolve: Mapping[str, str],
                  out: TextIO, err: TextIO, source: str, sandbox: str | None = None,
                  gateway: bool = False, base: Path | None = None) -> int:
    """One JSON object per request line (explain's fields plus `line`; a `dns` line: those of
    `explain --dns`); exit 1 if any line is denied (or reported, or refused by the policy
    DNS) or malformed. `sandbox` and `gateway` as for one `explain`, for every line that does
    not say otherwise: every URL is a gateway path with `gateway`."""
    from sandgate.explain.inputs import explain_input

    failed = False
    for n, raw in enumerate(lines, 1):
        try:
            line = parse_batch_line(raw, sandbox, gateway, base)
            if line is None:
                continue
            doc, allowed = explain_input(policy, line, resolve)
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
