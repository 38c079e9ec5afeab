"""The `gateways:` section: base-URL gateway entries, checked and compiled.

A prefix is matched literally against the raw request path (sandgate.gateway.route), so it is
restricted to plain segments: nothing a client or server could decode or resolve into another
spelling ('%', '.' and '..' segments, backslashes). Prefixes are unique across files, and none is
a whole-segment prefix of another: `/a` and `/a/b` would make `/a/b/x` ambiguous.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from sandgate.policy.model import Gateway, Source
from sandgate.policy.schema import GatewaySpec
from sandgate.request import split_authority

Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]  # (loc, message, fix)

_SEGMENT = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]*")
_HEADER = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers that cannot carry a token: framing, routing, hop-by-hop, and Sandgate's own.
_NOT_A_TOKEN_HEADER = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
    "keep-alive", "proxy-connection", "proxy-authorization", "http2-settings", "expect",
    "content-type", "content-encoding", "cookie",
})
TOKEN_HEADER_FIX = "use the header(s) the SDK puts its key in: x-api-key, authorization or " \
    "api-key"
PREFIX_FIX = "write it like /anthropic: a '/' and plain segments of letters, digits, '.', '_', " \
    "'~' and '-' (no trailing '/', no '.' or '..' segment, no '%')"


def check_prefix(prefix: str) -> str | None:
    """What is wrong with a prefix, or None."""
    if not prefix.startswith("/"):
        return f"prefix {prefix[:80]!r} does not start with '/'"
    if prefix == "/":
        return "prefix '/' would capture every path"
    if prefix.endswith("/"):
        return f"prefix {prefix[:80]!r} ends with '/'"
    for seg in prefix[1:].split("/"):
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            return f"prefix {prefix[:80]!r} has the segment {seg[:40]!r}, which is not plain"
    return None


def parse_upstream(text: str) -> tuple[str, int]:
    """`https://HOST[:PORT]` -> (normalised host, port). ValueError says what is wrong."""
    if any(c.isspace() for c in text):
        raise ValueError(f"upstream {text[:100]!r} contains whitespace")
    try:
        parts = urlsplit(text)
    except ValueError as e:
        raise ValueError(f"upstream {text[:100]!r} is malformed: {e}") from None
    if parts.scheme.lower() != "https":
        raise ValueError(f"upstream {text[:100]!r} is not https://: the upstream is always "
                         "dialled with TLS verified")
    if not parts.netloc:
        raise ValueError(f"upstream {text[:100]!r} has no host")
    if "@" in parts.netloc:
        raise ValueError(f"upstream {text[:100]!r} contains userinfo; credentials come from "
                         "the rules' injection")
    if parts.path not in ("", "/") or parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ValueError(f"upstream {text[:100]!r} has a path, query or fragment: the path "
                         "after the prefix is the upstream path")
    host, port = split_authority(parts.netloc, "https")
    return host, port


def compile_gateway(spec: GatewaySpec, loc: Loc, src: Source, report: Report) -> Gateway | None:
    ok = True
    problem = check_prefix(spec.prefix)
    if problem is not None:
        report((*loc, "prefix"), problem, PREFIX_FIX)
        ok = False
    host, port = "", 0
    try:
        host, port = parse_upstream(spec.upstream)
    except ValueError as e:
        report((*loc, "upstream"), str(e), "write https://HOST or https://HOST:PORT, e.g. "
               "https://api.anthropic.com")
        ok = False
    names = [spec.token_header] if isinstance(spec.token_header, str) else spec.token_header
    headers: list[str] = []
    if not names:
        report((*loc, "token_header"), "token_header is an empty list", TOKEN_HEADER_FIX)
        ok = False
    for i, raw in enumerate(names):
        where = (*loc, "token_header") if isinstance(spec.token_header, str) \
            else (*loc, "token_header", i)
        header = raw.strip().lower()
        if not _HEADER.fullmatch(header):
            report(where, f"{raw[:60]!r} is not a header name", TOKEN_HEADER_FIX)
            ok = False
        elif header in _NOT_A_TOKEN_HEADER or header.startswith("x-sandgate-"):
            report(where, f"header {header!r} cannot carry the token", TOKEN_HEADER_FIX)
            ok = False
        elif header in headers:
            report(where, f"header {header!r} is listed twice", "list each header once")
            ok = False
        headers.append(header)
    if not ok:
        return None
    return Gateway(prefix=spec.prefix, host=host, port=port, token_headers=tuple(headers),
                   source=src)


def overlapping(a: str, b: str) -> bool:
    """Would some path be under both prefixes (equal, or one a whole-segment prefix of the
    other)?"""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_overlaps(gateways: Sequence[tuple[Gateway, Callable[[str, str], None]]]) -> None:
    """Report every gateway whose prefix overlaps an earlier one (`problem(message, fix)`)."""
    seen: list[Gateway] = []
    for gw, problem in gateways:
        other = next((o for o in seen if overlapping(o.prefix, gw.prefix)), None)
        if other is not None:
            what = "is also" if other.prefix == gw.prefix else f"overlaps {other.prefix!r}"
            problem(f"gateway prefix {gw.prefix!r} {what} defined at {other.source}",
                    "give each gateway its own prefix, none a prefix of another "
                    "(e.g. /anthropic and /openai)")
            continue
        seen.append(gw)
