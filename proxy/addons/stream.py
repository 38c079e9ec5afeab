"""Scrub secret values from what an upstream sends back, without buffering the body."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from mitmproxy import http

from proxy.scrub import StreamScrubber, scrub_text

_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def scrub_headers(headers: http.Headers, secrets: Mapping[str, str]) -> int:
    if not secrets:
        return 0
    count = 0
    fields = list(headers.fields)
    for i, (k, v) in enumerate(fields):
        text, n = scrub_text(v.decode("latin-1"), secrets)
        if n:
            fields[i] = (k, text.encode("latin-1", "replace"))
            count += n
    if count:
        headers.fields = tuple(fields)
    return count


class ResponseScrubber:
    """A `flow.response.stream` callable: scrubbed chunks out, the end flushed on b"".

    Never returns an empty chunk (mitmproxy would frame it as the end of a chunked body); an
    empty list means "nothing to send yet".
    """

    def __init__(self, secrets: Mapping[str, str], encoding: str, resp: http.Response) -> None:
        self.refuse_reason: str | None = None
        self._inner = StreamScrubber({k: v.encode() for k, v in secrets.items() if v})
        self._decoder: zlib._Decompress | None = None
        self._active = bool(secrets)
        if not self._active:
            return
        # The replacement changes the body's length: let the framing follow the new body.
        resp.headers.pop("content-length", None)
        if resp.http_version == "HTTP/1.1" and "chunked" not in resp.headers.get(
            "transfer-encoding", ""
        ).lower():
            resp.headers["transfer-encoding"] = "chunked"
        if encoding in ("identity", ""):
            return
        wbits = _DECODERS.get(encoding)
        if wbits is None:
            self.refuse_reason = (
                f"the upstream sent a {encoding!r}-encoded body that Sandgate cannot scrub"
            )
            return
        self._decoder = zlib.decompressobj(wbits)
        resp.headers.pop("content-encoding", None)

    @property
    def replacements(self) -> int:
        return self._inner.replacements

    def __call__(self, chunk: bytes) -> list[bytes]:
        if not self._active:
            return [chunk] if chunk else []
        if chunk:
            data = self._decoder.decompress(chunk) if self._decoder else chunk
            out = self._inner.feed(data)
        else:
            tail = self._decoder.flush() if self._decoder else b""
            out = self._inner.feed(tail) + self._inner.flush()
        return [out] if out else []
