"""scripts/python.sh: which interpreter setup.sh builds .venv with, and what it says when none
fits (Sandgate needs CPython 3.12+, prefers 3.13)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(["/bin/bash", "-c", f"source scripts/python.sh; {script}"], cwd=REPO,
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_this_interpreter_is_suitable() -> None:
    r = _run(f"python_ok {sys.executable}")
    assert r.stdout.strip() == f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_a_named_interpreter_is_used_or_refused() -> None:
    r = _run("find_python", PYTHON=sys.executable)
    assert r.returncode == 0 and r.stdout.strip() == sys.executable
    r = _run("find_python", PYTHON="/bin/false")
    assert r.returncode == 1 and "PYTHON=/bin/false is not a CPython 3.12+" in r.stderr


def _bin(tmp_path: Path) -> Path:
    """A PATH with only what python.sh runs besides interpreters (whatever the host has)."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "sort").symlink_to(shutil.which("sort") or "/usr/bin/sort")
    return d


def test_none_found_names_what_was_looked_for(tmp_path: Path) -> None:
    empty = _bin(tmp_path)
    (empty / "python3").symlink_to("/bin/false")  # a python3 that is no use
    r = _run("find_python", PATH=str(empty), HOME=str(tmp_path),
             PYENV_ROOT=str(tmp_path / "pyenv"))
    assert r.returncode == 1
    for looked in ("python3.13 on PATH", f"{tmp_path}/pyenv/versions/3.13*/bin/python3.13",
                   "python3.12 on PATH", "python3 on PATH", "PYTHON=/path/to/python3.13"):
        assert looked in r.stderr, r.stderr


def test_pyenv_versions_are_found_newest_preferred(tmp_path: Path) -> None:
    root = tmp_path / "pyenv"
    for v in ("3.12.1", "3.13.0"):
        d = root / "versions" / v / "bin"
        d.mkdir(parents=True)
        (d / f"python{v[:4]}").symlink_to(sys.executable)
    r = _run("find_python", PATH=str(_bin(tmp_path)), HOME=str(tmp_path), PYENV_ROOT=str(root))
    # the 3.13 entry is preferred (it points at this interpreter, which is what python_ok asks)
    assert r.returncode == 0 and r.stdout.strip() == f"{root}/versions/3.13.0/bin/python3.13"
