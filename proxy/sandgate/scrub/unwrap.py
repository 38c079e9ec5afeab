"""Scrub secrets that a line break cuts in two: MIME's wrapped base64 and quoted-printable.

A MIME body wraps base64 at 76 columns and quoted-printable with soft line breaks (``=`` at a
line's end), so the break can fall inside a key's encoding; any MIME library, and ``base64 -d``,
joins the lines again. Listing every wrapped spelling in the automaton would take one form per
break position and width (an encoder may wrap at any width). Decoding the parts with the
``email`` package would need the whole body. Instead the scrub runs over the body as if single
line breaks were not there: a *view* with every lone line break (``\\n``, ``\\r\\n`` or ``\\r``,
with the ``=`` before it when there is one) taken out, matched by the same automaton, and each
match replaced in the real bytes together with the breaks inside it. Two or more breaks in a
row (a blank line: the end of a server-sent event, a MIME boundary's surroundings) are kept in
the view, so they still end every candidate match and nothing is held back across them.

Quoted-printable may escape any byte as ``=XX`` (RFC 2045 6.7 rule 1: "any octet"), in
either hex case as decoders take it, so a key with only its ``/`` written ``=2F`` is one of
3^n spellings: no list of forms covers them. The view decodes every ``=XX`` escape to its byte
instead, and a match maps back to the three bytes of each escape it covers. A secret whose own
text holds ``=XX`` or line breaks (a PEM key) is matched in the view by its view spelling,
which `SecretSet` adds to its needles (`view_text`). A literal ``=`` before a value that starts
with two hex digits (``token=ab12...``) reads as an escape to that view, so when it decoded an
escape the view that only joins lines is matched as well, and the leftmost, longest match of
the two wins.

Streaming stays bounded and linear: at most two automaton passes over the views, and what is
held back is what could still become a needle in a view (fewer than max_len view bytes, plus
the single breaks and escapes between them; a run of breaks ends a candidate) plus a trailing
``=`` or ``=X`` that may begin a soft break or an escape; a stop never splits an escape.
Quoted-printable forms with the usual escapes are listed as forms too
(`sandgate.secrets.forms`, kind "qp"): the plain scrub of a binary body has no view.
"""

from __future__ import annotations

import functools

from sandgate.scrub.scrubber import SecretSet, StreamScrubber
from sandgate.scrub.view import ESCAPE, HEX, View


def _scan(secrets: SecretSet, data: bytes, *, final: bool) -> tuple[list[bytes], int, int]:
    """`SecretSet._scan` over the view: (pieces of `data`, replacements, stop in `data`)."""
    cut = len(data)
    if not final and data.endswith(b"="):
        cut -= 1  # may be the start of a soft break or an escape: decide with what follows
    elif not final and len(data) >= 2 and data[-2] == 0x3D and data[-1] in HEX:
        cut -= 2  # may be an escape
    head = data[:cut]
    view = View(head)
    spans, end = _spans(secrets, view, cut, final)
    if view.decoded:
        # A value right after a literal "=" reads as an escape to the view when it starts with
        # two hex digits ("token=ab12...", "=" then a wrapped base64 line): the view that only
        # joins lines is matched too, and the leftmost, longest match wins.
        lines, lines_end = _spans(secrets, View(head, escapes=False), cut, final)
        end = min(end, lines_end)
        for back in (1, 2):  # never stop inside an escape: the held rest would read otherwise
            q = end - back
            if q >= 0 and head[q] == 0x3D and ESCAPE.match(head, q):
                end = q
                break
        spans = _leftmost(spans + lines, end)
    pieces: list[bytes] = []
    pos = 0
    for begin, finish, replacement in spans:
        pieces.append(head[pos:begin])
        pieces.append(replacement)
        pos = finish
    end = max(end, pos)  # a match decided before the stop may reach past it
    pieces.append(head[pos:end])
    return pieces, len(spans), end


def _spans(secrets: SecretSet, view: View, cut: int, final: bool
           ) -> tuple[list[tuple[int, int, bytes]], int]:
    """What a scrub of the view replaces, as (begin, end, replacement) in the data, and where
    it stops deciding, in the data."""
    found, stop = secrets.matches(view.text, final=final)
    spans = [(view.origin(at), view.end(at + n - 1), r) for at, n, r in found]
    return spans, view.origin(stop) if stop < len(view.text) else cut


def _leftmost(spans: list[tuple[int, int, bytes]], stop: int) -> list[tuple[int, int, bytes]]:
    """The replacements a scrub makes from two lists of matches (each already leftmost, longest
    and final before its own stop): leftmost first, the longest at one start, none overlapping,
    none starting at or after `stop` (undecided there)."""
    out: list[tuple[int, int, bytes]] = []
    pos = 0
    for span in sorted(spans, key=lambda m: (m[0], -m[1])):
        if span[0] >= stop:
            break
        if span[0] >= pos:
            out.append(span)
            pos = span[1]
    return out


# Media types that are binary by definition: no MIME part or wrapped text is expected inside,
# and their bytes hold lone CRs and LFs at random, which only slow the view down. The plain
# scrub (every unwrapped form) still runs over them.
_BINARY_TOP = ("image/", "audio/", "video/", "font/")
_BINARY = frozenset({"application/octet-stream", "application/zip", "application/gzip",
                     "application/x-tar", "application/pdf", "application/wasm",
                     "application/zstd", "application/x-7z-compressed"})


def applies_to(content_type: str) -> bool:
    """Should a body of this Content-Type be scrubbed across line breaks too? Yes unless it
    is declared binary (multipart, message, text, JSON, unknown or missing: yes)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return not (media.startswith(_BINARY_TOP) or media in _BINARY)


def scrub_unwrapped(secrets: SecretSet, data: bytes) -> tuple[bytes, int]:
    """`secrets.scrub(data)`, and forms that lone line breaks cut are replaced as well."""
    if secrets.empty:
        return bytes(data), 0
    pieces, count, _ = _scan(secrets, bytes(data), final=True)
    return b"".join(pieces), count


def unwrapped_view(data: bytes) -> bytes:
    """`data` with its lone line breaks taken out and its ``=XX`` escapes decoded (for
    detection: `SecretSet.find` of it); `data` itself (the same object) when that changes
    nothing."""
    return View(data).text


def unwrapping_scrubber(secrets: SecretSet) -> StreamScrubber:
    """A `StreamScrubber` over the view: any chunking, flushed, gives exactly
    ``scrub_unwrapped(secrets, whole)``."""
    return StreamScrubber(secrets, functools.partial(_scan, secrets))
