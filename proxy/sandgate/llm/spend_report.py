"""`sandgate report --spend AUDIT...`: LLM spend totals from audit logs (sandgate.llm.spend writes
the `llm` object of each event). Pure: events in, totals out."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUPS = ("identity", "sandbox", "model", "budget", "api")


@dataclass(slots=True)
class Total:
    calls: int = 0  # LLM calls forwarded
    refused: int = 0  # LLM calls Sandgate refused (model, cap, budget, ...)
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    codes: dict[str, int] = field(default_factory=dict)  # refusals by code

    def doc(self) -> dict[str, Any]:
        return {"calls": self.calls, "refused": self.refused,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "reasoning_tokens": self.reasoning_tokens,
                "cost_usd": round(self.cost_usd, 6), "refusals": dict(sorted(self.codes.items()))}


def read_events(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    """The JSON lines of audit files (gzip-compressed ones too); other lines are skipped."""
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    yield ev


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def totals(events: Iterable[dict[str, Any]], by: Sequence[str]) -> dict[tuple[str, ...], Total]:
    """Per group (the values of `by` fields: identity, sandbox, model, budget, api), what the
    LLM calls of the events spent."""
    out: dict[tuple[str, ...], Total] = {}
    for ev in events:
        llm = ev.get("llm")
        if ev.get("event") != "request" or not isinstance(llm, dict):
            continue
        source = {**ev, **{k: llm.get(k) for k in ("model", "budget", "api")}}
        key = tuple(str(source.get(k) or "-") for k in by)
        t = out.setdefault(key, Total())
        if ev.get("decision") == "deny":
            t.refused += 1
            code = str(ev.get("code") or "-")
            t.codes[code] = t.codes.get(code, 0) + 1
            continue
        t.calls += 1
        got = llm.get("usage")
        usage: dict[str, Any] = got if isinstance(got, dict) else {}
        t.input_tokens += _count(usage.get("input_tokens"))
        t.output_tokens += _count(usage.get("output_tokens"))
        t.cached_tokens += _count(usage.get("cached_tokens"))
        t.reasoning_tokens += _count(usage.get("reasoning_tokens"))
        cost = llm.get("cost_usd")
        if isinstance(cost, int | float) and not isinstance(cost, bool) and cost > 0:
            t.cost_usd += float(cost)
    return dict(sorted(out.items()))


def format_json(rows: dict[tuple[str, ...], Total], by: Sequence[str]) -> str:
    return json.dumps([{**dict(zip(by, k, strict=True)), **t.doc()} for k, t in rows.items()],
                      indent=2) + "\n"


def format_markdown(rows: dict[tuple[str, ...], Total], by: Sequence[str]) -> str:
    head = [*by, "calls", "refused", "input", "output", "cached", "reasoning", "cost USD"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, t in rows.items():
        lines.append("| " + " | ".join([*k, str(t.calls), str(t.refused), str(t.input_tokens),
                                        str(t.output_tokens), str(t.cached_tokens),
                                        str(t.reasoning_tokens), f"{t.cost_usd:.6f}"]) + " |")
    if not rows:
        lines.append("(no LLM calls in these audit files)")
    return "\n".join(lines) + "\n"
