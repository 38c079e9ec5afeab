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

Quoted-printable may escape any byte as ``=XX`` (RFC 2045 6.7 rule 1: "any octet"), in
either hex case as decoders take it, so a key with only its ``/`` written ``=2F`` is one of
3^n spellings: no list of forms covers them. The view decodes every ``=XX`` escape to its byte
instead, and a match maps back to the three bytes of each escape it covers. A secret whose own
text holds ``=XX`` or line breaks (a PEM key) is matched in the view by its view spelling,
which `SecretSet` adds to its needles (`view_text`). A literal ``=`` before a value that starts
with two hex digits (``token=ab12...``) reads as an escape to that view, so when it decoded an
escape the view that only joins lines is matched as well, and the leftmost, longest match of
the two wins.

Streaming stays bounded and linear: at most two automaton passes over the views, and what is
held back is what could still become a needle in a view (fewer than max_len view bytes, plus
the single breaks and escapes between them; a run of breaks ends a candidate) plus a trailing
``=`` or ``=X`` that may begin a soft break or an escape; a stop never splits an escape.
Quoted-printable forms with the usual escapes are listed as forms too
(`sandgate.secrets.forms`, kind "qp"): the plain scrub of a binary body has no view.
"""

from __future__ import annotations

import bisect
import functools
import re

from sandgate.scrub.scrubber import SecretSet, StreamScrubber

# A run of line-break bytes (the "=" of a soft break before it is looked at by hand); the view
# that decodes escapes looks for a quoted-printable escape too.
_RUN = re.compile(rb"[\r\n]+")
_TOKEN = re.compile(rb"[\r\n]+|=[0-9A-Fa-f]{2}")
_ESCAPE = re.compile(rb"=[0-9A-Fa-f]{2}")
_SINGLE = (b"\n", b"\r\n", b"\r")
_HEX = frozenset(b"0123456789ABCDEFabcdef")


class _View:
    """`data` without its lone line breaks and (`escapes`) with its ``=XX`` escapes decoded,
    and the way back to `data`'s offsets.

    Text wrapped the usual way (every break the same `\n` or `\r\n`, no blank line, no soft
    break, no escape) is joined with one `bytes.replace` and mapped back lazily: a match or a
    stop near the end walks back over the last few lines; only a match elsewhere lists every
    break. Anything else goes through the general loop. Both give the same view and offsets.
    """

    def __init__(self, data: bytes, escapes: bool = True) -> None:
        self.data = data
        self._sep = b""
        self._s: list[int] = [0]  # view offset of each kept segment
        self._d: list[int] = [0]  # its data offset
        self._esc: set[int] = set()  # view offsets of decoded escapes (three data bytes each)
        self._lazy = False  # escapes decoded, offsets not mapped yet (`_map`)
        self._token = _TOKEN if escapes else _RUN
        escapes = escapes and b"=" in data and _ESCAPE.search(data) is not None
        breaks = b"\n" in data or b"\r" in data
        if not breaks and not escapes:
            self.text = data
            return
        sep = _uniform_break(data) if breaks else b""
        if escapes and (sep or not breaks):
            # Decoded line by line at C speed (an escape never spans a break); the offsets are
            # mapped only if a match or a stop needs them, which for most bodies none does.
            lines = data.split(sep) if sep else [data]
            self.text = b"".join(_ESCAPE.sub(_decode_escape, line) for line in lines)
            self._lazy = True
            return
        if sep:
            self._sep, self._s, self._d = sep, [], []  # segments listed on demand
            self.text = data.replace(sep, b"")
            return
        self.text = self._general(data)

    def _general(self, data: bytes) -> bytes:
        kept: list[bytes] = []
        self._s, self._d = [], []
        pos = size = 0
        for m in self._token.finditer(data):
            a, b = m.span()
            escape = data[a] == 0x3D  # "=XX"
            if not escape and m.group() not in _SINGLE:
                continue  # a run of breaks stays: it ends every candidate match
            if not escape and a - 1 >= pos and data[a - 1] == 0x3D:  # "=": a soft break
                a -= 1
            if a > pos:
                self._s.append(size)
                self._d.append(pos)
                kept.append(data[pos:a])
                size += a - pos
            if escape:  # one view byte for the three of the escape
                self._s.append(size)
                self._d.append(a)
                self._esc.add(size)
                kept.append(bytes((int(data[a + 1:b], 16),)))
                size += 1
            pos = b
        self._s.append(size)
        self._d.append(pos)
        kept.append(data[pos:])
        return b"".join(kept)

    def origin(self, i: int) -> int:
        """The offset in `data` of the view's byte `i`."""
        if self._lazy:
            self._map()
        if self._sep and not self._s:
            if len(self.text) - i <= _TAIL:
                return self._origin_near_end(i)
            self._list_segments()
        k = bisect.bisect_right(self._s, i) - 1
        return self._d[k] + (i - self._s[k])

    @property
    def decoded(self) -> bool:
        """Did the view decode an escape (so that it may read a value differently)?"""
        return self._lazy or bool(self._esc)

    def _map(self) -> None:
        """The segments of a view decoded the fast way (the general loop gives the same text)."""
        self._lazy = False
        self.text = self._general(self.data)

    def end(self, i: int) -> int:
        """The offset in `data` just after the view's byte `i` (past all of an escape)."""
        return self.origin(i) + (3 if i in self._esc else 1)

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


_ESCAPED = {f"={b:02{case}}".encode(): bytes((b,)) for b in range(256) for case in "Xx"}
_ESCAPED.update({f"={b >> 4:X}{b & 15:x}".encode(): bytes((b,)) for b in range(256)})
_ESCAPED.update({f"={b >> 4:x}{b & 15:X}".encode(): bytes((b,)) for b in range(256)})


def _decode_escape(m: re.Match[bytes]) -> bytes:
    return _ESCAPED[m.group()]


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
        cut -= 1  # may be the start of a soft break or an escape: decide with what follows
    elif not final and len(data) >= 2 and data[-2] == 0x3D and data[-1] in _HEX:
        cut -= 2  # may be an escape
    head = data[:cut]
    view = _View(head)
    spans, end = _spans(secrets, view, cut, final)
    if view.decoded:
        # A value right after a literal "=" reads as an escape to the view when it starts with
        # two hex digits ("token=ab12...", "=" then a wrapped base64 line): the view that only
        # joins lines is matched too, and the leftmost, longest match wins.
        lines, lines_end = _spans(secrets, _View(head, escapes=False), cut, final)
        end = min(end, lines_end)
        for back in (1, 2):  # never stop inside an escape: the held rest would read otherwise
            q = end - back
            if q >= 0 and head[q] == 0x3D and _ESCAPE.match(head, q):
                end = q
                break
        spans = _leftmost(spans + lines, end)
    pieces: list[bytes] = []
    pos = 0
    for begin, finish, replacement in spans:
        pieces.append(head[pos:begin])
        pieces.append(replacement)
        pos = finish
    end = max(end, pos)  # a match decided before the stop may reach past it
    pieces.append(head[pos:end])
    return pieces, len(spans), end


def _spans(secrets: SecretSet, view: _View, cut: int, final: bool
           ) -> tuple[list[tuple[int, int, bytes]], int]:
    """What a scrub of the view replaces, as (begin, end, replacement) in the data, and where
    it stops deciding, in the data."""
    found, stop = secrets.matches(view.text, final=final)
    spans = [(view.origin(at), view.end(at + n - 1), r) for at, n, r in found]
    return spans, view.origin(stop) if stop < len(view.text) else cut


def _leftmost(spans: list[tuple[int, int, bytes]], stop: int) -> list[tuple[int, int, bytes]]:
    """The replacements a scrub makes from two lists of matches (each already leftmost, longest
    and final before its own stop): leftmost first, the longest at one start, none overlapping,
    none starting at or after `stop` (undecided there)."""
    out: list[tuple[int, int, bytes]] = []
    pos = 0
    for span in sorted(spans, key=lambda m: (m[0], -m[1])):
        if span[0] >= stop:
            break
        if span[0] >= pos:
            out.append(span)
            pos = span[1]
    return out


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
    """`data` with its lone line breaks taken out and its ``=XX`` escapes decoded (for
    detection: `SecretSet.find` of it); `data` itself (the same object) when that changes
    nothing."""
    return _View(data).text


def view_text(needle: bytes) -> bytes:
    """A needle as the view spells it (`SecretSet` matches that spelling in the view too)."""
    return _View(needle).text


def unwrapping_scrubber(secrets: SecretSet) -> StreamScrubber:
    """A `StreamScrubber` over the view: any chunking, flushed, gives exactly
    ``scrub_unwrapped(secrets, whole)``."""
    return StreamScrubber(secrets, functools.partial(_scan, secrets))
