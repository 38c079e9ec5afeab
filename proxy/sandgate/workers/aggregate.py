"""One answer for the whole process group: metrics, readiness and reloads of N workers.

Pure functions over what the workers' control sockets answered, so they are tested without
processes. Metrics are merged from each worker's Prometheus text rather than with
prometheus_client's multiprocess mode: that mode needs its directory set before the library is
imported, cannot serve Sandgate's gauges read at scrape time (open connections, in-flight flows)
and never forgets a label set, so a reload would leave the old `sandgate_policy_info` series
behind.

How samples combine: counters, histograms and the gauges of things in progress (open
connections, tunnels, in-flight flows) add up; `sandgate_draining` and the timestamps take the
largest value; `*_created` the earliest. `sandgate_policy_info` is not merged: the supervisor
shows the one version every live worker agrees on (`VersionTracker`), so a scrape in the
middle of a reload shows the previous version until the last worker has swapped, never two.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

POLICY_INFO = "sandgate_policy_info"
_LARGEST = frozenset({"sandgate_draining", "sandgate_policy_loaded_timestamp_seconds",
                      "sandgate_policy_last_reload_timestamp_seconds",
                      "sandgate_info"})  # always 1: the replica's name, not a count

_Key = tuple[str, tuple[tuple[str, str], ...]]


def policy_version(text: str) -> str | None:
    """The version a worker's metrics say it serves (its `sandgate_policy_info` at 1)."""
    for fam in text_string_to_metric_families(text):
        if fam.name == POLICY_INFO:
            for s in fam.samples:
                if s.value == 1 and "version" in s.labels:
                    return str(s.labels["version"])
    return None


@dataclass
class VersionTracker:
    """The policy version shown for the group: the last one every live worker served."""

    agreed: str

    def observe(self, versions: Iterable[str | None]) -> str:
        seen = {v for v in versions if v}
        if len(seen) == 1:
            self.agreed = seen.pop()
        return self.agreed


def _combine(fam_name: str, fam_type: str, sample: str, old: float, new: float) -> float:
    if sample.endswith("_created"):
        return min(old, new)
    if fam_type == "gauge" and fam_name in _LARGEST:
        return max(old, new)
    return old + new


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge(texts: Sequence[str], version: str) -> bytes:
    """One Prometheus exposition from the workers' (and the supervisor's own) expositions."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[_Key, float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            if fam.name == POLICY_INFO:
                continue
            acc = values[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(s.labels.items()))
                acc[key] = _combine(fam.name, fam.type, s.name, acc[key], s.value) \
                    if key in acc else s.value
    out: list[Metric] = []
    for name, metric in families.items():
        if name == POLICY_INFO:
            metric.samples = [Sample(POLICY_INFO, {"version": version}, 1.0)]
        else:
            metric.samples = [Sample(sname, dict(labels), v)
                              for (sname, labels), v in values[name].items()]
        out.append(metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(out))
    return generate_latest(registry)


# ------------------------------------------------------------------------------ readiness

@dataclass
class WorkerView:
    """What the supervisor knows of one worker when it answers /readyz."""

    id: int
    pid: int | None
    running: bool
    started: bool  # its listener was up once since this process started
    readyz: tuple[int, Mapping[str, Any]] | None = None  # the worker's own /readyz answer
    error: str | None = None  # why asking it failed


@dataclass
class Readiness:
    ready: bool
    body: dict[str, Any] = field(default_factory=dict)


def readiness(workers: Sequence[WorkerView], tracker: VersionTracker,
              draining: bool) -> Readiness:
    """Ready when every worker is running and says it is ready."""
    reasons: list[str] = []
    if draining:
        reasons.append("shutting down: not accepting new connections")
    per: dict[str, Any] = {}
    versions: list[str | None] = []
    problems: list[str] = []
    for w in workers:
        entry: dict[str, Any] = {"pid": w.pid, "ready": False}
        if not w.running:
            reasons.append(f"worker {w.id} is not running (it is being restarted)")
        elif not w.started:
            reasons.append(f"worker {w.id} is starting")
        elif w.readyz is None:
            reasons.append(f"worker {w.id} did not answer: {w.error or 'no answer'}")
        else:
            status, answer = w.readyz
            entry["ready"] = status == 200
            entry["policy_version"] = answer.get("policy_version")
            versions.append(answer.get("policy_version"))
            if not draining:
                reasons.extend(f"worker {w.id}: {r}" for r in answer.get("reasons") or ())
            for p in answer.get("policy_reload_problems") or ():
                if p not in problems:
                    problems.append(p)
        per[str(w.id)] = entry
    body: dict[str, Any] = {"ready": not reasons, "reasons": reasons,
                            "policy_version": tracker.observe(versions), "workers": per}
    if problems:
        body["policy_reload_problems"] = problems
    return Readiness(not reasons, body)


# --------------------------------------------------------------------------------- reloads

def combine_reloads(answers: Mapping[int, tuple[int, Mapping[str, Any]] | str],
                    tracker: VersionTracker) -> tuple[int, dict[str, Any]]:
    """One reload answer from each worker's: an error anywhere is the answer's error.

    A value that is a string is why that worker could not be asked (not running: it reads the
    files afresh when it starts, so it cannot serve an older version)."""
    outcomes: dict[str, Any] = {}
    problems: list[str] = []
    kinds: set[str] = set()
    versions: list[str | None] = []
    previous: str | None = None
    for wid, answer in sorted(answers.items()):
        if isinstance(answer, str):
            outcomes[str(wid)] = {"outcome": "not_running", "reason": answer}
            continue
        status, body = answer
        outcome = str(body.get("outcome") or ("error" if status != 200 else "ok"))
        kinds.add(outcome)
        versions.append(body.get("version"))
        previous = previous or body.get("previous")
        outcomes[str(wid)] = dict(body)
        for p in body.get("problems") or ():
            if p not in problems:
                problems.append(p)
    overall = "error" if "error" in kinds or not kinds else \
        "ok" if "ok" in kinds else "unchanged"
    if not kinds:
        problems.append("no worker is running")
    out = {"outcome": overall, "version": tracker.observe(versions), "previous": previous,
           "problems": problems, "workers": outcomes}
    return (422 if overall == "error" else 200), out
