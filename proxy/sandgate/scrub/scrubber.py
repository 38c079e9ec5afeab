"""Keep secret values from leaking back to a sandbox: replace them in what flows to it.

A `SecretSet` compiles every form of every secret value (raw, base64, hex, percent-encoded,
JSON-escaped: see `sandgate.secrets.forms`) into one multi-pattern matcher
(`sandgate.scrub.literals`: Hyperscan, at memory speed), built once per set of cached secrets rather
than per request. Each occurrence becomes ``[REDACTED:<name>]``.
Matching is leftmost, at a position the longest needle wins (one may be a prefix of another),
non-overlapping, and scanning goes on after each replacement.

`StreamScrubber` gives byte-identical output to `SecretSet.scrub` of the whole body however the
body is chunked, and holds back only what could still turn into a needle: for random API keys
that is nearly always nothing, so a server-sent event leaves as soon as it arrives.

`SecretSet.find` and `StreamDetector` report which secrets occur in what a sandbox sends
(exfiltration), ignoring ASCII case because a client may change it on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from sandgate.scrub.literals import LiteralSet
from sandgate.secrets.forms import MIN_DERIVED_LEN, FormKind, classified_forms

REDACTED_TEMPLATE = "[REDACTED:{name}]"

_NO_EXTRA: Mapping[str, Iterable[bytes]] = MappingProxyType({})

# A needle longer than this is only a candidate for an unfinished match at position q if its
# first _PROBE_LEN bytes occur at q: a second small matcher finds those candidates, so deciding
# what to hold back costs a pass over the last max_len - 1 bytes, not one lookup per position.
_PROBE_LEN = 8

HOLD_AFTER = _PROBE_LEN
"""Joined text (`sandgate.scrub.joined`) is held once its end could still become a form and that
candidate is at least this many bytes long (or the form itself is at most this long): so at
most HOLD_AFTER - 1 leading bytes of a longer form leave before holding starts, none of a
shorter one. Tied to the probe: a candidate this long starts with a probe word."""


class Scan(Protocol):
    """`SecretSet._scan`'s contract: (output pieces, replacements, stop) of `data`."""

    def __call__(self, data: bytes, *, final: bool) -> tuple[list[bytes], int, int]: ...


@dataclass(frozen=True, slots=True)
class Hit:
    """One secret seen in outgoing data, and in which form (never the value itself)."""

    name: str
    form: FormKind


@dataclass(frozen=True, slots=True)
class _Needle:
    length: int
    replacement: bytes


class SecretSet:
    """All forms of a set of secret values, compiled for scrubbing and for detection.

    `secrets` maps name -> value (or is a list of (name, value) pairs); a ``str`` value is
    matched as its UTF-8 encoding. `extra` adds exact byte forms under a name (the base64 of a
    Basic pair, the query spelling that Sandgate injected:
    `sandgate.secrets.forms.basic_auth_form`, `query_forms`); they are not encoded further.
    Empty values and forms are skipped. When two names share a needle, the first name wins.

    Complexity: building is about linear in the total length of all forms (some 25 forms, at most
    six times the value's length, per secret). Scrubbing and detection are one matcher pass,
    O(n + m log m) for n bytes with m raw matches; a stream chunk adds O(max_len) to decide
    what to hold back.
    """

    def __init__(
        self,
        secrets: Mapping[str, str | bytes] | Iterable[tuple[str, str | bytes]],
        extra: Mapping[str, Iterable[bytes]] = _NO_EXTRA,
    ) -> None:
        # The unwrapping view (sandgate.scrub.unwrap) imports this module: its spelling of a needle
        # is imported here, when a set is built.
        from sandgate.scrub.unwrap import view_text

        exact: dict[bytes, _Needle] = {}
        folded: dict[bytes, Hit] = {}

        def add(name: str, form: bytes, kind: FormKind) -> None:
            if form in exact:
                return
            marker = REDACTED_TEMPLATE.format(name=name).encode("utf-8", "backslashreplace")
            exact[form] = _Needle(len(form), marker)
            folded.setdefault(form.lower(), Hit(name, kind))
            # A form holding "=XX" or a line break (a PEM) reads differently in the view, which
            # decodes and joins them: match it there as the view spells it. Not when that
            # spelling is too short to be worth the false positives (a tiny raw value).
            seen = view_text(form)
            if (seen != form and seen not in exact
                    and len(seen) >= min(len(form), MIN_DERIVED_LEN)):
                exact[seen] = _Needle(len(seen), marker)
                folded.setdefault(seen.lower(), Hit(name, kind))

        # (name, value) pairs as well as a mapping: per-sandbox secrets have one value per
        # sandbox under one name, and every one of them is scrubbed
        pairs = secrets.items() if isinstance(secrets, Mapping) else secrets
        for name, value in pairs:
            raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
            for form, kind in classified_forms(bytes(raw)).items():
                add(name, form, kind)
        for name, forms in extra.items():
            for form in forms:
                if form:
                    add(name, bytes(form), "own")

        self.max_len: int = max((n.length for n in exact.values()), default=0)
        self._exact: LiteralSet[_Needle] | None = LiteralSet(exact) if exact else None
        self._folded: LiteralSet[Hit] | None = LiteralSet(folded) if folded else None
        probe = {k[:_PROBE_LEN]: None for k in exact if len(k) > _PROBE_LEN}
        self._probe: LiteralSet[None] | None = LiteralSet(probe) if probe else None
        # every proper prefix of the forms of at most HOLD_AFTER bytes (held from their first)
        self._short = frozenset(k[:i] for k in exact if len(k) <= HOLD_AFTER
                                for i in range(1, len(k)))

    @property
    def empty(self) -> bool:
        """True when there is nothing to look for: scrubbing is the identity."""
        return self._exact is None

    def scrub(self, data: bytes) -> tuple[bytes, int]:
        """`data` with every occurrence of every form replaced, and how many there were."""
        if self._exact is None:
            return bytes(data), 0
        pieces, count, _ = self._scan(bytes(data), final=True)
        return b"".join(pieces), count

    def scrub_text(self, text: str) -> tuple[str, int]:
        """`text` (a header value, a refusal body, an audit field) scrubbed as UTF-8 bytes.

        Needles are whole encoded forms, which begin and end on character boundaries of valid
        UTF-8, so the result decodes cleanly; a lossy decode is kept only as a guard against
        `extra` forms that are not UTF-8, and never raises (its message could quote text).
        """
        if self._exact is None:
            return text, 0
        out, count = self.scrub(text.encode("utf-8", "surrogatepass"))
        if not count:
            return text, 0
        try:
            return out.decode("utf-8", "surrogatepass"), count
        except UnicodeDecodeError:
            return out.decode("utf-8", "replace"), count

    def scrubber(self) -> StreamScrubber:
        """A fresh streaming scrubber over this set."""
        return StreamScrubber(self)

    def find(self, data: bytes) -> list[Hit]:
        """Which secrets occur in `data`, in which form, ignoring ASCII case; each hit once.

        Hits are in the order their first occurrence ends. Overlapping occurrences all count:
        this answers "did it leak", not "what to replace".
        """
        return self.detector().feed(data)

    def detector(self) -> StreamDetector:
        """A fresh streaming `find`."""
        return StreamDetector(self)

    def _scan(self, data: bytes, *, final: bool) -> tuple[list[bytes], int, int]:
        """Scrub `data` as far as it can be decided: (output pieces, replacements, stop).

        With `final`, `data` is everything and `stop` is its length. Otherwise more data may
        follow, and the scan stops at the first position (on the path the whole-buffer scrub
        takes) whose remaining bytes are a proper prefix of some needle: only there can more
        data change the decision. Everything before `stop` is output exactly as a scrub of the
        whole stream would output it; the caller holds ``data[stop:]`` back.
        """
        matches, stop = self._matches(data, final=final)
        pieces: list[bytes] = []
        pos = 0
        for start, needle in matches:
            pieces.append(data[pos:start])
            pieces.append(needle.replacement)
            pos = start + needle.length
        pieces.append(data[pos:stop])
        return pieces, len(matches), stop

    def matches(self, data: bytes, *, final: bool
                ) -> tuple[list[tuple[int, int, bytes]], int]:
        """What a scrub of `data` replaces, as (start, length, replacement), and where it stops
        deciding (see `_scan`); for scrubbers over a view of the data (`sandgate.scrub.unwrap`)."""
        if self._exact is None:
            return [], len(data)
        found, stop = self._matches(bytes(data), final=final)
        return [(start, n.length, n.replacement) for start, n in found], stop

    def _matches(self, data: bytes, *, final: bool) -> tuple[list[tuple[int, _Needle]], int]:
        """The replacements `_scan` makes, as (start, needle), and its stop."""
        assert self._exact is not None
        longest: dict[int, _Needle] = {}
        for end, needle in self._exact.ends(data):
            start = end + 1 - needle.length
            best = longest.get(start)
            if best is None or best.length < needle.length:
                longest[start] = needle
        blocked = [] if final else self._unfinished(data)
        matches: list[tuple[int, _Needle]] = []
        pos = b = 0
        for start in sorted(longest):
            if start < pos:
                continue  # inside the previous replacement
            while b < len(blocked) and blocked[b] < pos:
                b += 1
            if b < len(blocked) and blocked[b] <= start:
                break  # a longer needle may yet start at blocked[b]: decide nothing from there
            needle = longest[start]
            matches.append((start, needle))
            pos = start + needle.length
        while b < len(blocked) and blocked[b] < pos:
            b += 1
        stop = blocked[b] if b < len(blocked) else len(data)
        return matches, stop

    def _unfinished(self, data: bytes) -> list[int]:
        """Ascending positions q where ``data[q:]`` is a proper prefix of some needle.

        Such a suffix is shorter than max_len, so only the last max_len - 1 positions qualify.
        Of these, a suffix of at least _PROBE_LEN bytes must start with the first _PROBE_LEN
        bytes of a longer needle (the probe matcher finds those); shorter suffixes are few and
        checked directly.
        """
        n = len(data)
        low = max(0, n - (self.max_len - 1))
        candidates = set(range(max(low, n - _PROBE_LEN + 1), n))
        if self._probe is not None:
            candidates.update(end + 1 - _PROBE_LEN for end, _ in self._probe.ends(data, low))
        return sorted(q for q in candidates if self._is_proper_prefix(data[q:]))

    def could_complete(self, data: bytes) -> bool:
        """Could more bytes after `data` complete a form that began in it, by the rule of
        `HOLD_AFTER`? True when a suffix of at least HOLD_AFTER bytes is a proper prefix of a
        form, or a shorter suffix is a proper prefix of a form of at most HOLD_AFTER bytes.
        Costs a probe pass over the last max_len - 1 bytes."""
        if self._exact is None or not data:
            return False
        n = len(data)
        low = max(0, n - (self.max_len - 1))
        if self._probe is not None and n - low >= _PROBE_LEN:
            for end, _ in self._probe.ends(data, low):
                if self._is_proper_prefix(data[end + 1 - _PROBE_LEN:]):
                    return True
        if self._short:
            return any(data[q:] in self._short for q in range(max(low, n - HOLD_AFTER + 1), n))
        return False

    def _is_proper_prefix(self, s: bytes) -> bool:
        assert self._exact is not None
        return self._exact.prefix_state(s)[0]


class StreamScrubber:
    """Scrub a byte stream chunk by chunk: `feed` what arrives, `flush` at the end.

    `feed` returns everything a whole-body scrub would already have decided, and holds back
    only the bytes from the first undecided position on: a suffix that is a proper prefix of
    some needle (so fewer than max_len bytes). Any chunking, flushed, gives exactly
    ``secrets.scrub(whole)``.

    `scan` replaces `SecretSet._scan` (same contract) for a scrubber over a view of the data
    (`sandgate.scrub.unwrap`); the held-back bound is then the scan's.
    """

    def __init__(self, secrets: SecretSet, scan: Scan | None = None) -> None:
        self._set = secrets
        self._scan: Scan = scan if scan is not None else secrets._scan
        self._held = b""
        self.replacements = 0

    @property
    def held(self) -> int:
        """How many bytes are held back right now (always < max_len)."""
        return len(self._held)

    def feed(self, chunk: bytes) -> bytes:
        """The scrubbed bytes that can be sent now."""
        if self._set.empty:
            return bytes(chunk)
        if not chunk:
            return b""  # nothing new can settle what is held
        data = self._held + chunk if self._held else bytes(chunk)
        pieces, count, stop = self._scan(data, final=False)
        self._held = data[stop:]
        self.replacements += count
        return b"".join(pieces)

    def flush(self) -> bytes:
        """Everything still held back, scrubbed. The scrubber may be reused afterwards."""
        held, self._held = self._held, b""
        if not held or self._set.empty:
            return held
        pieces, count, _ = self._scan(held, final=True)
        self.replacements += count
        return b"".join(pieces)


class StreamDetector:
    """`SecretSet.find` over a stream, keeping only the last max_len - 1 bytes seen.

    `feed` returns the hits not reported before by this detector. An occurrence is counted
    (`occurrences`) when the chunk holding its last byte arrives, so one that straddles chunks
    is counted once; the kept tail is long enough for any needle ending in the new chunk.
    """

    def __init__(self, secrets: SecretSet) -> None:
        self._set = secrets
        self._tail = b""
        self._seen: dict[Hit, None] = {}
        self.occurrences = 0

    @property
    def held(self) -> int:
        """Bytes kept from earlier chunks (always < max_len)."""
        return len(self._tail)

    @property
    def hits(self) -> list[Hit]:
        """Every hit so far, in the order first reported."""
        return list(self._seen)

    def feed(self, chunk: bytes) -> list[Hit]:
        folded = self._set._folded
        if folded is None or not chunk:
            return []
        data = self._tail + chunk.lower()  # bytes.lower() folds ASCII only, as needles were
        fresh = len(self._tail)
        new: list[Hit] = []
        for end, hit in folded.ends(data):
            if end < fresh:
                continue  # ended in the tail: counted with an earlier chunk
            self.occurrences += 1
            if hit not in self._seen:
                self._seen[hit] = None
                new.append(hit)
        keep = self._set.max_len - 1
        self._tail = data[max(0, len(data) - keep):] if keep else b""
        return new

