"""Scrub secret values from what an upstream sends back, without buffering the body.

Bodies are decoded first (gzip, deflate, br, zstd, stacked: `sandgate.scrub.decoding`) and
scrubbed with line breaks inside a form ignored (MIME's wrapped base64 and quoted-printable:
`sandgate.scrub.unwrap`). A body in a coding Sandgate cannot decode gets a readable 502 instead
(`answer_instead`), never a cut connection.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mitmproxy import http
from mitmproxy.net.http import status_codes

from sandgate.refusal import APPROVAL_HEADER, REASON_HEADER, Refusal
from sandgate.scrub.decoding import Decoder, codings, decode_all, unsupported
from sandgate.scrub.deltas import stream_format
from sandgate.scrub.joined import EventStream
from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.unwrap import applies_to, scrub_unwrapped, unwrapping_scrubber

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def clean_head(resp: http.Response, secrets: SecretSet) -> int:
    """The response head as the sandbox may see it; returns the number of redactions.

    The reason phrase is the standard one for the status (an upstream can put anything there,
    a secret included); Sandgate's own reason and approval headers are removed (only Sandgate
    sets them); a header whose value holds a control character (a bare CR would split the line
    for an HTTP/1 client) is dropped; every other value is scrubbed.
    """
    resp.reason = status_codes.RESPONSES.get(resp.status_code, "")
    reserved = (REASON_HEADER.lower().encode(), APPROVAL_HEADER.lower().encode())
    resp.headers.fields = tuple(
        (k, v) for k, v in resp.headers.fields
        if k.lower() not in reserved and not _CONTROL.search(v))
    return scrub_headers(resp.headers, secrets)


def scrub_headers(headers: http.Headers, secrets: SecretSet) -> int:
    """Scrub header values as the bytes they are (a non-ASCII secret is matched as UTF-8), and
    drop every field whose name carries a secret in any form and any letter case (a name is a
    channel too, and HTTP/2 lower-cases it: no marker can stand in a name, so the field goes).
    """
    if secrets.empty:
        return 0
    if not secrets.find(b"\x00".join(k for k, _ in headers.fields)) and \
            not secrets.matches(b"\x00".join(v for _, v in headers.fields), final=True)[0]:
        return 0  # nothing in the names (values) joined, so nothing in any: two scans, not 2n
    count = 0
    fields: list[tuple[bytes, bytes]] = []
    for k, v in headers.fields:
        if secrets.find(k):
            count += 1
            continue
        clean, n = secrets.scrub(v)
        fields.append((k, clean))
        count += n
    if count:
        headers.fields = tuple(fields)
    return count


class ResponseScrubber:
    """A `flow.response.stream` callable: scrubbed chunks out, the end flushed on b"".

    A stream of events (SSE, NDJSON, JSON text sequences, Gemini's JSON array: `path` is the
    request's) is scrubbed as bytes first, then of what a client joins across its events
    (`sandgate.scrub.joined`). Never returns an empty chunk (mitmproxy would frame it as the end
    of a chunked body); an empty list means "nothing to send yet".
    """

    def __init__(self, secrets: SecretSet, encoding: str, resp: http.Response,
                 client_version: str = "HTTP/1.1", path: str = "") -> None:
        self.refuse_reason: str | None = None
        ctype = resp.headers.get("content-type", "")
        self._inner = (unwrapping_scrubber(secrets)
                       if applies_to(ctype) else secrets.scrubber())
        fmt = stream_format(ctype, path)
        self._events = EventStream(secrets, fmt) if fmt is not None else None
        self._decoder: Decoder | None = None
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
        chain = codings(encoding)
        if not chain:
            return
        self.refuse_reason = unsupported(chain)
        if self.refuse_reason is None:
            self._decoder = Decoder(chain)
            resp.headers.pop("content-encoding", None)

    @property
    def replacements(self) -> int:
        joined = self._events.replacements if self._events is not None else 0
        return self._inner.replacements + joined

    def __call__(self, chunk: bytes) -> list[bytes]:
        if not self._active:
            return [chunk] if chunk else []
        if self._decoder is None:
            outs = [self._inner.feed(chunk) if chunk else self._inner.flush()]
        else:
            pieces = self._decoder.feed(chunk) if chunk else self._decoder.end()
            outs = [self._inner.feed(piece) for piece in pieces]
            if not chunk:
                outs.append(self._inner.flush())
        if self._events is not None:
            events = self._events
            outs = [events.feed(out) for out in outs]
            if not chunk:
                outs.append(events.flush())
        return [out for out in outs if out]


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
    chain = codings(resp.headers.get("content-encoding", ""))
    return 0 <= length <= WHOLE_BODY_LIMIT and unsupported(chain) is None


def scrub_whole(resp: http.Response, secrets: SecretSet, path: str = "") -> int:
    """Scrub a buffered body (decoded first: `sandgate.scrub.decoding`) and set its exact
    length; the count. A stream of events is scrubbed of its joined text too, as it would be
    streaming (`ResponseScrubber`; `path` is the request's).

    Raises ValueError when the body cannot be decoded within bounds (the caller refuses it).
    """
    raw = resp.raw_content or b""
    chain = codings(resp.headers.get("content-encoding", ""))
    if chain:
        if raw:
            raw = decode_all(raw, chain, _DECODED_LIMIT)
        resp.headers.pop("content-encoding", None)
    if applies_to(resp.headers.get("content-type", "")):
        clean, count = scrub_unwrapped(secrets, raw)
    else:
        clean, count = secrets.scrub(raw)
    fmt = stream_format(resp.headers.get("content-type", ""), path)
    if fmt is not None and not secrets.empty:
        events = EventStream(secrets, fmt)
        clean = events.feed(clean) + events.flush()
        count += events.replacements
    resp.raw_content = clean
    resp.headers["content-length"] = str(len(clean))
    return count


def answer_instead(resp: http.Response, refusal: Refusal,
                   http1: bool) -> Callable[[bytes], list[bytes]]:
    """Turn an upstream response whose head has arrived into `refusal` (a readable answer
    instead of a cut connection): its head is replaced now, and the returned stream callable
    sends the refusal's body once and discards every byte of the upstream's."""
    body = refusal.body()
    resp.status_code = refusal.status
    resp.reason = status_codes.RESPONSES.get(refusal.status, "")
    resp.headers = http.Headers([(k.encode(), v.encode()) for k, v in refusal.headers().items()])
    resp.headers["content-length"] = str(len(body))
    if http1:
        resp.headers["connection"] = "close"  # the rest of the upstream's body is not relayed
    sent = False

    def stream(chunk: bytes) -> list[bytes]:
        nonlocal sent
        if sent:
            return []
        sent = True
        return [body]

    return stream
