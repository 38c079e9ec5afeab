"""The `sandgate` command is composed of its families (sandgate/cli/__init__.py FAMILIES)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sandgate import cli


def subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_family_module_is_registered():
    here = Path(cli.__file__).parent
    modules = {p.stem for p in here.glob("*.py")} - {"__init__", "__main__", "common"}
    assert modules == set(cli.FAMILIES)


def test_every_subcommand_has_a_handler():
    for name, sp in subcommands(cli.build_parser()).items():
        defaults = sp._defaults
        assert callable(defaults.get("handler")) or defaults.get("missing_extra"), name


def test_the_help_lists_commands_in_the_order_they_always_had():
    assert list(subcommands(cli.build_parser())) == [
        "run", "check", "lint", "explain", "token", "canary", "ca", "schema", "demo", "diff",
        "suggest", "report", "sandbox", "approvals", "capture", "audit", "agent"]
