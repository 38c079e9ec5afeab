"""The recent decisions the web console shows: a bounded ring of audit events in memory.

Fed by an `AuditLog` listener (runner/build.py: `sink.add_listener(recent.on_audit)`), so it sees
exactly the events written to the audit stream, after they were written and scrubbed: the
console never has more than the audit log has (no secret value, query values redacted).
Bounded twice: at most `capacity` events, and refusals counted per time bucket for the
last `buckets` buckets only. Nothing here blocks: the listener runs on the proxy's loop.

With `sandgate run --workers N` each worker has its own ring; the supervisor's console asks
every worker and merges (sandgate.console.source), as it merges their metrics.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandgate.audit import events as A

# Events that are decisions about a request (or a connection), and what people decided about
# held requests (`approval`: requested, voted, decided, timed_out, used): the console lists
# these.
DECISION_EVENTS = frozenset({"request", "connect", "websocket", "limit", "approval"})
DEFAULT_CAPACITY = 2000
BUCKET_SECONDS = 15
DEFAULT_BUCKETS = 240  # one hour of 15-second buckets
MAX_LIMIT = 500  # most events one answer carries

FILTERS = ("identity", "sandbox", "code", "host", "tool", "decision")


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    """A JSON-safe deep copy (the audit fields may hold lists the caller keeps), cheap enough
    for the proxy's loop (every event passes here; most values are scalars)."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Mapping):
        return {str(k): v if type(v) in _SCALARS else _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    return str(value)


def is_refusal(event: str, fields: Mapping[str, Any]) -> bool:
    """A request, frame, DNS lookup or connection (a limit) refused, counted once: a refused
    CONNECT answers the requests inside the tunnel with its refusal, and those are counted
    (as `sandgate_requests_total` counts them). Report mode forwards: not a refusal."""
    if not fields.get(A.CODE):
        return False
    return event == "limit" or (event in ("request", "websocket", "dns")
                                and fields.get(A.DECISION) == "deny")


def tools(ev: Mapping[str, Any]) -> list[str]:
    """The tool (or JSON-RPC method) names an event's calls carry."""
    out: list[str] = [ev["tool"]] if isinstance(ev.get("tool"), str) else []  # an approval
    for call in ev.get("rpc") or ():
        if isinstance(call, Mapping):
            name = call.get("tool") or call.get("name") or call.get("method")
            if isinstance(name, str):
                out.append(name)
    return out


@dataclass(frozen=True, slots=True)
class Filter:
    """What the decisions page filters by: each given field must match (substring for host
    and tool, exact for the others; empty: any)."""

    identity: str = ""
    sandbox: str = ""
    code: str = ""
    host: str = ""
    tool: str = ""
    decision: str = ""

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> Filter:
        return cls(**{k: str(query.get(k, "")).strip()[:200] for k in FILTERS})

    def query(self) -> dict[str, str]:
        return {k: v for k in FILTERS if (v := getattr(self, k))}

    def matches(self, ev: Mapping[str, Any]) -> bool:
        for key in ("identity", "sandbox", "code", "decision"):
            want = getattr(self, key)
            if want and str(ev.get(key) or "") != want:
                return False
        where = str(ev.get(A.HOST) or ev.get("url") or "")  # an approval names its URL
        if self.host and self.host.lower() not in where.lower():
            return False
        return not self.tool or any(self.tool.lower() in t.lower() for t in tools(ev))


class EventRing:
    """The last `capacity` decision events of this process, newest last, each with an id.

    `prefix` makes ids unique across the workers of one group ("w1-17"); `version` names the
    policy version serving when the event was written (an explanation is made later, perhaps
    under another version, and says so)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, prefix: str = "",
                 version: Callable[[], str] | None = None,
                 buckets: int = DEFAULT_BUCKETS, clock: Callable[[], float] = time.time
                 ) -> None:
        if capacity <= 0 or buckets <= 0:
            raise ValueError("the ring's capacity and buckets must be positive")
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self._prefix = prefix
        self._version = version
        self._clock = clock
        self._buckets: deque[tuple[int, Counter[str]]] = deque(maxlen=buckets)
        self._lock = threading.Lock()  # listeners may run on a Docker or Vault thread
        self.started = clock()

    def on_audit(self, event: str, fields: Mapping[str, Any]) -> None:
        """The AuditLog listener: keep decision events, count refusals."""
        if event not in DECISION_EVENTS and A.DECISION not in fields:
            return
        now = self._clock()
        ev = {"id": f"{self._prefix}{next(self._seq)}",
              A.TIME: datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")
              .replace("+00:00", "Z"),
              "ts": now, A.EVENT: event, **_plain(fields)}
        if self._version is not None:
            ev["policy_version"] = self._version()
        with self._lock:
            self._events.append(ev)
            if is_refusal(event, fields):
                start = int(now // BUCKET_SECONDS) * BUCKET_SECONDS
                if not self._buckets or self._buckets[-1][0] != start:
                    self._buckets.append((start, Counter()))
                self._buckets[-1][1][str(fields[A.CODE])] += 1

    def events(self, flt: Filter = Filter(), limit: int = MAX_LIMIT) -> list[dict[str, Any]]:
        """The newest `limit` events matching `flt`, newest first."""
        with self._lock:
            snapshot = list(self._events)
        out: list[dict[str, Any]] = []
        for ev in reversed(snapshot):
            if flt.matches(ev):
                out.append(ev)
                if len(out) >= min(limit, MAX_LIMIT):
                    break
        return out

    def get(self, event_id: str) -> dict[str, Any] | None:
        with self._lock:
            return next((ev for ev in self._events if ev["id"] == event_id), None)

    def refusals(self) -> list[tuple[int, dict[str, int]]]:
        """(bucket start, {code: refusals}) for the buckets that saw any, oldest first."""
        with self._lock:
            return [(start, dict(c)) for start, c in self._buckets]

    def as_dict(self, flt: Filter = Filter(), limit: int = MAX_LIMIT) -> dict[str, Any]:
        """What a worker answers the supervisor's console (sandgate.console.source)."""
        return {"events": self.events(flt, limit), "refusals": self.refusals(),
                "started": self.started}


def merge_events(lists: Iterable[Sequence[Mapping[str, Any]]],
                 limit: int = MAX_LIMIT) -> list[dict[str, Any]]:
    """Several rings' answers as one list, newest first."""
    every = [dict(ev) for evs in lists for ev in evs]
    every.sort(key=lambda ev: float(ev.get("ts") or 0), reverse=True)
    return every[:limit]


def merge_refusals(series: Iterable[Sequence[Sequence[Any]]]) -> list[tuple[int, dict[str, int]]]:
    """Several rings' refusal counts added up per bucket, oldest first."""
    acc: dict[int, Counter[str]] = {}
    for one in series:
        for start, counts in one:
            acc.setdefault(int(start), Counter()).update(
                {str(k): int(v) for k, v in dict(counts).items()})
    return [(start, dict(acc[start])) for start in sorted(acc)]


def attach(sink: Any, worker: int | None, version: Callable[[], str]) -> EventRing:
    """A ring fed by `sink` (an AuditLog): every event it writes from now on."""
    ring = EventRing(prefix=f"w{worker}-" if worker is not None else "", version=version)
    sink.add_listener(ring.on_audit)
    return ring
