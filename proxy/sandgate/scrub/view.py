"""The unwrapping view of a body: its lone line breaks taken out and its quoted-printable
``=XX`` escapes decoded, with the way back to the body's offsets (`View`). sandgate.scrub.unwrap
scrubs through it (why, and what is held back: its docstring); the scrubber adds each secret as
the view spells it (`view_text`).
"""

from __future__ import annotations

import bisect
import re

# A run of line-break bytes (the "=" of a soft break before it is looked at by hand); the view
# that decodes escapes looks for a quoted-printable escape too.
_RUN = re.compile(rb"[\r\n]+")
_TOKEN = re.compile(rb"[\r\n]+|=[0-9A-Fa-f]{2}")
ESCAPE = re.compile(rb"=[0-9A-Fa-f]{2}")
_SINGLE = (b"\n", b"\r\n", b"\r")
HEX = frozenset(b"0123456789ABCDEFabcdef")


class View:
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
        escapes = escapes and b"=" in data and ESCAPE.search(data) is not None
        breaks = b"\n" in data or b"\r" in data
        if not breaks and not escapes:
            self.text = data
            return
        sep = _uniform_break(data) if breaks else b""
        if escapes and (sep or not breaks):
            # Decoded line by line at C speed (an escape never spans a break); the offsets are
            # mapped only if a match or a stop needs them, which for most bodies none does.
            lines = data.split(sep) if sep else [data]
            self.text = b"".join(ESCAPE.sub(_decode_escape, line) for line in lines)
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


def view_text(needle: bytes) -> bytes:
    """A needle as the view spells it (`SecretSet` matches that spelling in the view too)."""
    return View(needle).text
