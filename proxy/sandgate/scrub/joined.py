"""Scrub the text a client joins across streamed events (`sandgate.scrub.deltas` finds the pieces).

Each key (one text a client assembles: a content block, a choice, a tool call's arguments) has
a *join*: its released context (the last max_len - 1 bytes sent since its last replacement)
and its pending deltas. After every event:

- when no join's text could still become a form (`SecretSet.could_complete`: a candidate of at
  least `HOLD_AFTER` bytes), every pending delta is scrubbed together with its context and every
  queued event leaves at once: rewritten if a replacement touched one of its deltas, its exact
  bytes otherwise;
- otherwise every event waits, in order, until the next event settles it.

A form that completes in pending deltas is replaced wherever it began: the marker takes the
place of its first pending byte and the rest of it is cut from the deltas that held it. So
what the client joins never holds a form whole, and of a form longer than `HOLD_AFTER` at most
its first HOLD_AFTER - 1 bytes (the context, released before the candidate was long enough to
hold); none of a shorter one.

Bounds: a join keeps fewer than max_len bytes of context; the queue is released anyway once it
holds `HOLD_LIMIT` bytes of events (an upstream interleaving that much of other streams with an
unfinished candidate), and everything is released at the stream's end. A key an event ends
(`deltas.Parsed.ended`) holds nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sandgate.scrub.deltas import (
    ArrayFramer,
    Event,
    Format,
    Key,
    Parsed,
    Path,
    framer,
    parse,
    with_leaves,
)
from sandgate.scrub.scrubber import SecretSet

T = TypeVar("T")

HOLD_LIMIT = 64 * 1024
"""Queued event bytes past which events leave even while a candidate is unfinished."""

EVENT_LIMIT = 1024 * 1024
"""An event still unfinished at this size is not waited for: from there on the body streams
as bytes (the per-body scrub still applies), joined text no longer scrubbed."""

MAX_KEYS = 4096
"""Joins kept at most; past that, those with nothing pending are forgotten."""


@dataclass(slots=True)
class _Entry(Generic[T]):
    item: T
    payload: bytes
    parsed: Parsed | None
    size: int
    out: list[bytes] = field(default_factory=list)  # per leaf, its bytes after scrubbing
    changed: bool = False


@dataclass(slots=True)
class _Join(Generic[T]):
    ctx: bytes = b""
    pending: list[tuple[_Entry[T], int, bytes]] = field(default_factory=list)
    ended: bool = False


class JoinedScrubber(Generic[T]):
    """Events in (`feed`), events out: each event leaves once, in order, as
    (its item, its new payload or None when unchanged)."""

    def __init__(self, secrets: SecretSet, hold_limit: int = HOLD_LIMIT) -> None:
        self._set = secrets
        self._limit = hold_limit
        self._keep = max(0, secrets.max_len - 1)
        self._joins: dict[Key, _Join[T]] = {}
        self._busy: dict[Key, _Join[T]] = {}  # joins with pending deltas
        self._queue: list[_Entry[T]] = []
        self._queued = 0
        self.replacements = 0

    @property
    def holding(self) -> int:
        """How many events wait."""
        return len(self._queue)

    def feed(self, item: T, payload: bytes | None, size: int = 0) -> list[tuple[T, bytes | None]]:
        """One event (its payload: the data a client parses; None when it has none)."""
        parsed = parse(payload) if payload is not None and not self._set.empty else None
        entry: _Entry[T] = _Entry(item, payload or b"", parsed, size or len(payload or b""))
        self._queue.append(entry)
        self._queued += entry.size
        if parsed is not None:
            for i, (key, _path, text) in enumerate(parsed.leaves):
                data = text.encode("utf-8", "surrogatepass")
                entry.out.append(data)
                join = self._joins.get(key)
                if join is None:
                    if len(self._joins) >= MAX_KEYS:
                        self._forget()
                    join = self._joins[key] = _Join()
                join.ended = False
                join.pending.append((entry, i, data))
                self._busy[key] = join
            for prefix in parsed.ended:
                for key, join in self._busy.items():
                    if key[:len(prefix)] == prefix:
                        join.ended = True
        if self._queued < self._limit and any(
                not j.ended and self._set.could_complete(j.ctx + b"".join(p[2] for p in j.pending))
                for j in self._busy.values()):
            return []
        return self._release()

    def flush(self) -> list[tuple[T, bytes | None]]:
        """The stream ended: everything still waiting."""
        return self._release()

    def _forget(self) -> None:
        for key in [k for k in self._joins if k not in self._busy]:
            del self._joins[key]

    def _release(self) -> list[tuple[T, bytes | None]]:
        for join in self._busy.values():
            self._settle(join)
        self._busy.clear()
        out: list[tuple[T, bytes | None]] = []
        for entry in self._queue:
            if not entry.changed or entry.parsed is None:
                out.append((entry.item, None))
                continue
            new: dict[Path, str] = {}
            for (_key, path, text), data in zip(entry.parsed.leaves, entry.out, strict=True):
                if data != text.encode("utf-8", "surrogatepass"):
                    new[path] = _decode(data)
            out.append((entry.item, with_leaves(entry.parsed, new)))
        self._queue.clear()
        self._queued = 0
        return out

    def _settle(self, join: _Join[T]) -> None:
        """Scrub a join's pending deltas with its context; write each delta's new bytes."""
        base = len(join.ctx)
        data = join.ctx + b"".join(p[2] for p in join.pending)
        matches, _ = self._set.matches(data, final=True)
        edits = [(max(s, base), s + n, r) for s, n, r in matches if s + n > base]
        if edits:
            self.replacements += len(edits)
            pos = base
            k = 0
            for entry, i, piece in join.pending:
                a, b = pos, pos + len(piece)
                pos = b
                while k < len(edits) and edits[k][1] <= a:
                    k += 1  # ended in an earlier delta
                pieces: list[bytes] = []
                cur = a
                for s, e, r in edits[k:]:
                    if s >= b:
                        break
                    if s >= a:  # begins here: the marker goes where its first byte was
                        pieces += (data[cur:s], r)
                    cur = max(cur, min(e, b))  # its bytes in this delta are cut
                pieces.append(data[cur:b])
                new = b"".join(pieces)
                if new != piece:
                    entry.out[i] = new
                    entry.changed = True
            tail = data[edits[-1][1]:]
        else:
            tail = data
        join.ctx = tail[len(tail) - self._keep:] if len(tail) > self._keep else tail
        join.pending = []


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace")


class EventStream:
    """A response body of streamed events (`deltas.stream_format`), already scrubbed as bytes:
    `feed` what arrives, `flush` at the end; out come whole events, the joined text scrubbed.

    An event leaves once it is complete (a client acts on whole events only) and no candidate
    holds it (`JoinedScrubber`). A body that turns out not to be a stream of events (a JSON
    body that is not an array), or an event longer than `EVENT_LIMIT`, passes as it comes.
    """

    def __init__(self, secrets: SecretSet, fmt: Format) -> None:
        self._framer = framer(fmt)
        self._joined: JoinedScrubber[Event] = JoinedScrubber(secrets)
        self._through = secrets.empty

    @property
    def replacements(self) -> int:
        return self._joined.replacements

    @property
    def holding(self) -> int:
        return self._joined.holding

    def feed(self, chunk: bytes) -> bytes:
        if self._through:
            return chunk
        out = [self._emit(self._joined.feed(ev, ev.payload, len(ev.raw)))
               for ev in self._framer.feed(chunk)]
        if (isinstance(self._framer, ArrayFramer) and self._framer.passthrough) or \
                self._framer.pending > EVENT_LIMIT:
            self._through = True
            out += [self._emit(self._joined.flush())]
            out += [ev.raw for ev in self._framer.end()]
        return b"".join(out)

    def flush(self) -> bytes:
        if self._through:
            return b""
        out = [self._emit(self._joined.feed(ev, ev.payload, len(ev.raw)))
               for ev in self._framer.end()]
        return b"".join(out) + self._emit(self._joined.flush())

    @staticmethod
    def _emit(released: list[tuple[Event, bytes | None]]) -> bytes:
        return b"".join(ev.raw if new is None else ev.rebuild(new) for ev, new in released)
