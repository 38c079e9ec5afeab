"""cli/__main__.py: `python -m sandgate.cli` exits with the status the command returned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROXY = Path(__file__).resolve().parents[2] / "proxy"

# A command that caught a KeyboardInterrupt raised inside string-exec'd code (as a dataclass
# being created when Ctrl-C comes), and returns 130.
CAUGHT = """
import sys
from sandgate.cli.__main__ import exit_with
try:
    exec("raise KeyboardInterrupt", {})
except KeyboardInterrupt:
    status = 130
{exit}
"""


def _run(tmp_path: Path, exit_line: str) -> int:
    (tmp_path / "caught.py").write_text(CAUGHT.replace("{exit}", exit_line))
    return subprocess.run([sys.executable, "-m", "caught"], cwd=tmp_path, timeout=60,
                          env={"PYTHONPATH": f"{PROXY}:{tmp_path}"}).returncode


def test_a_caught_interrupt_exits_with_the_commands_status(tmp_path: Path) -> None:
    assert _run(tmp_path, "exit_with(status)") == 130


def test_without_it_the_interpreter_dies_by_sigint(tmp_path: Path) -> None:
    """What exit_with is for: CPython's own exit after such a catch is a death by SIGINT."""
    assert _run(tmp_path, "sys.exit(status)") == -2


@pytest.mark.parametrize("status", [0, 1, 3])
def test_the_status_is_passed_on(tmp_path: Path, status: int) -> None:
    (tmp_path / "plain.py").write_text(
        f"from sandgate.cli.__main__ import exit_with\nexit_with({status})\n")
    r = subprocess.run([sys.executable, "-m", "plain"], cwd=tmp_path, timeout=60,
                       env={"PYTHONPATH": f"{PROXY}:{tmp_path}"})
    assert r.returncode == status
