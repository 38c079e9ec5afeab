"""Parked upstream connections, the bookkeeping: their key, the bounds, when one is still idle
and ready to be taken, the sweep that closes what waited too long, and the counters
(`sandgate_upstream_reuse_total`, `sandgate_upstream_parked`). How a connection is parked and
adopted inside mitmproxy, and why the key is safe: mitm/speedups/upstreampool.py."""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from dataclasses import dataclass, field
from typing import Any

PER_KEY = 8
TOTAL = 256
DEFAULT_IDLE = 2.0

# (identity, sandbox, source, listener (host, port), ip, port, verified name)
PoolKey = tuple[str, str | None, str, tuple[str, int] | None, str, int, str]

def reader_quiet(r: Any) -> bool:
    """Nothing arrived on this StreamReader: no byte buffered, no end of stream, no error."""
    return r.exception() is None and not r.at_eof() and not len(getattr(r, "_buffer", b""))


@dataclass(eq=False)  # compared by identity: two parked connections are never "equal"
class Parked:
    key: PoolKey
    reader: Any  # the StreamReader (wirelimits' timed reader)
    writer: Any  # the raw writer (not the per-handler batching wrapper)
    ssl: Any  # OpenSSL.SSL.Connection, memory BIO, handshake done
    fields: dict[str, Any]
    since: float
    ready: bool = False  # the old handler's read task has ended (it no longer reads)
    h2: Any = None  # an HTTP/2 connection's client layer (its h2 session goes along)

    def alive(self) -> bool:
        if not reader_quiet(self.reader):
            return False
        if self.writer.is_closing():
            return False
        sock = self.writer.get_extra_info("socket")
        raw = getattr(sock, "_sock", sock)  # asyncio's TransportSocket hides recv
        try:
            raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True  # nothing to read: still idle
        except (OSError, AttributeError):
            return False
        return False  # an end of stream not yet seen by the loop, or bytes nobody asked for

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: S110 - closing a dead transport
            pass


@dataclass
class Pool:
    idle: float = DEFAULT_IDLE
    parked: dict[PoolKey, collections.deque[Parked]] = field(
        default_factory=lambda: collections.defaultdict(collections.deque))
    size: int = 0
    reused: int = 0  # connections adopted (counters for sandgate_upstream_reuse_total)
    parked_total: int = 0
    expired: int = 0  # parked, then closed unused (idle too long, or the upstream spoke/left)
    _sweeping: bool = False

    def put(self, p: Parked) -> None:
        q = self.parked[p.key]
        q.append(p)
        self.size += 1
        self.parked_total += 1
        if len(q) > PER_KEY:
            self._drop(q.popleft())
        while self.size > TOTAL:
            key = min(self.parked, key=lambda k: self.parked[k][0].since)
            self._drop(self.parked[key].popleft())
            if not self.parked[key]:
                del self.parked[key]
        self._schedule_sweep()

    def take(self, key: PoolKey) -> Parked | None:
        """The freshest ready connection of this key that is still idle; the dead ones met on
        the way are closed."""
        q = self.parked.get(key)
        now = time.monotonic()
        while q:
            found = next((p for p in reversed(q) if p.ready), None)
            if found is None:
                return None
            q.remove(found)
            self.size -= 1
            if not q:
                del self.parked[key]
            if now - found.since <= self.idle and found.alive():
                self.reused += 1
                return found
            self.expired += 1
            found.close()
        return None

    def clear(self) -> None:
        for q in self.parked.values():
            for p in q:
                p.close()
        self.parked.clear()
        self.size = 0

    def _drop(self, p: Parked) -> None:
        self.size -= 1
        self.expired += 1
        p.close()

    def sweep(self) -> None:
        self._sweeping = False
        now = time.monotonic()
        for key in list(self.parked):
            q = self.parked[key]
            # (a connection whose old read task has not ended within the idle time is given up
            # too: closing it is always safe)
            keep = collections.deque(p for p in q if now - p.since <= self.idle and (
                not p.ready or p.alive()))
            for p in q:
                if p not in keep:
                    self._drop(p)
            if keep:
                self.parked[key] = keep
            else:
                del self.parked[key]
        self._schedule_sweep()

    def _schedule_sweep(self) -> None:
        if self.size and not self._sweeping:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._sweeping = True
            loop.call_later(min(self.idle, 1.0), self.sweep)


def key_for(caller: Any, listener: tuple[str, int] | None, ip: str, port: int,
            name: str) -> PoolKey:
    return (caller.identity, caller.sandbox, caller.source, listener, ip, port, name)


POOL = Pool()


class _Collector:
    """`sandgate_upstream_reuse_total{event}` and `sandgate_upstream_parked`, read when
    scraped."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        events_ = CounterMetricFamily(
            "sandgate_upstream_reuse", "Idle upstream connections parked at a client's end, "
            "reused by the same caller's next client connection, or closed unused (expired)",
            labels=["event"])
        events_.add_metric(["parked"], POOL.parked_total)
        events_.add_metric(["reused"], POOL.reused)
        events_.add_metric(["expired"], POOL.expired)
        yield events_
        yield GaugeMetricFamily("sandgate_upstream_parked",
                                "Idle upstream connections parked now", value=POOL.size)

    def describe(self) -> Any:
        return iter(())


def add_metrics(registry: Any) -> None:
    registry.register(_Collector())


