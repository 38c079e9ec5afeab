"""`sandgate_capture_packets_total` / `sandgate_capture_bytes_total`: the capture tables'
counters (what was redirected, what was dropped) as Prometheus metrics, read at scrape time.

"Everything else is dropped and counted": the counters live in the nftables tables that
`sandgate sandbox network --transparent` or the launcher installed in this (Sandgate's) network
namespace, one `inet sandgate_capture_<tag>` table per sandbox network. At most one
`nft -j list counters` per second whatever the scrape rate (the last reading is reused); a
scrape never fails for them: without nft, without the right to read the ruleset or with an
unreadable answer the metrics are simply absent and one log line says why (again only when the
reason changes). Tables in other namespaces (a pod's own table) are not visible from here.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from sandgate.capture.nftables import table_name

log = logging.getLogger("sandgate.capture")

PREFIX = table_name("")  # "sandgate_capture_"
MAX_AGE = 1.0  # seconds a reading is reused: bounds the nft runs, whatever scrapes
TIMEOUT = 5.0

Reading = dict[tuple[str, str], tuple[int, int]]  # (network, counter) -> (packets, bytes)


def parse(text: str) -> Reading:
    """The capture tables' counters in `nft -j list counters` output; other tables ignored.
    Raises ValueError on an answer that is not nft's JSON."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"nft -j output is not JSON ({e.msg})") from None
    items = doc.get("nftables") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ValueError("nft -j output has no nftables list")
    out: Reading = {}
    for item in items:
        c = item.get("counter") if isinstance(item, dict) else None
        if not isinstance(c, dict) or c.get("family") != "inet":
            continue
        table, name = c.get("table"), c.get("name")
        if not isinstance(table, str) or not table.startswith(PREFIX) or not isinstance(name, str):
            continue
        packets, nbytes = c.get("packets"), c.get("bytes")
        if isinstance(packets, int) and isinstance(nbytes, int):
            out[(table[len(PREFIX):], name)] = (packets, nbytes)
    return out


def read_nft() -> str:
    """`nft -j list counters` of this namespace; OSError/RuntimeError say why not."""
    exe = shutil.which("nft")
    if exe is None:
        raise RuntimeError("nft (nftables) is not installed")
    res = subprocess.run([exe, "-j", "list", "counters"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    if res.returncode != 0:
        raise RuntimeError(f"nft -j list counters failed: {res.stderr.strip()[:200]}")
    return res.stdout


class CaptureCounters(Collector):
    """A custom collector: nothing is stored between scrapes but the last reading."""

    def __init__(self, read: Callable[[], str] = read_nft,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._clock = read, clock
        self._at: float | None = None
        self._last: Reading = {}
        self._why: str | None = None  # the last reason the counters were absent (logged once)

    def reading(self) -> Reading:
        now = self._clock()
        if self._at is not None and now - self._at < MAX_AGE:
            return self._last
        self._at = now
        try:
            self._last = parse(self._read())
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            why = str(e) or type(e).__name__
            if why != self._why:
                log.warning("capture counters not exported (sandgate_capture_*): %s", why)
                self._why = why
            self._last = {}
        else:
            self._why = None
        return self._last

    def collect(self) -> Iterator[CounterMetricFamily]:
        found = self.reading()
        if not found:
            return
        packets = CounterMetricFamily(
            "sandgate_capture_packets", "Packets counted by a sandbox network's transparent "
            "capture table (nftables, this namespace), by network (the table's tag: the bridge) "
            "and counter (captured, dns_allowed, dropped_quic, dropped_dns, dropped_tcp, "
            "dropped_udp, dropped_other)", labels=["network", "counter"])
        nbytes = CounterMetricFamily(
            "sandgate_capture_bytes", "Bytes counted by a sandbox network's transparent "
            "capture table, by network and counter", labels=["network", "counter"])
        for (network, counter), (p, b) in sorted(found.items()):
            packets.add_metric([network, counter], p)
            nbytes.add_metric([network, counter], b)
        yield packets
        yield nbytes

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())  # no nft run at registration (auto_describe would collect)


def add_metrics(registry: CollectorRegistry) -> CaptureCounters:
    collector = CaptureCounters()
    registry.register(collector)
    return collector


__all__ = ["CaptureCounters", "add_metrics", "parse"]
