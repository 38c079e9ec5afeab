"""Refusals by code over time, as the geometry of a stacked bar chart (rendered as inline SVG by
templates/_chart.html: no chart library, no script, nothing inline but SVG presentation
attributes, which the Content-Security-Policy's style-src does not govern).

Pure: what the refusal buckets (sandgate.console.ring) become at a given time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sandgate.console.ring import BUCKET_SECONDS, DEFAULT_BUCKETS
from sandgate.errors import Code

WIDTH = 960
HEIGHT = 260
LEFT = 44  # room for the y labels
BOTTOM = 24  # room for the x labels
TOP = 10
# a colour per code (stable across pages and reloads: by the code's place in errors.Code)
PALETTE = ("#c0392b", "#2980b9", "#8e44ad", "#d35400", "#16a085", "#7f8c8d", "#2c3e50",
           "#f39c12", "#27ae60", "#e84393", "#6c5ce7", "#00838f")
_ORDER = {str(c): i for i, c in enumerate(Code)}


def colour(code: str) -> str:
    return PALETTE[_ORDER.get(code, len(_ORDER)) % len(PALETTE)]


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    w: float
    h: float
    fill: str
    title: str
    code: str


@dataclass(slots=True)
class Chart:
    width: int = WIDTH
    height: int = HEIGHT
    bars: list[Bar] = field(default_factory=list)
    yticks: list[tuple[float, int]] = field(default_factory=list)  # (y, value)
    xticks: list[tuple[float, str]] = field(default_factory=list)  # (x, "HH:MM")
    legend: list[tuple[str, str, int]] = field(default_factory=list)  # (code, colour, total)
    total: int = 0
    window: int = 0  # seconds shown
    bucket: int = BUCKET_SECONDS  # seconds per bar
    plot: tuple[int, int, int, int] = (LEFT, TOP, WIDTH - LEFT, HEIGHT - TOP - BOTTOM)


def _nice_max(n: int) -> int:
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        if n <= step * 4:
            return step * 4
    return n


def build(refusals: Sequence[tuple[int, Mapping[str, int]]], now: float | None = None,
          bucket: int = BUCKET_SECONDS, buckets: int = DEFAULT_BUCKETS) -> Chart:
    """The chart of the last `buckets` buckets ending at `now`."""
    now = time.time() if now is None else now
    last = int(now // bucket) * bucket
    first = last - (buckets - 1) * bucket
    chart = Chart(window=buckets * bucket, bucket=bucket)
    px, py, pw, ph = chart.plot
    slot = pw / buckets
    shown = [(s, c) for s, c in refusals if first <= s <= last]
    totals: dict[str, int] = {}
    for _, counts in shown:
        for code, n in counts.items():
            totals[code] = totals.get(code, 0) + n
    top = _nice_max(max((sum(c.values()) for _, c in shown), default=0))
    scale = ph / top
    for start, counts in shown:
        x = px + (start - first) // bucket * slot
        y: float = py + ph
        when = time.strftime("%H:%M:%S", time.gmtime(start))
        for code in sorted(counts, key=lambda c: _ORDER.get(c, len(_ORDER))):
            h = counts[code] * scale
            y -= h
            chart.bars.append(Bar(round(x + slot * 0.1, 2), round(y, 2),
                                  round(max(slot * 0.8, 1.0), 2), round(h, 2), colour(code),
                                  f"{when} UTC: {counts[code]} {code}", code))
    chart.yticks = [(round(py + ph - v * scale, 2), v) for v in range(0, top + 1, top // 4)]
    step = max(1, buckets // 6)
    chart.xticks = [(round(px + i * slot, 2),
                     time.strftime("%H:%M", time.gmtime(first + i * bucket)))
                    for i in range(0, buckets, step)]
    chart.legend = [(code, colour(code), n) for code, n in
                    sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))]
    chart.total = sum(totals.values())
    return chart
