"""The generated reference pages (docs/reference/) are what the code says today.

docs/reference/policy.md is rendered from `sandgate schema`, docs/reference/cli.md from the
`sandgate` argument parsers, by scripts/render-docs-reference.py; this fails when a committed
page differs from what the script writes now, so the reference cannot drift from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "scripts/render-docs-reference.py"


def test_reference_pages_are_current() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr


def test_reference_pages_cover_every_key_and_subcommand() -> None:
    """Not vacuous: every schema definition and every subcommand has its section."""
    import json

    schema = json.loads(subprocess.run([sys.executable, "-m", "sandgate.cli", "schema"],
                                       capture_output=True, text=True, check=True,
                                       cwd=REPO).stdout)
    policy = (REPO / "docs/reference/policy.md").read_text()
    for name in schema["$defs"]:
        assert f"\n## {name.removesuffix('Spec')}\n" in policy, name
    for key in schema["properties"]:
        assert f"| `{key}` |" in policy, key
    cli = (REPO / "docs/reference/cli.md").read_text()
    for command in ("run", "check", "lint", "explain", "token issue", "ca", "schema", "diff",
                    "suggest", "canary"):
        assert f"## `sandgate {command}`" in cli, command


def test_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    """--check really compares: a copy of the repository's page with one edit is stale."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_docs_reference", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = tmp_path / "policy.md"
    stale.write_text((REPO / "docs/reference/policy.md").read_text() + "edited by hand\n")
    mod.POLICY_PAGE = stale
    assert mod.main(["--check"]) == 1
