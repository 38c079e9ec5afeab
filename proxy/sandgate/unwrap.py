"""Scrub secrets that a line break cuts in two: MIME's wrapped base64 and quoted-printable.

A MIME body wraps base64 at 76 columns and quoted-printable with soft line breaks (``=`` at a
line's end), so the break can fall inside a key's encoding; any MIME library, and ``base64 -d``,
joins the lines again. Listing every wrapped spelling in the automaton would take one form per
break position and width (an encoder may wrap at any width). Decoding the parts with the
``email`` package would need the whole body. Instead the scrub runs over the body as if single
line breaks were not there: a *view* with every lone line break (``\\n``, ``\\r\\n`` or ``\\r``,
with the ``=`` before it when there is one) taken out, matched by the same automaton, and each
match replaced in the real bytes together with the breaks inside it. Two or more breaks in a
row (a blank line: the end of a server-sent event, a MIME boundary's surroundings) are kept in
the view, so they still end every candidate match and nothing is held back across them.

Streaming stays bounded and linear: one automaton pass over the view, and what is held back is
what could still become a needle in the view (fewer than max_len view bytes, plus the single
breaks between them; a run of breaks ends a candidate) plus a trailing ``=`` that may begin a
soft break. Quoted-printable's ``=XX`` escapes are forms of their own
(`sandgate.secrets.forms`, kind "qp").
"""

from __future__ import annotations

import bisect
import functools
import re

from sandgate.scrub import SecretSet, StreamScrubber

# A run of line-break bytes, with the "=" of a soft break before it.
_RUN = re.compile(rb"=?[\r\n]+")
_SINGLE = (b"\n", b"\r\n", b"\r")


class _View:
    """`data` without its lone line breaks, and the way back to `data`'s offsets."""

    def __init__(self, data: bytes) -> None:
        if b"\n" not in data and b"\r" not in data:
            self.text, self._s, self._d = data, [0], [0]
            return
        kept: list[bytes] = []
        self._s, self._d = [], []  # view offset, data offset of each kept segment
        pos = size = 0
        for m in _RUN.finditer(data):
            run = m.group()
            if run.removeprefix(b"=") not in _SINGLE:
                continue
            a, b = m.span()
            if a > pos:
                self._s.append(size)
                self._d.append(pos)
                kept.append(data[pos:a])
                size += a - pos
            pos = b
        self._s.append(size)
        self._d.append(pos)
        kept.append(data[pos:])
        self.text = b"".join(kept)

    def origin(self, i: int) -> int:
        """The offset in `data` of the view's byte `i`."""
        k = bisect.bisect_right(self._s, i) - 1
        return self._d[k] + (i - self._s[k])


def _scan(secrets: SecretSet, data: bytes, *, final: bool) -> tuple[list[bytes], int, int]:
    """`SecretSet._scan` over the view: (pieces of `data`, replacements, stop in `data`)."""
    cut = len(data)
    if not final and data.endswith(b"="):
        cut -= 1  # may be the start of a soft break: decide with the next byte
    head = data[:cut]
    view = _View(head)
    matches, stop = secrets.matches(view.text, final=final)
    pieces: list[bytes] = []
    pos = 0
    for start, length, replacement in matches:
        begin = view.origin(start)
        pieces.append(head[pos:begin])
        pieces.append(replacement)
        pos = view.origin(start + length - 1) + 1
    end = view.origin(stop) if stop < len(view.text) else cut
    pieces.append(head[pos:end])
    return pieces, len(matches), end


def scrub_unwrapped(secrets: SecretSet, data: bytes) -> tuple[bytes, int]:
    """`secrets.scrub(data)`, and forms that lone line breaks cut are replaced as well."""
    if secrets.empty:
        return bytes(data), 0
    pieces, count, _ = _scan(secrets, bytes(data), final=True)
    return b"".join(pieces), count


def unwrapped_view(data: bytes) -> bytes:
    """`data` with its lone line breaks taken out (for detection: `SecretSet.find` of it)."""
    return _View(data).text


def unwrapping_scrubber(secrets: SecretSet) -> StreamScrubber:
    """A `StreamScrubber` over the view: any chunking, flushed, gives exactly
    ``scrub_unwrapped(secrets, whole)``."""
    return StreamScrubber(secrets, functools.partial(_scan, secrets))
