"""What several subcommand families share: their common flags, the error line, --resolve."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandgate.policy.loader import PolicyError

DEFAULT_CONFDIR = Path(os.environ.get("SANDGATE_CONFDIR", "~/.sandgate")).expanduser()


def confdir_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--confdir", type=Path, default=DEFAULT_CONFDIR,
                    help="holds the CA and the token signing key (default %(default)s)")


def resolve_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                    help="judge HOST as dialling IP, as `sandgate run --resolve` does, so "
                    "the address step (private_cidrs) is checked; IP literals always are")


def format_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--format", choices=("text", "json", "github"), default="text",
                    help="text (default), json, or GitHub Actions annotations")


def load_error(path: object, e: PolicyError, prefix: str = "") -> None:
    """A policy that does not load: the count, then every located problem, on stderr."""
    print(f"sandgate: {prefix}{len(e.problems)} problem(s) in {path}:", file=sys.stderr)
    print(str(e), file=sys.stderr)


def err(msg: str) -> int:
    """A usage error: one line on stderr, exit 2."""
    print(f"sandgate: {msg}", file=sys.stderr)
    return 2


def resolve(specs: Sequence[str]) -> dict[str, str]:
    """--resolve HOST=IP, parsed as `sandgate run` parses it (ValueError says what is wrong)."""
    from sandgate.runner.config import parse_resolve

    return parse_resolve(specs)
