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


def breaks_header(text: str) -> bool:
    """Would this value, put into a header, end the line or truncate it (CR, LF, NUL)?"""
    return _HEADER_BREAKING.search(text) is not None
