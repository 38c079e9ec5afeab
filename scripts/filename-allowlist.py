#!/usr/bin/env python3
"""Which unit test files are named after no module, and which modules have no test file.

    scripts/filename-allowlist.py            # print both lists (what differs from the allowlist)
    scripts/filename-allowlist.py --write    # rewrite tests/unit/filename_allowlist.txt
    scripts/filename-allowlist.py --check    # exit 1 if the tree and the allowlist differ
    scripts/filename-allowlist.py --suggest  # a new name for test files named after no module

The scheme (docs/development.md, "Test file names"): unit tests sit flat in tests/unit, and
`tests/unit/test_NAME.py` tests the module whose dotted path below `sandgate`, with the dots
written as underscores, is NAME or ends in `_NAME`: proxy/sandgate/policy/loader.py is tested by
test_policy_loader.py or test_loader.py. A package (its `__init__.py`) is named by its path the
same way. Every module but a package's `__init__.py` should have a test file of its own.

What does not follow the scheme yet is listed in tests/unit/filename_allowlist.txt, and
tests/unit/test_filename_matching.py fails on any difference: a new test file named after no
module, a new module without a test file, and an entry that now matches (remove it: the list may
only shrink). `--write` rewrites the list from the tree; after moving modules, run it once and
read the diff: it should only lose lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "proxy/sandgate"
TESTS = REPO / "tests/unit"
ALLOWLIST = TESTS / "filename_allowlist.txt"
HEADER = """\
# Unit test files named after no module (tests/unit/...) and modules with no unit test file
# (proxy/sandgate/...), as scripts/filename-allowlist.py finds them. This list may only shrink:
# name a new test file after the module it tests (docs/development.md, "Test file names") and
# remove the lines that now match (tests/unit/test_filename_matching.py fails until you do).
# Rewrite it with: scripts/filename-allowlist.py --write
"""


def module_names(source: Path) -> dict[str, Path]:
    """Each module's name in the scheme (`policy_loader`), and its file."""
    names: dict[str, Path] = {}
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            names["_".join(parts)] = path
    return names


def test_names(tests: Path) -> dict[str, Path]:
    """Each test file's NAME (`test_NAME.py`), and its file."""
    return {p.stem.removeprefix("test_"): p for p in sorted(tests.glob("test_*.py"))}


def matches(test: str, module: str) -> bool:
    """test_NAME.py tests the module whose name is NAME or ends in `_NAME`."""
    return module == test or module.endswith("_" + test)


def mismatches(source: Path = SOURCE, tests: Path = TESTS, repo: Path = REPO) -> list[str]:
    """Test files that match no module, then modules (not packages) that no test file matches,
    as repository paths, sorted."""
    modules = module_names(source)
    files = test_names(tests)
    lonely_tests = [p for name, p in files.items()
                    if not any(matches(name, m) for m in modules)]
    untested = [p for m, p in modules.items()
                if p.name != "__init__.py" and not any(matches(t, m) for t in files)]
    return sorted(p.relative_to(repo).as_posix() for p in [*lonely_tests, *untested])


def suggestions(source: Path = SOURCE, tests: Path = TESTS) -> dict[str, list[str]]:
    """For each test file named after no module, the names of the modules that the longest tail
    of its NAME names (`test_policy_lint.py` after policy/lint.py moved to review/lint.py:
    `test_review_lint.py`): a rename to consider, not a verdict."""
    modules = module_names(source)
    out: dict[str, list[str]] = {}
    for name, path in test_names(tests).items():
        if any(matches(name, m) for m in modules):
            continue
        words = name.split("_")
        for i in range(1, len(words)):
            tail = "_".join(words[i:])
            found = sorted(m for m in modules if matches(tail, m))
            if found:
                out[path.name] = [f"test_{m}.py" for m in found]
                break
    return out


def read_allowlist(path: Path = ALLOWLIST) -> list[str]:
    if not path.is_file():
        return []
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def render_allowlist(entries: list[str]) -> str:
    return HEADER + "".join(f"{e}\n" for e in entries)


def differences(found: list[str], allowed: list[str]) -> tuple[list[str], list[str]]:
    """(new mismatches not in the allowlist, allowlist entries that no longer mismatch)."""
    return ([e for e in found if e not in allowed],
            [e for e in allowed if e not in found])


def main(argv: list[str]) -> int:
    if "--suggest" in argv:
        for test, names in suggestions().items():
            print(f"{test} -> {' or '.join(names)}")
        return 0
    found = mismatches()
    if "--write" in argv:
        ALLOWLIST.write_text(render_allowlist(found))
        print(f"{ALLOWLIST.relative_to(REPO)}: {len(found)} entries")
        return 0
    new, stale = differences(found, read_allowlist())
    for e in new:
        print(f"not in the allowlist: {e}", file=sys.stderr)
    for e in stale:
        print(f"stale allowlist entry (it matches now: remove it): {e}", file=sys.stderr)
    if "--check" not in argv:
        print(f"{len(found)} mismatches; {len(new)} new, {len(stale)} stale")
    return 1 if new or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
