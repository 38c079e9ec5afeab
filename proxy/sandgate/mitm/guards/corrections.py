"""Three corrections to mitmproxy 12.3.1 that no addon hook can make, installed once at start.

1. Error pages. mitmproxy answers protocol failures itself (a malformed upstream status line, a
   dial or TLS failure, an oversized body) with an HTML page that quotes the offending bytes:
   an upstream that echoes a secret into a broken status line would get it to the sandbox, and
   no hook can replace that page. Every such page becomes Sandgate's JSON refusal with a fixed
   reason (the audit event keeps mitmproxy's message, scrubbed). mitmproxy 12's error codes
   (`ErrorCode.http_status_code`) have no 504: an error whose message carries `TIMEOUT_MARK`
   (a timeout Sandgate imposed upstream, mitm/guards/wirelimits.py) is answered 504 here, on HTTP/1
   and HTTP/2.
2. HTTP/1 trailers. mitmproxy's HTTP/1 body reader raises NotImplementedError on chunked
   trailers, which kills the connection handler and leaves the client hanging. They are
   dropped instead (what no hook judged or scrubbed must not travel anyway).
3. The body size limit applies to requests only. mitmproxy's `body_size_limit` also turns a
   large response with a known length into a 502; Sandgate never buffers responses (they are
   streamed through the scrubber), so the limit only has to bound what is buffered before a
   request is judged. The exception, a response an addon reads whole although its length is
   not known in advance (the answer to an MCP initialize: stages/rpccalls.py), is marked
   `READ_WHOLE` in the flow's metadata and held to the same limit (past it: a 502).

`install()` is idempotent; `installed()` lets a test pin that these attributes still exist, so
a mitmproxy upgrade that moves them fails loudly instead of silently reopening a channel.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import h11
from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import _http1, _http2, _http3, _http_h2
from mitmproxy.proxy.layers.http._events import ResponseProtocolError

from sandgate.errors import Code
from sandgate.refusal import REASON_HEADER, Refusal

_MARK = "_sandgate_patched"
# flow.metadata key: this response is buffered whole, so body_size_limit bounds it (patch 3)
READ_WHOLE = "sandgate_read_whole"

# In every error message of a timeout Sandgate imposed upstream: answered 504.
TIMEOUT_MARK = "sandgate: upstream timeout"
_H2_STATUS = "_sandgate_error_status"  # on a BufferedH2Connection, while an error is sent

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


_CODE_FOR_STATUS = {400: Code.BAD_REQUEST, 413: Code.TOO_LARGE, 504: Code.UPSTREAM_TIMEOUT}
_REASONS = {
    Code.BAD_REQUEST: "the request could not be parsed or is not valid HTTP",
    Code.TOO_LARGE: "the request body is larger than this proxy accepts",
    Code.UPSTREAM_ERROR: "the upstream failed, or sent a response Sandgate will not forward",
    Code.UPSTREAM_TIMEOUT: "the upstream did not answer in time",
}


def error_refusal(status: int) -> Refusal:
    """The refusal that replaces mitmproxy's error page for `status` (no upstream bytes)."""
    code = _CODE_FOR_STATUS.get(status, Code.UPSTREAM_ERROR)
    return Refusal(code, _REASONS[code])


def error_status(status: int, message: str) -> int:
    """The status of mitmproxy's error `status` with `message`: 504 for Sandgate's timeouts."""
    return 504 if TIMEOUT_MARK in message else status


def _format_error(status_code: int, message: str) -> bytes:
    return error_refusal(error_status(status_code, message)).body()


def _make_error_response(status_code: int, message: str = "") -> bytes:
    refusal = error_refusal(error_status(status_code, message))
    headers = {**refusal.headers(), "connection": "close"}
    return bytes(http1.assemble_response(
        http.Response.make(refusal.status, refusal.body(), headers)))


def _h2_error_status(original: Any) -> Any:
    """Http2Connection._handle_event, telling its BufferedH2Connection (`_H2_STATUS`) that the
    error page it sends for a Sandgate timeout is a 504."""
    def _handle_event(self: Any, event: Any) -> Generator[Any, Any, None]:
        if not (isinstance(event, ResponseProtocolError) and TIMEOUT_MARK in event.message):
            yield from original(self, event)
            return
        setattr(self.h2_conn, _H2_STATUS, 504)
        try:
            yield from original(self, event)
        finally:
            setattr(self.h2_conn, _H2_STATUS, None)

    return _handle_event


class _NoTrailers:
    """An HTTP/1 body reader that ends the message without its trailers instead of raising."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, buf: Any) -> Any:
        event = self._inner(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            return h11.EndOfMessage()
        return event

    def read_eof(self) -> Any:
        return self._inner.read_eof()


def install() -> None:
    if getattr(_http1, _MARK, False):
        return
    # 1. error pages, HTTP/1 and HTTP/2/3 (h2 also sends a fixed content-type header)
    _http1.make_error_response = _make_error_response
    # (module globals looked up at call time; setattr because they are not re-exported names)
    setattr(_http2, "format_error", _format_error)  # noqa: B010
    setattr(_http3, "format_error", _format_error)  # noqa: B010
    original_send_headers = _http_h2.BufferedH2Connection.send_headers

    def send_headers(self: Any, stream_id: int, headers: Any, *args: Any, **kwargs: Any) -> Any:
        if (isinstance(headers, list) and len(headers) == 3
                and headers[2] == (b"content-type", b"text/html")
                and headers[1][0] == b"server"):
            status = getattr(self, _H2_STATUS, None) or int(headers[0][1])
            code = error_refusal(status).code
            headers = [(b":status", b"%d" % status), (b"content-type", b"application/json"),
                       (REASON_HEADER.lower().encode(), str(code).encode())]
        return original_send_headers(self, stream_id, headers, *args, **kwargs)

    _http_h2.BufferedH2Connection.send_headers = send_headers  # type: ignore[method-assign]
    # the status of the error page the next send_headers makes (its message is not passed)
    _http2.Http2Connection._handle_event = _h2_error_status(  # type: ignore[method-assign]
        _http2.Http2Connection._handle_event)

    # 2. HTTP/1 trailers
    original_reader = _http1.make_body_reader

    def make_body_reader(expected_size: int | None) -> Any:
        return _NoTrailers(original_reader(expected_size))

    _http1.make_body_reader = make_body_reader

    # 3. body_size_limit for requests only
    stream_cls = http_layer.HttpStream
    original_check = stream_cls.check_body_size

    def check_body_size(self: Any, request: bool) -> Generator[Any, Any, bool]:
        if not request and not self.flow.metadata.get(READ_WHOLE):
            return False
        return (yield from original_check(self, request))

    stream_cls.check_body_size = check_body_size  # type: ignore[method-assign]
    setattr(_http1, _MARK, True)


def installed() -> bool:
    return bool(getattr(_http1, _MARK, False))
