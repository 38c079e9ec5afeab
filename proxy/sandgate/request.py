"""The one request parser: what a caller asked for, as every judge of it sees it.

The proxy, `sandgate check`, `sandgate explain` and the admin API build `RequestInfo` only
through the functions here and judge it only with `sandgate.decision.decide`, so they cannot
disagree on a spelling. The addon passes the fields mitmproxy parsed; mitmproxy's own pure
authority parser splits `host:port`, so that it is split exactly as mitmproxy splits it.

Failures raise `BadRequest`, which is both a refusal (`bad_request` / `not_tls`) for the proxy
and a ValueError for the load-time and CLI callers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from mitmproxy.net.http import url

from sandgate.errors import BadRequest, Code
from sandgate.netguard import parse_ip_literal
from sandgate.policy.hosts import normalise_host
from sandgate.text import has_control_chars, percent_decode

DEFAULT_PORTS: dict[str, int] = {"https": 443, "http": 80}

_BRACKETED = re.compile(r"\[[^\[\]]*\](:[^:]*)?")
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def default_port(scheme: str) -> int:
    return DEFAULT_PORTS[scheme]


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a caller asked for.

    `host` is already normalised (see sandgate.policy.hosts.normalise_host); `path` is the raw
    request path without the query string: the decision normalises it itself so that every
    consumer judges the same spelling the same way. `query` is the query string's parameters,
    decoded once by `parse_query` (None: present but not readable unambiguously).
    """

    scheme: str  # "https" or "http"
    host: str
    port: int
    method: str  # upper case
    path: str
    query: tuple[tuple[str, str], ...] | None = ()
    # the protocol the request asks to switch to, lower case ("websocket", "h2c"...), or None;
    # set from the head by the proxy (sandgate.stages.forward.upgrade_asked), by explain and
    # fixtures from their `websocket` flag: a rule with mcp:/jsonrpc: judges it
    upgrade: str | None = None

    @property
    def target(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"


def _decode_component(raw: str) -> str | None:
    """%XX escapes decoded exactly once, as UTF-8; None when that is not unambiguous: a
    malformed escape, bytes that are not UTF-8, or a '+' (a space to form decoders, a plus to
    RFC 3986 ones: servers disagree)."""
    if "+" in raw:
        return None
    try:
        return percent_decode(raw, "query")
    except ValueError:
        return None


def parse_query(raw: str) -> tuple[tuple[str, str], ...] | None:
    """The query string's parameters as (name, value) pairs, each decoded once; the one query
    parser (parse_url and parse_proxied both use it). `a&b=` gives ("a", "") and ("b", "");
    empty pieces are skipped. None when some server could read it differently from this
    parser: a ';' (an old separator), a '#', or a name or value that does not decode
    unambiguously (see _decode_component). Rules with `query:` never match None."""
    if not raw:
        return ()
    if ";" in raw or "#" in raw:
        return None
    out: list[tuple[str, str]] = []
    for piece in raw.split("&"):
        if not piece:
            continue
        name, _, value = piece.partition("=")
        dn, dv = _decode_component(name), _decode_component(value)
        if dn is None or dv is None:
            return None
        out.append((dn, dv))
    return tuple(out)


def _bad(reason: str) -> BadRequest:
    return BadRequest(Code.BAD_REQUEST, reason)


def parse_method(method: str) -> str:
    m = method.strip().upper()
    if not m or not all(c in _TCHARS for c in m):
        raise _bad(f"{method[:40]!r} is not an HTTP method")
    return m


def has_dot_segment(path: str) -> bool:
    """Does the path have a `.` or `..` segment, read as the decision reads it (percent-decoded
    once, a backslash as a slash)?

    The decision judges the resolved path (`sandgate.policy.paths.normalise_path`) while the
    request goes on as sent, and an upstream need not resolve dot segments: S3 reads
    `/private-data/..%2Fagent-bucket/x` as a key in `private-data`, judged as
    `/agent-bucket/x`. Clients resolve them before sending (curl, browsers, every SDK), so
    only a crafted request has one: the decision refuses it (bad_request) rather than judge it
    as something else."""
    try:
        decoded = percent_decode(path.split("?", 1)[0], "path").replace("\\", "/")
    except ValueError:
        return False  # a bad escape: the decision refuses it, with its own reason
    return any(seg in (".", "..") for seg in decoded.split("/"))


def parse_url(method: str, url: str) -> RequestInfo:
    """`METHOD URL` as the proxy would see the request (for check, explain, fixtures, the API).

    Default port by scheme, host normalised, path raw (without query or fragment; "/" when
    empty). Refuses anything that is not an absolute http(s) URL without userinfo.
    """
    m = parse_method(method)
    if not url or any(c.isspace() for c in url) or has_control_chars(url):
        raise _bad(f"URL {url[:200]!r} is empty or contains spaces or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as e:  # unbalanced or invalid [IPv6] brackets
        raise _bad(f"URL {url!r} is malformed: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise _bad(f"URL {url!r} must start with https:// or http://")
    if not parts.netloc:
        raise _bad(f"URL {url!r} has no host")
    if "@" in parts.netloc:
        raise _bad(f"URL {url!r} contains userinfo ('user@'); credentials never go in URLs")
    if parts.netloc.startswith("[") and not _BRACKETED.fullmatch(parts.netloc):
        # urlsplit drops whatever follows ']' up to a ':' ("[::1]x" is "::1").
        raise _bad(f"URL {url!r}: only ':port' may follow a bracketed IPv6 host")
    try:
        port = parts.port
    except ValueError as e:
        raise _bad(f"URL {url!r} has a bad port: {e}") from None
    if port is None:
        if parts.netloc.endswith(":"):
            raise _bad(f"URL {url!r} has an empty port")
        port = default_port(scheme)
    if not 1 <= port <= 65535:
        raise _bad(f"URL {url!r} has port {port} out of range")
    hostname = parts.hostname
    if not hostname:
        raise _bad(f"URL {url!r} has no host")
    host = _host(f"[{hostname}]" if ":" in hostname else hostname, "host")
    path = parts.path or "/"
    if not path.startswith("/"):
        raise _bad(f"URL {url!r} has a relative path")
    return RequestInfo(scheme=scheme, host=host, port=port, method=m, path=path,
                       query=parse_query(parts.query))


def _host(raw: str, what: str) -> str:
    try:
        return normalise_host(raw)
    except ValueError as e:
        raise _bad(f"bad {what}: {e}") from None


def parse_header(name: str, value: str) -> tuple[str, str]:
    """A header a tool is given (`explain -H`, a fixture's `headers:`) as the proxy would see
    it: (lower-case name, value without surrounding spaces). Raises BadRequest for a name
    that is not an HTTP token or a value with control characters."""
    n = name.strip().lower()
    v = value.strip()
    if not _FIELD_NAME.fullmatch(n.encode("latin-1", "replace")):
        raise _bad(f"{name[:60]!r} is not an HTTP header name")
    if _FIELD_VALUE_BAD.search(v.encode("utf-8")):
        raise _bad(f"the value of header {n!r} contains a control character")
    return n, v


def parse_header_line(line: str) -> tuple[str, str]:
    """`Name: value` (curl's -H spelling) -> parse_header(name, value)."""
    name, colon, value = line.partition(":")
    if not colon:
        raise _bad(f"header {line[:60]!r} is not 'Name: value'")
    return parse_header(name, value)


def split_authority(authority: str, scheme: str) -> tuple[str, int]:
    """`host[:port]` (IPv6 in brackets) -> (normalised host, port or the scheme's default)."""
    try:
        host, port = url.parse_authority(authority, check=True)
    except ValueError:
        raise _bad(f"bad authority {authority[:100]!r}") from None
    if port is None:
        port = default_port(scheme)
    elif not 0 < port < 65536:
        raise _bad(f"bad authority {authority[:100]!r}: port out of range")
    return _host(host, "host"), port


def parse_proxied(scheme: str, host: str, port: int, method: str, path_and_query: str,
                  host_header: str | None) -> RequestInfo:
    """The request the proxy received, as the policy sees it; refuses an inconsistent one.

    `host`/`port` are the request target's; `host_header` (Host or :authority) must name the
    same origin, or the upstream could route on something that was never judged.
    """
    h = _host(host, "host")
    if host_header is not None:
        hh_host, hh_port = split_authority(host_header, scheme)
        if hh_host != h or hh_port != port:
            raise _bad(f"the Host header ({host_header[:100]}) disagrees with the request "
                       f"target ({h}:{port})")
    path, _, query = path_and_query.partition("?")
    return RequestInfo(scheme, h, port, parse_method(method), path, parse_query(query))


def check_tunnel(info: RequestInfo, tunnel_host: str, tunnel_port: int, tls: bool,
                 sni: str | None) -> None:
    """A request inside a CONNECT tunnel must stay what the CONNECT (and the SNI) named."""
    if not tls:
        raise BadRequest(Code.NOT_TLS, f"the CONNECT tunnel to {tunnel_host}:{tunnel_port} does "
                         "not carry TLS")
    if info.host != tunnel_host or info.port != tunnel_port:
        raise _bad(f"the request for {info.host}:{info.port} disagrees with the CONNECT target "
                   f"{tunnel_host}:{tunnel_port}")
    if sni is None:
        if parse_ip_literal(tunnel_host) is None:
            raise _bad("the TLS handshake carried no SNI")
    elif not same_host(sni, tunnel_host):
        raise _bad(f"the TLS SNI ({sni[:100]}) disagrees with the CONNECT target ({tunnel_host})")


def same_host(a: str, b: str) -> bool:
    """Do two spellings name the same host? Unparseable spellings name nothing."""
    try:
        return normalise_host(a) == normalise_host(b)
    except ValueError:
        return False


# RFC 9110 5.1 / 5.5: a field name is a token; a field value is VCHAR, obs-text, SP and HTAB.
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# A request target re-serialised into an HTTP/1 request line must not split it.
_TARGET_BAD = re.compile(r"[\x00-\x20\x7f]")


def check_head(method: str, path: str, fields: Iterable[tuple[bytes, bytes]]) -> None:
    """Refuse a request whose head would not re-serialise to exactly what was judged.

    mitmproxy parses a request (HTTP/1, HTTP/2) and serialises it again for the upstream,
    possibly as HTTP/1: a CR or LF that HTTP/2 let through in a header value or the path would
    end the line there, and the upstream would read a second request nobody judged.
    """
    if not method or not all(c in _TCHARS for c in method):
        raise _bad(f"the method {method[:40]!r} is not an HTTP token")
    if _TARGET_BAD.search(path):
        raise _bad("the request target contains a space or a control character")
    for name, value in fields:
        if not _FIELD_NAME.fullmatch(name):
            raise _bad(f"the header name {name[:60]!r} is not a valid HTTP field name")
        if _FIELD_VALUE_BAD.search(value):
            raise _bad(f"the value of header {name[:60].decode('ascii')!r} contains CR, LF, NUL "
                       "or another control character")
