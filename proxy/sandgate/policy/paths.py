"""Request paths: one canonical spelling, and the path globs rules match it against.

Globs: `*` matches within one segment (one non-empty segment when it is the whole segment),
`**` (only as a whole segment) matches zero or more segments. Patterns are compiled once at load
time; matching never compiles anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandgate.text import has_control_chars, percent_decode

DOUBLE_STAR = "**"

# segment glob -> compiled regex; filled at compile time so matching compiles nothing.
_GLOBS: dict[str, re.Pattern[str]] = {}


@dataclass(frozen=True, slots=True)
class PathPattern:
    """A compiled path glob: `*` matches within one segment, `**` across segments."""

    text: str
    segments: tuple[str, ...]

    def matches(self, normalised_path: str) -> bool:
        return match_segments(self.segments, normalised_path)


def _percent_decode(raw: str) -> str:
    return percent_decode(raw, "path")


def normalise_path(raw: str) -> str:
    """The canonical spelling of a request path.

    Drops query and fragment, percent-decodes once (so %2F is a slash), treats backslash as a
    slash, resolves `.` and `..` (never above the root), collapses repeated slashes and keeps a
    trailing slash. `/v1/messages%2F..%2F..%2Fadmin` becomes `/admin`.
    """
    if not isinstance(raw, str):
        raise ValueError("path must be a string")
    p = raw.split("#", 1)[0].split("?", 1)[0]
    if not p.startswith("/"):
        raise ValueError(f"path {raw[:80]!r} does not start with '/'")
    p = _percent_decode(p)
    if has_control_chars(p):
        raise ValueError("path contains NUL or control characters")
    p = p.replace("\\", "/")
    segments = p.split("/")[1:]
    out: list[str] = []
    trailing = False
    for seg in segments:
        trailing = seg in ("", ".", "..")
        if seg in ("", "."):
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    if not out:
        return "/"
    return "/" + "/".join(out) + ("/" if trailing else "")


def _compile_glob(seg: str) -> re.Pattern[str]:
    parts = [re.escape(x) for x in seg.split("*")]
    rx = "[^/]*".join(parts)
    if seg == "*":
        rx = "[^/]+"
    return re.compile(rx, re.DOTALL)


def compile_path_pattern(raw: str) -> PathPattern:
    """Compile a path glob; ValueError says what is wrong with it."""
    if not isinstance(raw, str):
        raise ValueError("path pattern must be a string")
    text = raw.strip()
    if not text.startswith("/"):
        raise ValueError(f"path pattern {raw!r} must start with '/'")
    for bad, why in (("?", "a query"), ("#", "a fragment"), ("\\", "a backslash"),
                     ("%", "a percent-escape (write the decoded text)")):
        if bad in text:
            raise ValueError(f"path pattern {raw!r} contains {why}")
    if has_control_chars(text):
        raise ValueError(f"path pattern {raw!r} contains control characters")
    segs = text.split("/")[1:]
    for i, seg in enumerate(segs):
        if seg == "" and i != len(segs) - 1:
            raise ValueError(f"path pattern {raw!r} contains an empty segment ('//')")
        if seg in (".", ".."):
            raise ValueError(f"path pattern {raw!r} contains a '{seg}' segment; write the "
                             "resolved path")
        if "**" in seg and seg != DOUBLE_STAR:
            raise ValueError(f"path pattern {raw!r}: '**' must be a whole segment, e.g. /v1/**")
        if "*" in seg and seg != DOUBLE_STAR and seg not in _GLOBS:
            _GLOBS[seg] = _compile_glob(seg)
    return PathPattern(text=text, segments=tuple(segs))


def _seg_match(pat: str, seg: str) -> bool:
    if "*" not in pat:
        return pat == seg
    rx = _GLOBS.get(pat)
    if rx is None:  # a pattern built without compile_path_pattern
        rx = _GLOBS[pat] = _compile_glob(pat)
    return rx.fullmatch(seg) is not None


def match_segments(segments: tuple[str, ...], normalised_path: str) -> bool:
    """Does a compiled pattern match an already normalised path?"""
    path = normalised_path[1:].split("/") if normalised_path.startswith("/") else [""]
    # Wildcard matching with `**` as the only multi-segment star: greedy with one backtrack
    # point, O(len(pattern) * len(path)).
    pi = si = 0
    star_pi = -1
    star_si = 0
    np, ns = len(segments), len(path)
    while si < ns:
        if pi < np and segments[pi] == DOUBLE_STAR:
            star_pi, star_si = pi, si
            pi += 1
        elif pi < np and _seg_match(segments[pi], path[si]):
            pi += 1
            si += 1
        elif star_pi >= 0:
            star_si += 1
            si = star_si
            pi = star_pi + 1
        else:
            return False
    while pi < np and segments[pi] == DOUBLE_STAR:
        pi += 1
    return pi == np
