"""Scrub secret values from what an upstream sends back, without buffering the body."""

from __future__ import annotations

import re
import zlib

from mitmproxy import http
from mitmproxy.net.http import status_codes

from sandgate.refusal import REASON_HEADER
from sandgate.scrub import SecretSet

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def clean_head(resp: http.Response, secrets: SecretSet) -> int:
    """The response head as the sandbox may see it; returns the number of redactions.

    The reason phrase is the standard one for the status (an upstream can put anything there,
    a secret included); Sandgate's own reason header is removed (only Sandgate sets it); a header
    whose value holds a control character (a bare CR would split the line for an HTTP/1 client)
    is dropped; every other value is scrubbed.
    """
    resp.reason = status_codes.RESPONSES.get(resp.status_code, "")
    reserved = REASON_HEADER.lower().encode()
    resp.headers.fields = tuple(
        (k, v) for k, v in resp.headers.fields
        if k.lower() != reserved and not _CONTROL.search(v))
    return scrub_headers(resp.headers, secrets)


def scrub_headers(headers: http.Headers, secrets: SecretSet) -> int:
    """Scrub header values as the bytes they are (a non-ASCII secret is matched as UTF-8)."""
    if secrets.empty:
        return 0
    count = 0
    fields = list(headers.fields)
    for i, (k, v) in enumerate(fields):
        clean, n = secrets.scrub(v)
        if n:
            fields[i] = (k, clean)
            count += n
    if count:
        headers.fields = tuple(fields)
    return count


class ResponseScrubber:
    """A `flow.response.stream` callable: scrubbed chunks out, the end flushed on b"".

    Never returns an empty chunk (mitmproxy would frame it as the end of a chunked body); an
    empty list means "nothing to send yet".
    """

    def __init__(self, secrets: SecretSet, encoding: str, resp: http.Response,
                 client_version: str = "HTTP/1.1") -> None:
        self.refuse_reason: str | None = None
        self._inner = secrets.scrubber()
        self._decoder: zlib._Decompress | None = None
        self._active = not secrets.empty
        if not self._active:
            return
        # The replacement changes the body's length: let the framing follow the new body. An
        # HTTP/1.1 client gets it chunked even from an HTTP/1.0 upstream: a close-delimited body
        # ends with a connection close that TLS clients such as wget report as truncation.
        resp.headers.pop("content-length", None)
        if client_version == "HTTP/1.1" and resp.http_version in ("HTTP/1.0", "HTTP/1.1"):
            resp.http_version = "HTTP/1.1"
            if "chunked" not in resp.headers.get("transfer-encoding", "").lower():
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


# A response with a known length up to this size is read whole, scrubbed and sent with its exact
# new length: its framing never changes (clients that check lengths stay happy) and it costs one
# pass. Larger or unknown-length bodies stream (server-sent events must not wait).
WHOLE_BODY_LIMIT = 1024 * 1024
_DECODED_LIMIT = 64 * 1024 * 1024


def scrub_whole_candidate(resp: http.Response, secrets: SecretSet) -> bool:
    if secrets.empty or "transfer-encoding" in resp.headers:
        return False
    try:
        length = int(resp.headers.get("content-length", ""))
    except ValueError:
        return False
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    return 0 <= length <= WHOLE_BODY_LIMIT and (encoding in ("", "identity")
                                                  or encoding in _DECODERS)


def scrub_whole(resp: http.Response, secrets: SecretSet) -> int:
    """Scrub a buffered body (decoded if gzip/deflate) and set its exact length; the count.

    Raises ValueError when the body cannot be decoded within bounds (the caller drops it).
    """
    raw = resp.raw_content or b""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    wbits = _DECODERS.get(encoding)
    if wbits is not None and raw:
        decoder = zlib.decompressobj(wbits)
        try:
            raw = decoder.decompress(raw, _DECODED_LIMIT)
        except zlib.error:
            raise ValueError(f"the upstream's {encoding} body is corrupt") from None
        if decoder.unconsumed_tail:
            raise ValueError(f"the upstream's {encoding} body decodes to more than Sandgate "
                             "inspects")
        resp.headers.pop("content-encoding", None)
    clean, count = secrets.scrub(raw)
    resp.raw_content = clean
    resp.headers["content-length"] = str(len(clean))
    return count
