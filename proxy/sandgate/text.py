"""Character tests shared by every parser: one definition of "control character".

A control character here is C0 (U+0000-U+001F) or DEL (U+007F): what HTTP, DNS names, paths and
header values must never carry. A header-breaking character is the subset that ends or splits
an HTTP/1 line (CR, LF) or truncates C strings (NUL).
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_BREAKING = re.compile(r"[\r\n\x00]")


def has_control_chars(text: str) -> bool:
    return _CONTROL.search(text) is not None


_TERMINAL_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` for a terminal: each control character (C0, DEL and C1, whose escape sequences a
    terminal would act on) written as \\xNN."""
    return _TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def breaks_header(text: str) -> bool:
    """Would this value, put into a header, end the line or truncate it (CR, LF, NUL)?"""
    return _HEADER_BREAKING.search(text) is not None


_HEX = frozenset("0123456789abcdefABCDEF")


def percent_decode(raw: str, what: str = "text") -> str:
    """%XX escapes decoded exactly once, as UTF-8 (paths and query components alike).

    ValueError (naming `what`) for a malformed escape or bytes that are not UTF-8: a parser
    must not guess what an upstream would make of them.
    """
    if "%" not in raw:
        return raw
    out = bytearray()
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "%":
            esc = raw[i + 1 : i + 3]
            if len(esc) != 2 or esc[0] not in _HEX or esc[1] not in _HEX:
                raise ValueError(f"malformed percent-escape {raw[i:i + 3]!r} in {what}")
            out.append(int(esc, 16))
            i += 3
        else:
            out += c.encode("utf-8")
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not valid UTF-8 after percent-decoding") from None
