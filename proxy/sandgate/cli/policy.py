"""The policy tools: `check` (load, prove, run fixtures), `lint`, `explain` (one request)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandgate.cli.common import err as _err
from sandgate.cli.common import format_arg, resolve_arg
from sandgate.cli.common import resolve as _resolve
from sandgate.rpc.call_cli import add_call_args, call_from_args

if TYPE_CHECKING:
    from sandgate.policy.fixtures import FixtureResult


def register(sub: Any) -> None:
    check = sub.add_parser("check", help="validate policies and run their tests: fixtures")
    check.add_argument("policies", type=Path)
    resolve_arg(check)
    format_arg(check)
    check.set_defaults(handler=cmd_check)

    lint = sub.add_parser("lint", help="warn about policies that load but may not do what "
                          "they say")
    lint.add_argument("policies", type=Path)
    lint.add_argument("--strict", action="store_true", help="exit 1 on any warning")
    lint.add_argument("--mcp-tools", action="append", metavar="[HOST=]FILE",
                      help="a recorded tools/list answer: warn on mcp: tool globs matching "
                      "none of its tools (sandgate.review.lint_calls); repeatable")
    format_arg(lint)
    lint.set_defaults(handler=cmd_lint)

    explain = sub.add_parser("explain", help="show the decision for one request")
    explain.add_argument("--policies", type=Path, default=Path("policies"))
    explain.add_argument("--identity", help="required unless --batch")
    explain.add_argument("--batch", type=Path, default=None, metavar="FILE",
                         help="one input a line, `IDENTITY METHOD URL` or a JSON object "
                         "(sandbox, gateway, body, body_file, headers, mcp_tool, mcp_args, "
                         "rpc_method, mcp_resource, websocket, dns, type: docs/traffic.md); "
                         "# comments; - for stdin: one JSON object a line out")
    resolve_arg(explain)
    explain.add_argument("--gateway", action="store_true",
                         help="URL is a gateway path (e.g. /anthropic/v1/messages, what follows "
                         "the gateway's HOST:PORT): judged as the gateway listener judges it")
    explain.add_argument("--sandbox", default=None, metavar="ID",
                         help="the caller's sandbox id (as in its token or Docker label); "
                         "without it, a rule needing a per-sandbox secret is sandbox_required")
    add_call_args(explain)  # --mcp-tool, --mcp-args, --rpc-method, --websocket (call_cli)
    explain.add_argument("--model", default=None, metavar="NAME",
                         help="the request is an LLM call asking for this model (judged by the "
                         "rules' llm:)")
    explain.add_argument("--max-tokens", type=int, default=None, metavar="N",
                         help="with --model: the output cap the call asks for")
    explain.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'",
                         help="a header the request carries (repeatable), e.g. "
                         "'x-amz-copy-source: /bucket/key': a rule that signs judges those a "
                         "SigV4 signature covers")
    explain.add_argument("--body-file", type=Path, default=None, metavar="FILE",
                         help="the request body as sent (- for stdin): read as the proxy's call "
                         "stage reads it where a rule with mcp:/jsonrpc: matches (a JSON-RPC "
                         "message or batch; instead of --mcp-tool/--rpc-method)")
    explain.add_argument("--dns", default=None, metavar="NAME",
                         help="instead of a request: what the policy DNS (run --dns) answers "
                         "the identity for NAME (resolve or refuse)")
    explain.add_argument("--type", dest="qtype", default="A", metavar="TYPE",
                         help="with --dns: the query type (default A), e.g. AAAA, TXT")
    explain.add_argument("method", nargs="?", help="an HTTP method, or CONNECT for a tunnel")
    explain.add_argument("url", nargs="?",
                         help="an absolute http(s) URL, or host:port after CONNECT")
    explain.set_defaults(handler=cmd_explain)


def cmd_check(args: argparse.Namespace) -> int:
    from sandgate.policy.fixtures import run_policy_tests
    from sandgate.policy.loader import PolicyError, discover_policy_files, load_policy_dir
    from sandgate.review.lint import findings_from_error, github_annotation

    try:
        resolve = _resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))
    fmt = args.format
    read, skipped = discover_policy_files(args.policies)
    doc: dict[str, object] = {
        "files_read": [str(path) for path in read],
        "files_skipped": [{"file": name, "reason": why} for name, why in skipped],
    }
    if fmt == "text":
        for path in read:
            print(f"read {path}")
        for name, why in skipped:
            print(f"skipped {name}: {why}")
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        problems = findings_from_error(e)
        if fmt == "json":
            doc.update(problems=[p.as_dict() for p in problems], fixtures=[], passed=0,
                       failed=0)
            print(json.dumps(doc, indent=2))
        elif fmt == "github":
            for p in problems:
                print(github_annotation("error", p.file, p.line, p.text))
        else:
            print(f"sandgate: {len(e.problems)} problem(s) in {args.policies}:", file=sys.stderr)
            print(str(e), file=sys.stderr)
        return 1
    from sandgate.review.proofs import ProofError, prove

    try:
        proofs = prove(policy)
    except ProofError as e:  # the prover and decide() disagree: a bug, never a verdict
        return _err(f"internal error in the policy prover: {e}")
    for pr in proofs:
        print(pr)
    from sandgate.review.hygiene import expiries

    expired = [x for x in expiries(policy) if x.expired]
    for ex in expired:
        print(github_annotation("error", ex.rule.source.file, ex.rule.source.line, ex.message)
              if fmt == "github" else f"expired: {ex}",
              file=sys.stderr if fmt == "json" else sys.stdout)
    from sandgate.review.prerequisites import unreachable

    # brokered credentials whose token endpoint the identity cannot reach: 503 at run time
    unmet = unreachable(policy)
    for u in unmet:
        print(github_annotation("error", u.rule.source.file, u.rule.source.line,
                                f"{u.message}. Fix: {u.fix}")
              if fmt == "github" else f"unreachable token endpoint: {u}",
              file=sys.stderr if fmt == "json" else sys.stdout)
    results = run_policy_tests(policy, resolve)
    failed = [r for r in results if not r.passed]
    summary = (f"{len(policy.files)} file(s), {len(policy.identities)} identities, "
               f"{len(policy.secrets)} secrets; {len(results) - len(failed)} passed, "
               f"{len(failed)} failed")
    if fmt == "json":
        doc["problems"] = []
        doc["fixtures"] = [{
            "file": r.test.source.file, "line": r.test.source.line,
            "identity": r.test.identity, "request": f"{r.test.method} {r.test.url}",
            "expect": r.test.expect, "got": _got(r),
            "rule": r.decision.rule_name,
            "code": str(r.decision.code) if r.decision.code else None,
            "inject": sorted(r.secrets), "passthrough": r.passthrough, "address": r.address,
            "passed": r.passed, "message": r.message,
        } for r in results]
        doc["passed"] = len(results) - len(failed)
        doc["failed"] = len(failed)
        doc["prerequisites"] = [{
            "file": u.rule.source.file, "line": u.rule.source.line, "identity": u.identity,
            "rule": u.rule.name, "secret": u.secret, "token_endpoint": u.url,
            "message": u.message, "fix": u.fix} for u in unmet]
        print(json.dumps(doc, indent=2))
        return 1 if failed or expired or unmet else 0
    for r in results:
        if fmt == "github":
            if not r.passed:
                print(github_annotation(
                    "error", r.test.source.file, r.test.source.line,
                    f"{r.test.identity} {r.test.method} {r.test.url}: {r.message}"))
            continue
        mark = "ok  " if r.passed else "FAIL"
        addr = f" [{r.address}]" if r.address and r.address.startswith(("dials", "refused")) \
            else ""
        print(f"{mark} {r.test.source}: {r.test.identity} {r.test.method} {r.test.url}"
              f"{_call(r)}{' ' + (r.test.qtype or '') if r.test.dns else ''} -> {_got(r)}"
              f" ({r.decision.rule_name or r.decision.code}){addr}"
              f"{'' if r.passed else ': ' + r.message}")
    report = sorted(n for n, i in policy.identities.items() if i.mode == "report")
    if report:
        print(f"report mode (policy refusals forwarded without credentials and audited, not "
              f"enforced): {', '.join(report)}")
    print(summary)
    return 1 if failed or expired or unmet or not all(pr.ok for pr in proofs) else 0


def _explain_name(args: argparse.Namespace) -> int:
    """`explain --dns NAME --identity X [--type T]`: the policy DNS's decision."""
    from sandgate.explain.answer import explain_name
    from sandgate.policy.dnstypes import query_type
    from sandgate.policy.loader import PolicyError, load_policy_dir

    if not args.identity or args.method or args.url:
        return _err("explain --dns NAME needs --identity NAME and no METHOD URL")
    try:
        qtype = query_type(args.qtype)
    except ValueError as e:
        return _err(f"--type: {e}")
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    out, resolves = explain_name(policy, args.identity, args.dns, qtype)
    print(json.dumps(out, indent=2))
    return 0 if resolves else 1


def _got(r: FixtureResult) -> str:
    """What a fixture got, in its own words (resolve/refuse for a `dns` fixture)."""
    if r.test.dns:
        return "resolve" if r.decision.allowed else "refuse"
    return r.decision.outcome


def _call(r: FixtureResult) -> str:
    """A fixture's JSON-RPC call (mcp:/jsonrpc:), WebSocket and headers, as check prints them
    after the request: " [WebSocket: method eth_call] [x-amz-target: ...]"."""
    from sandgate.policy.call_rules import describe

    parts = [*(["WebSocket"] if r.test.websocket else []),
             *([describe(r.test.call)] if r.test.call is not None else [])]
    call = f" [{': '.join(parts)}]" if parts else ""
    return call + "".join(f" [{n}: {v}]" for n, v in r.test.headers)


def cmd_lint(args: argparse.Namespace) -> int:
    from sandgate.policy.loader import PolicyError
    from sandgate.review.lint import findings_from_error, format_findings, lint_dir

    try:
        findings = lint_dir(args.policies, args.mcp_tools)
    except PolicyError as e:
        errors = findings_from_error(e)
        print(format_findings(errors, args.format))
        if args.format == "text":
            print(f"sandgate: {len(errors)} load error(s) in {args.policies}", file=sys.stderr)
        return 1
    except ValueError as e:  # an unreadable --mcp-tools file
        return _err(str(e))
    text = format_findings(findings, args.format)
    if text:
        print(text)
    if args.format == "text":
        print(f"sandgate: {len(findings)} warning(s) in {args.policies}", file=sys.stderr)
    return 1 if findings and args.strict else 0


def cmd_explain(args: argparse.Namespace) -> int:
    from sandgate.explain.answer import explain_request
    from sandgate.llm.llmcall import stated_call
    from sandgate.policy.loader import PolicyError, load_policy_dir
    from sandgate.request import parse_header_line

    try:
        resolve = _resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))
    if args.batch is not None:
        from sandgate.cli.traffic import cmd_explain_batch

        return cmd_explain_batch(args, resolve)
    if args.dns is not None:
        return _explain_name(args)
    if not args.identity or not args.method or not args.url:
        return _err("explain needs --identity NAME METHOD URL (or --batch FILE, or --dns "
                    "NAME)")
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    body: bytes | None = None
    if args.body_file is not None:
        try:
            body = sys.stdin.buffer.read() if str(args.body_file) == "-" else \
                args.body_file.read_bytes()
        except OSError as e:
            return _err(f"--body-file {args.body_file}: {e.strerror or e}")
    try:
        headers = [parse_header_line(h) for h in args.header]
        out, allowed = explain_request(policy, args.identity, args.method, args.url, resolve,
                                       args.sandbox, args.gateway, call_from_args(args),
                                       args.websocket, headers, body,
                                       stated_call(args.model, args.max_tokens))
    except ValueError as e:
        return _err(f"bad request: {e}")
    print(json.dumps(out, indent=2))
    return 0 if allowed else 1
