"""Unit test files are named after the module they test, and the exceptions only shrink.

The scheme and its allowlist (tests/unit/filename_allowlist.txt) are in
scripts/filename-allowlist.py and docs/development.md ("Test file names"). This fails on a test
file named after no module, on a module with no test file, and on an allowlist entry that
matches now (stale: remove it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).parents[2]
SCRIPT = REPO / "scripts/filename-allowlist.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("filename_allowlist", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FA = _script()


def test_every_test_file_and_module_matches_or_is_allowlisted() -> None:
    new, stale = FA.differences(FA.mismatches(), FA.read_allowlist())
    assert not new, (
        "named after no module / without a test file (name the test file test_<module>.py, "
        "docs/development.md \"Test file names\"; only if that cannot be, add the path to "
        f"tests/unit/filename_allowlist.txt): {new}")
    assert not stale, (
        "these allowlist entries match now: remove them from tests/unit/filename_allowlist.txt "
        f"(or run scripts/filename-allowlist.py --write): {stale}")


def test_the_allowlist_is_sorted_and_has_no_duplicates() -> None:
    entries = FA.read_allowlist()
    assert entries == sorted(set(entries))
    assert all(e.startswith(("tests/unit/test_", "proxy/sandgate/")) for e in entries)


def _tree(tmp_path: Path, modules: list[str], tests: list[str]) -> tuple[Path, Path]:
    source, unit = tmp_path / "proxy/sandgate", tmp_path / "tests/unit"
    for m in modules:
        (source / m).parent.mkdir(parents=True, exist_ok=True)
        (source / m).write_text('"""x."""\n')
    unit.mkdir(parents=True)
    for t in tests:
        (unit / t).write_text("")
    return source, unit


def test_the_scheme_flat_by_dotted_path_or_its_tail(tmp_path: Path) -> None:
    source, unit = _tree(
        tmp_path,
        ["__init__.py", "policy/__init__.py", "policy/loader.py", "policy/lint_mcp.py",
         "scrub.py", "state/leases.py", "secrets/leases.py", "untested.py"],
        ["test_policy_loader.py", "test_lint_mcp.py", "test_scrub.py", "test_state_leases.py",
         "test_leases.py", "test_policy.py", "test_mcp.py", "test_orphan.py", "conftest.py"])
    found = FA.mismatches(source, unit, tmp_path)
    assert found == ["proxy/sandgate/untested.py", "tests/unit/test_orphan.py"]
    # test_leases.py matches both leases modules (a tail), test_mcp.py the tail of lint_mcp;
    # packages need no test file but may have one (test_policy.py)


def test_a_new_mismatch_and_a_stale_entry_are_both_reported(tmp_path: Path) -> None:
    found = ["proxy/sandgate/untested.py", "tests/unit/test_orphan.py"]
    allowed = ["proxy/sandgate/untested.py", "tests/unit/test_renamed_since.py"]
    assert FA.differences(found, allowed) == (["tests/unit/test_orphan.py"],
                                              ["tests/unit/test_renamed_since.py"])
    path = tmp_path / "allow.txt"
    path.write_text(FA.render_allowlist(found))
    assert FA.read_allowlist(path) == found  # the header is comments only


def test_suggestions_name_the_module_a_moved_test_now_matches(tmp_path: Path) -> None:
    source, unit = _tree(tmp_path, ["review/lint.py", "policy/loader.py", "a/x_y.py", "b/y.py"],
                         ["test_policy_lint.py", "test_policy_loader.py", "test_old_y.py",
                          "test_nothing_at_all.py"])
    assert FA.suggestions(source, unit) == {
        "test_policy_lint.py": ["test_review_lint.py"],
        "test_old_y.py": ["test_a_x_y.py", "test_b_y.py"]}
