"""What is judged is what is forwarded: the request head as the upstream will receive it.

mitmproxy parses a request and serialises it again for the upstream, possibly in another HTTP
version. These functions make the re-serialisation carry nothing the decision did not see:
origin-form targets, no hop-by-hop or reserved headers, framing recomputed from the body that
was inspected, no trailers, and only the protocol switch that is judged (WebSocket).
"""

from __future__ import annotations

from collections.abc import Iterable

from mitmproxy import http
from mitmproxy.net.http import url

from sandgate.errors import BadRequest, Code
from sandgate.request import RequestInfo, split_authority
from sandgate.scrub.decoding import TooLarge, codings, decode_all, unsupported

RESERVED_PREFIX = b"x-sandgate-"

# RFC 9110 7.6.1: meaningful for one connection only; never forwarded as the client sent them.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"te", b"transfer-encoding",
                         b"upgrade", b"http2-settings", b"trailer"})
# Proxy-Authorization, Proxy-Connection...: meant for the proxy (Sandgate's own credentials
# among them), never for the upstream.
_PROXY_PREFIX = b"proxy-"

def is_websocket_upgrade(req: http.Request) -> bool:
    return (req.method == "GET"
            and req.headers.get("upgrade", "").strip().lower() == "websocket"
            and "upgrade" in req.headers.get("connection", "").lower())


def upgrade_asked(req: http.Request) -> str | None:
    """The protocol the request asks to switch to, lower case, for the decision (a rule with
    mcp:/jsonrpc: judges it): "websocket" for a WebSocket handshake, else the first token of
    `Upgrade` ("h2c"...), "h2c" for an HTTP2-Settings alone; None when it asks for none."""
    if is_websocket_upgrade(req):
        return "websocket"
    if "upgrade" not in req.headers and "http2-settings" not in req.headers:
        return None
    first = req.headers.get("upgrade", "").split(",")[0].strip().lower()
    return first[:64] or "h2c"


def check_upgrade(req: http.Request) -> None:
    """Only WebSocket may switch protocols: its messages are scrubbed and checked; h2c and any
    other protocol would be a raw relay to the upstream that no hook judges."""
    if "upgrade" in req.headers or "http2-settings" in req.headers:
        if not is_websocket_upgrade(req):
            raise BadRequest(Code.BAD_REQUEST, "protocol upgrades other than WebSocket are not "
                             "allowed through Sandgate")


def check_authority(req: http.Request, info: RequestInfo) -> None:
    """An absolute-form target must name the judged origin; it is then sent in origin form.

    A front end shared by many sites routes on the absolute URI rather than on Host, so a
    request judged for one host must not name another in its target.
    """
    authority = req.authority
    if authority:
        host, port = split_authority(authority, info.scheme)
        if (host, port) != (info.host, info.port):
            raise BadRequest(Code.BAD_REQUEST, f"the request target names {host}:{port}, not the "
                             f"judged origin {info.host}:{info.port}")
    if not req.path.startswith("/") and not (req.method == "OPTIONS" and req.path == "*"):
        raise BadRequest(Code.BAD_REQUEST, "the request target must be a path (origin form)")


def inspectable_body(req: http.Request, limit: int) -> bytes:
    """The request body as the upstream will interpret it, decoded for the leak scan.

    Every coding the upstream may undo is undone here, with the same decoders as a response's
    (`sandgate.scrub.decoding`): stacked codings (``gzip, br``) layer by layer, every member
    of a multi-member gzip body (a server reading one member only would be the exception, and a
    key in the second member must not pass unseen), deflate, br and zstd. What cannot be
    decoded is refused, never forwarded unread: an unknown coding or a corrupt or truncated
    body (400 bad_request), more than `limit` decoded bytes (413 too_large: no decompression bomb).
    """
    raw = req.raw_content or b""
    header = req.headers.get("content-encoding", "")
    chain = codings(header)
    if not chain or not raw:
        return raw
    named = ", ".join(chain)
    if unsupported(chain) is not None:
        raise BadRequest(Code.BAD_REQUEST, f"request bodies with content-encoding {named} "
                         "cannot be inspected; send identity, gzip, deflate, br or zstd "
                         "(or a stack of them)")
    try:
        return decode_all(raw, chain, limit, whole=True)
    except TooLarge:
        raise BadRequest(Code.TOO_LARGE, f"the request body decodes ({named}) to more than "
                         f"this proxy accepts ({limit} bytes); send it smaller or "
                         "uncompressed") from None
    except ValueError:
        raise BadRequest(Code.BAD_REQUEST, f"the {named} request body is corrupt (it does not "
                         "decode as its Content-Encoding says); nothing was sent") from None


def _nominated(fields: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names every Connection header nominates as hop-by-hop."""
    return frozenset(t.strip().lower() for name, value in fields
                     if name.lower() == b"connection" for t in value.split(b","))


def forwarded_fields(fields: Iterable[tuple[bytes, bytes]],
                     keep: frozenset[bytes] = frozenset()) -> tuple[tuple[bytes, bytes], ...]:
    """The header fields that go on to the upstream, in order: without reserved
    `X-Sandgate-*`, `Proxy-*` and hop-by-hop ones (and those `Connection` nominates), except
    the lowercase names in `keep`. Pure: also what an approval binds (sandgate.approvals)."""
    fields = tuple(fields)
    nominated = _nominated(fields)
    out = []
    for name, value in fields:
        low = name.lower()
        if low.startswith((RESERVED_PREFIX, _PROXY_PREFIX)):
            continue
        if (low in _HOP_BY_HOP or low in nominated) and low not in keep:
            continue
        out.append((name, value))
    return tuple(out)


def prepare(req: http.Request, websocket: bool, info: RequestInfo | None = None) -> None:
    """Make the head the upstream receives exactly the one that was judged.

    Called after the decision and before injection: origin form, hop-by-hop headers (and the
    ones `Connection` nominates), `Proxy-*` and reserved `X-Sandgate-*` headers removed
    (`forwarded_fields`), trailers dropped, framing recomputed from the buffered body.
    """
    nominated = _nominated(req.headers.fields)
    keep = frozenset({b"connection", b"upgrade"}) if websocket else frozenset()
    req.headers.fields = forwarded_fields(req.headers.fields, keep)
    if websocket:
        req.headers["connection"] = "Upgrade"
    elif b"close" in nominated:
        # mitmproxy reads the client's wish to close from this same header; the upstream may
        # as well close too.
        req.headers["connection"] = "close"
    if req.http_version.startswith("HTTP/1"):
        req.authority = ""  # origin form; check_authority made sure it named the judged origin
        if info is not None and "host" not in req.headers:
            # An HTTP/1.0 request may leave Host out; it was judged as `info` (the tunnel's or
            # the URL's origin), so the upstream gets that origin, not its default site.
            req.headers.insert(0, "Host", url.hostport(info.scheme, info.host, info.port))
    req.trailers = None
    # The body was read whole; say exactly how long it is (an HTTP/2 body without a length
    # would otherwise reach an HTTP/1 upstream unframed, and be read as the next request).
    body = req.raw_content
    if body or "content-length" in req.headers or req.method in ("POST", "PUT", "PATCH"):
        req.headers["content-length"] = str(len(body or b""))
