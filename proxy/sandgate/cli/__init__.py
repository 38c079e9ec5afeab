"""The `sandgate` command: one module per subcommand family, composed here.

    common.py       what several families share: --confdir, --resolve, --format, errors
    run.py          run (the proxy; its flags and their checks)
    policy.py       check, lint, explain
    credentials.py  token issue, canary, ca
    schema.py       schema (the policy format as JSON Schema)
    demo.py         demo (sandgate.demo: the offline tour)
    traffic.py      diff, suggest, explain --batch (recorded traffic; diff without traffic
                    is the reach diff of reach.py)
    reach.py        report (what each identity reaches), the reach diff
    approvals.py    approvals list|show|approve|deny|watch (the admin API's approvals)
    sandbox.py      sandbox (sandgate.sandbox.cli; needs the docker extra)
    audit.py        audit verify (the hash chain of audit files), audit public-key
    agent.py        agent run (pattern 1 without a hook: sandgate.identity.agents)

Adding a family: a module with `register(sub)` that adds its subparsers, each with
`set_defaults(handler=...)` (a function of the parsed arguments returning the exit code), and
its name as one line in `FAMILIES` (the order is the order `sandgate --help` lists them).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from sandgate import __version__
from sandgate.cli.common import DEFAULT_CONFDIR, err
from sandgate.cli.run import limits_config

DESCRIPTION = "`sandgate`: run the proxy, check and explain policies, issue tokens, print the CA."

# The subcommand families, in the order `sandgate --help` lists their commands.
FAMILIES = (
    "run",
    "policy",
    "credentials",
    "schema",
    "demo",
    "traffic",
    "reach",
    "sandbox",
    "approvals",
    "capture",
    "audit",
    "agent",
)

__all__ = ["DEFAULT_CONFDIR", "FAMILIES", "build_parser", "limits_config", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandgate", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"sandgate {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name in FAMILIES:
        importlib.import_module(f"sandgate.cli.{name}").register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `sandgate ca | head`: the reader is done, so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # `run --workers N` starts its workers with the same arguments
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if getattr(args, "missing_extra", None):
        return err(args.missing_extra)
    return int(args.handler(args))
