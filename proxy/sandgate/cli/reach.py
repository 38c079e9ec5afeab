"""The review subcommands of `sandgate`: `report DIR`, and the reach diff (`diff OLD NEW`
without --traffic, registered with the traffic family's `diff`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sandgate.cli.common import load_error


def register(sub: Any) -> None:
    r = sub.add_parser("report", help="per identity, what it can reach and with which secrets "
                       "(markdown, or one self-contained HTML page)")
    r.add_argument("policies", type=Path, metavar="DIR", nargs="?", default=None)
    r.add_argument("--format", choices=("markdown", "html", "json"), default="markdown")
    r.add_argument("--spend", type=Path, action="append", default=[], metavar="AUDIT",
                   help="instead of a policy report: LLM spend totals (calls, refusals, "
                   "tokens, cost) from these audit files (docs/spend.md); repeatable")
    r.add_argument("--by", default="identity,model", metavar="FIELDS",
                   help="with --spend: group by these, comma-separated, of identity, sandbox, "
                   "model, budget, api (default identity,model)")
    r.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="write here (default: stdout)")
    r.add_argument("--link-base", default=None, metavar="URL",
                   help="html: link entries to URL/FILE#LLINE (e.g. the repository's blob URL "
                   "of the policy directory) instead of the local file")
    r.set_defaults(handler=cmd_report)


def _load(path: Path) -> Any:
    from sandgate.policy.loader import PolicyError, load_policy_dir

    try:
        return load_policy_dir(path)
    except PolicyError as e:
        load_error(path, e)
        return None


def cmd_reach_diff(args: argparse.Namespace) -> int:
    """Exit 0: no change of reach (or only narrowing); 1: reach widened (or, with
    --fail-on-narrowing, any change); 2: a policy does not load."""
    from sandgate.review import reach_diff as R

    old, new = _load(args.old), _load(args.new)
    if old is None or new is None:
        return 2
    d = R.reach_diff(old, new, str(args.old), str(args.new))
    fmt = {"json": R.format_json, "markdown": R.format_markdown}.get(args.format, R.format_text)
    print(fmt(d))
    return R.exit_status(d, args.fail_on_narrowing)


def _spend_report(args: argparse.Namespace) -> int:
    from sandgate.llm import spend_report as S

    by = [b.strip() for b in args.by.split(",") if b.strip()]
    bad = [b for b in by if b not in S.GROUPS]
    if bad or not by or args.format == "html":
        print(f"sandgate: --by takes {', '.join(S.GROUPS)}, and --spend prints markdown or "
              "json", file=sys.stderr)
        return 2
    try:
        rows = S.totals(S.read_events(args.spend), by)
    except OSError as e:
        print(f"sandgate: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    text = (S.format_json if args.format == "json" else S.format_markdown)(rows, by)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from sandgate.review import report as R

    if args.spend:
        return _spend_report(args)
    if args.policies is None:
        print("sandgate: report needs a policy directory (or --spend AUDIT)", file=sys.stderr)
        return 2
    policy = _load(args.policies)
    if policy is None:
        return 2
    rep = R.build_report(policy, str(args.policies))
    if args.format == "html":
        text = R.format_html(rep, args.link_base)
    else:
        text = (R.format_json if args.format == "json" else R.format_markdown)(rep)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        args.out.write_text(text, encoding="utf-8")
    except OSError as e:
        print(f"sandgate: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0
