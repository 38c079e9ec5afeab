"""docs/building.md's chart of a request's life is checked against the code: every stage module,
every stage of HEAD_PATH and REQUEST_PATH, every hook of the Gate addon and every patch of
mitmproxy internals (sandgate.mitm.registry.PATCHES) has its place in it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from sandgate.addons.gate import HEAD_PATH, REQUEST_PATH, Gate
from sandgate.mitm.registry import PATCHES
from sandgate.stages import context

REPO = Path(__file__).parents[2]
STAGES = Path(context.__file__).parent


def _chart() -> str:
    text = (REPO / "docs/building.md").read_text()
    start = text.index("## A request's life")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _cells(column: int) -> str:
    """The text of one column of the chart's table (0: the step number)."""
    rows = [line.split(" | ") for line in _chart().splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 10
    return "\n".join(row[column] for row in rows)


def test_every_stage_module_is_in_the_chart() -> None:
    stages = sorted(p.stem for p in STAGES.glob("s[0-9]*_*.py"))
    assert len(stages) >= 10
    missing = [s for s in stages if f"`{s}." not in _cells(3)]
    assert missing == [], f"stages not in docs/building.md's chart: {missing}"


def test_every_stage_of_the_paths_is_in_its_row() -> None:
    chart = _chart()
    for path, name in ((HEAD_PATH, "HEAD_PATH"), (REQUEST_PATH, "REQUEST_PATH")):
        row = next(line for line in chart.splitlines() if f"`{name}`:" in line)
        listed = re.findall(r"`(s\d+_\w+\.\w+)`", row.split(f"`{name}`:", 1)[1])
        expected = [f"{inspect.getmodule(s).__name__.rsplit('.', 1)[1]}.{s.__name__}"
                    for s in path]
        assert listed[:len(expected)] == expected, name


def test_every_gate_hook_is_in_the_chart() -> None:
    hooks = [n for n, _ in inspect.getmembers(Gate, inspect.isfunction)
             if n in Gate.__dict__ and not n.startswith("_")]
    assert "requestheaders" in hooks and "server_connect" in hooks
    methods = _cells(2)
    missing = [h for h in hooks if f"`{h}`" not in methods]
    assert missing == [], f"Gate hooks not in docs/building.md's chart: {missing}"


def test_every_patch_is_in_the_chart() -> None:
    beneath = _cells(4) + _chart()  # the last column, or the line on every hook
    missing = [p.name for p in PATCHES if f"`{p.name}`" not in beneath]
    assert missing == [], f"patches not in docs/building.md's chart: {missing}"
    # and each acts beneath some row of the table, not only in prose
    assert {p.name for p in PATCHES} - set(re.findall(r"`(\w+)`", _cells(4))) <= {
        "dispatch", "speed", "synchooks"}
