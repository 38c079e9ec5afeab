"""Run the `sandgate` command in-process, as a subprocess would see it (stdout, stderr, exit).

Starting a Python interpreter per CLI test cost about a second each; the command's behaviour
does not depend on being a separate process (a few tests still run the real entry point).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run_cli(*args: str, cwd: Path = ROOT,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    from sandgate.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_stdin = Path.cwd(), sys.stdin
    os.chdir(cwd)
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse errors and --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(old_cwd)
        sys.stdin = old_stdin
    return subprocess.CompletedProcess(["sandgate", *args], code, out.getvalue(),
                                       err.getvalue())
