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

# A run of line-break bytes (the "=" of a soft break before it is looked at by hand: a pattern
# that may start with "=" cannot use the regex engine's fast scan for its first character).
_RUN = re.compile(rb"[\r\n]+")
_SINGLE = (b"\n", b"\r\n", b"\r")


class _View:
    """`data` without its lone line breaks, and the way back to `data`'s offsets.

    Text wrapped the usual way (every break the same `\n` or `\r\n`, no blank line, no soft
    break) is joined with one `bytes.replace` and mapped back lazily: a match or a stop near
    the end walks back over the last few lines; only a match elsewhere lists every break.
    Anything else goes through the general loop. Both give the same view and offsets.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._sep = b""
        self._s: list[int] = [0]  # view offset of each kept segment
        self._d: list[int] = [0]  # its data offset
        if b"\n" not in data and b"\r" not in data:
            self.text = data
            return
        sep = _uniform_break(data)
        if sep:
            self._sep, self._s, self._d = sep, [], []  # segments listed on demand
            self.text = data.replace(sep, b"")
            return
        self.text = self._general(data)

    def _general(self, data: bytes) -> bytes:
        kept: list[bytes] = []
        self._s, self._d = [], []
        pos = size = 0
        for m in _RUN.finditer(data):
            if m.group() not in _SINGLE:
                continue
            a, b = m.span()
            if a - 1 >= pos and data[a - 1] == 0x3D:  # "=": a quoted-printable soft break
                a -= 1
            if a > pos:
                self._s.append(size)
                self._d.append(pos)
                kept.append(data[pos:a])
                size += a - pos
            pos = b
        self._s.append(size)
        self._d.append(pos)
        kept.append(data[pos:])
        return b"".join(kept)

    def origin(self, i: int) -> int:
        """The offset in `data` of the view's byte `i`."""
        if self._sep and not self._s:
            if len(self.text) - i <= _TAIL:
                return self._origin_near_end(i)
            self._list_segments()
        k = bisect.bisect_right(self._s, i) - 1
        return self._d[k] + (i - self._s[k])

    def _origin_near_end(self, i: int) -> int:
        sep, data = self._sep, self.data
        d, v = len(data), len(self.text)  # the end of a kept segment, in data and in the view
        while True:
            j = data.rfind(sep, 0, d)
            start = j + len(sep) if j >= 0 else 0  # the segment is data[start:d]
            if i >= v - (d - start):
                return d - (v - i)
            v -= d - start
            d = j

    def _list_segments(self) -> None:
        size = pos = 0
        n = len(self._sep)
        for a in (m.start() for m in re.finditer(re.escape(self._sep), self.data)):
            if a > pos:
                self._s.append(size)
                self._d.append(pos)
                size += a - pos
            pos = a + n
        self._s.append(size)
        self._d.append(pos)


# A stop or a match this close to the view's end is mapped back by walking the last lines.
_TAIL = 4096


def _uniform_break(data: bytes) -> bytes:
    """The one line break `data` uses when every break in it is that one, no two are adjacent
    and none follows "=" (the usual base64 or text wrapping); else b"" (the general loop)."""
    if b"\r" not in data:
        sep = b"\n"
    elif data.count(b"\r") == data.count(b"\r\n") == data.count(b"\n"):
        sep = b"\r\n"
    else:
        return b""
    if sep + sep in data or b"=" + sep in data or data.startswith(sep):
        return b""
    return sep


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


# Media types that are binary by definition: no MIME part or wrapped text is expected inside,
# and their bytes hold lone CRs and LFs at random, which only slow the view down. The plain
# scrub (every unwrapped form) still runs over them.
_BINARY_TOP = ("image/", "audio/", "video/", "font/")
_BINARY = frozenset({"application/octet-stream", "application/zip", "application/gzip",
                     "application/x-tar", "application/pdf", "application/wasm",
                     "application/zstd", "application/x-7z-compressed"})


def applies_to(content_type: str) -> bool:
    """Should a body of this Content-Type be scrubbed across line breaks too? Yes unless it
    is declared binary (multipart, message, text, JSON, unknown or missing: yes)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return not (media.startswith(_BINARY_TOP) or media in _BINARY)


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
