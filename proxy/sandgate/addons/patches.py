"""Three corrections to mitmproxy 11.0.2 that no addon hook can make, installed once at start.

1. Error pages. mitmproxy answers protocol failures itself (a malformed upstream status line, a
   dial or TLS failure, an oversized body) with an HTML page that quotes the offending bytes:
   an upstream that echoes a secret into a broken status line would get it to the sandbox, and
   no hook can replace that page. Every such page becomes Sandgate's JSON refusal with a fixed
   reason (the audit event keeps mitmproxy's message, scrubbed).
2. HTTP/1 trailers. mitmproxy's HTTP/1 body reader raises NotImplementedError on chunked
   trailers, which kills the connection handler and leaves the client hanging. They are
   dropped instead (what no hook judged or scrubbed must not travel anyway).
3. The body size limit applies to requests only. mitmproxy's `body_size_limit` also turns a
   large response with a known length into a 502; Sandgate never buffers responses (they are
   streamed through the scrubber), so the limit only has to bound what is buffered before a
   request is judged. The exception, a response an addon reads whole although its length is
   not known in advance (the answer to an MCP initialize: addons/calls.py), is marked
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

from sandgate.addons import wscontrol
from sandgate.errors import Code
from sandgate.refusal import REASON_HEADER, Refusal

_MARK = "_sandgate_patched"
# flow.metadata key: this response is buffered whole, so body_size_limit bounds it (patch 3)
READ_WHOLE = "sandgate_read_whole"

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


def _format_error(status_code: int, message: str) -> bytes:
    return error_refusal(status_code).body()


def _make_error_response(status_code: int, message: str = "") -> bytes:
    refusal = error_refusal(status_code)
    headers = {**refusal.headers(), "connection": "close"}
    return bytes(http1.assemble_response(
        http.Response.make(refusal.status, refusal.body(), headers)))


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
            status = headers[0]
            code = error_refusal(int(status[1])).code
            headers = [status, (b"content-type", b"application/json"),
                       (REASON_HEADER.lower().encode(), str(code).encode())]
        return original_send_headers(self, stream_id, headers, *args, **kwargs)

    _http_h2.BufferedH2Connection.send_headers = send_headers

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
    # 4. WebSocket ping, pong and close payloads are judged like messages (addons/wscontrol)
    wscontrol.install()
    setattr(_http1, _MARK, True)


def installed() -> bool:
    return bool(getattr(_http1, _MARK, False)) and wscontrol.installed()
