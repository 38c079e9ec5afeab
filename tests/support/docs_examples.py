"""The fenced examples of the README and the documentation site (docs/**/*.md), with the marker
comment right before each fence.

Markers (an HTML comment alone on the line before the fence; invisible on the rendered page):
  <!-- not run: REASON -->         a shell example no test can run offline (Docker, root, the
                                   internet, a long-running server...), and why
  <!-- not run here: REASON -->    one that another test runs (the reason names it)
  <!-- run: exits N -->            a shell example that is run and must exit with N (default 0)
  <!-- not loaded: REASON -->      a YAML example that is no policy (a CI workflow, a manifest)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL = ("sh", "bash", "shell")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(not run(?: here)?|run|not loaded):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    file: Path
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    marker: tuple[str, str] | None  # (kind, text) of the comment before the fence

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def examples(path: Path) -> list[Example]:
    out: list[Example] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        prev = lines[start - 1] if start else ""
        mm = _MARKER.match(prev)
        out.append(Example(path, start + 1, m.group(1), "\n".join(lines[start + 1:j]) + "\n",
                           (mm.group(1), mm.group(2)) if mm else None))
        i = j + 1
    return out


def all_examples() -> list[Example]:
    return [e for p in pages() for e in examples(p)]


def policy_files(example: Example) -> dict[str, str]:
    """A YAML example as policy files: one block may hold several, each starting with a comment
    line naming it (`# 10-templates.yaml`) right before its `version:`."""
    files: dict[str, str] = {}
    name, buf = "policy.yaml", []
    lines = example.body.splitlines(keepends=True)
    for k, ln in enumerate(lines):
        m = re.match(r"^# (\S+\.ya?ml)\s*$", ln)
        nxt = lines[k + 1] if k + 1 < len(lines) else ""
        if m and nxt.startswith("version:"):
            if "".join(buf).strip():
                files[name] = "".join(buf)
            name, buf = m.group(1), []
        buf.append(ln)
    files[name] = "".join(buf)
    return files
