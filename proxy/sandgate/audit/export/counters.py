"""The exports' own counters, read by /metrics at scrape time.

A Collector registered in Sandgate's registry (sandgate.metrics) rather than metric objects in
it: the exports run on their own threads and only bump integers, and the metrics module stays
as it is. Workers' expositions add up in the supervisor (workers/aggregate.py sums counters).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

DROPPED = "sandgate_export_dropped"
SENT = "sandgate_export_sent"


class ExportCounters(Collector):
    """Copies sent and dropped, by sink ("otlp", "syslog")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}
        self._sent: dict[str, int] = {}

    def dropped(self, sink: str, n: int = 1) -> None:
        with self._lock:
            self._dropped[sink] = self._dropped.get(sink, 0) + n

    def sent(self, sink: str, n: int = 1) -> None:
        with self._lock:
            self._sent[sink] = self._sent.get(sink, 0) + n

    def value(self, sink: str, *, dropped: bool = True) -> int:
        with self._lock:
            return (self._dropped if dropped else self._sent).get(sink, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            dropped, sent = dict(self._dropped), dict(self._sent)
        d = CounterMetricFamily(DROPPED, "Audit copies an export dropped (queue full, collector "
                                "unreachable or refusing), by sink (otlp, syslog); the audit "
                                "file is unaffected", labels=["sink"])
        for sink, n in sorted(dropped.items()):
            d.add_metric([sink], n)
        yield d
        s = CounterMetricFamily(SENT, "Audit copies an export handed to its collector, by sink",
                                labels=["sink"])
        for sink, n in sorted(sent.items()):
            s.add_metric([sink], n)
        yield s
