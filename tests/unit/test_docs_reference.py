"""The generated reference pages (docs/reference/) are what the code says today.

docs/reference/policy.md is rendered from `sandgate schema`, docs/reference/cli.md from the
`sandgate` argument parsers, docs/reference/source-tree.md from the module docstrings under
proxy/sandgate, by scripts/render-docs-reference.py; this fails when a committed page differs
from what the script writes now, so the reference cannot drift from the code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_docs_reference", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", ["POLICY_PAGE", "SOURCE_PAGE"])
def test_check_fails_on_a_stale_page(tmp_path: Path, page: str) -> None:
    """--check really compares: a copy of the repository's page with one edit is stale."""
    mod = _script()
    stale = tmp_path / "page.md"
    stale.write_text(getattr(mod, page).read_text() + "edited by hand\n")
    setattr(mod, page, stale)
    assert mod.main(["--check"]) == 1


def test_the_source_tree_map_has_every_package_and_module() -> None:
    """Not vacuous: each module has its row and each package its section, in the committed map."""
    tree = (REPO / "docs/reference/source-tree.md").read_text()
    source = REPO / "proxy/sandgate"
    for path in source.rglob("*.py"):
        dotted = ".".join(("sandgate", *path.relative_to(source).with_suffix("").parts))
        if path.name == "__init__.py":
            assert f"\n## `{dotted.removesuffix('.__init__')}`\n" in tree, path
        else:
            assert f"\n| `{dotted}` | " in tree, path


def test_a_module_moved_or_without_a_docstring_is_caught(tmp_path: Path) -> None:
    """The map follows the tree: a moved module changes it, and one without a docstring stops
    the script with its path and what to do."""
    mod = _script()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "__init__.py").write_text('"""The top."""\n')
    (tmp_path / "pkg/__init__.py").write_text('"""A package.\n\nMore."""\n')
    (tmp_path / "pkg/mod.py").write_text('"""What it holds,\nwrapped.\n\nDetails."""\n')
    before = mod.render_source_tree(tmp_path)
    assert "## `sandgate.pkg`\n\nA package.\n" in before
    assert "| `sandgate.pkg.mod` | What it holds, wrapped. |" in before
    (tmp_path / "pkg/mod.py").rename(tmp_path / "mod.py")
    assert "| `sandgate.mod` | What it holds, wrapped. |" in mod.render_source_tree(tmp_path)
    (tmp_path / "bare.py").write_text("X = 1\n")
    with pytest.raises(mod.MissingDocstring, match=r"bare\.py has no module docstring"):
        mod.render_source_tree(tmp_path)
