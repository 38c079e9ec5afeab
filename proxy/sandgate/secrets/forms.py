"""Every spelling of a secret value that a client could turn back into the value.

Scrubbing only the raw value is not enough: an upstream that echoes a request back may send the
key base64-encoded (inside a larger blob), hex-dumped, percent-encoded or JSON-escaped, and the
sandbox can undo any of these. `encoded_forms` lists the byte strings to look for, one secret
at a time; `sandgate.scrub.scrubber` compiles them all into one automaton.

Derived forms shorter than `MIN_DERIVED_LEN` are dropped: a 4-character hex or base64 run
occurs in ordinary traffic all the time, and scrubbing it would mangle bodies (and flag
innocent requests as exfiltration) while protecting a value too short to be a credential
anyway. The raw form is always kept: the operator chose that value, however short.

Quoted-printable (MIME) escapes ``=`` and non-printable bytes as ``=XX``: those spellings are
forms too (for the plain scrub of a binary body). Any other subset of escaped bytes, in either
hex case, and line breaks inside a form (base64 wrapped at 76 columns, a quoted-printable soft
break) are handled by the scrubber's view, not here: `sandgate.scrub.unwrap`. Compressed bodies are
decoded before scrubbing (`sandgate.scrub.decoding`).

Not covered (documented so nobody assumes otherwise): other encodings layered on top of these
(base64 of hex, ...), and mixed-case hex or ``%xX`` escapes (`SecretSet.find` matches
case-insensitively, scrubbing does not).
"""

from __future__ import annotations

import base64
import json
import re
import urllib.parse
from typing import Literal

FormKind = Literal["raw", "base64", "hex", "percent", "json", "qp", "own"]
"""Which family a form belongs to; "own" is a form Sandgate itself produced (see `query_forms`)."""

MIN_DERIVED_LEN = 8
"""Derived forms shorter than this are not worth the false positives; see the module docstring."""

_PERCENT_ESCAPE = re.compile(r"%[0-9A-F]{2}")
_JSON_ESCAPE = re.compile(r"\\(?:u[0-9a-f]{4}|.)", re.DOTALL)
# urllib.parse.quote's safe set when mimicking JavaScript's encodeURIComponent.
_JS_COMPONENT_SAFE = "!~*'()"
_URLSAFE = bytes.maketrans(b"+/", b"-_")


def encoded_forms(value: bytes) -> frozenset[bytes]:
    """Every form of `value` worth scrubbing: see `classified_forms` for the list and why."""
    return frozenset(classified_forms(value))


def classified_forms(value: bytes) -> dict[bytes, FormKind]:
    """`encoded_forms` with the family of each form; the raw form comes first.

    When two families produce the same bytes (a plain ASCII key is its own percent and JSON
    form), the first family listed wins: raw, base64, hex, percent, JSON. An empty value has no
    forms at all: the empty string would match everywhere.
    """
    if not value:
        return {}
    forms: dict[bytes, FormKind] = {value: "raw"}
    families: list[tuple[FormKind, list[bytes]]] = [
        ("base64", _base64_forms(value)),
        ("hex", [value.hex().encode("ascii"), value.hex().upper().encode("ascii")]),
        ("percent", _percent_forms(value)),
        ("json", _json_forms(value)),
        ("qp", _qp_forms(value)),
    ]
    for kind, candidates in families:
        for form in candidates:
            if len(form) >= MIN_DERIVED_LEN and form not in forms:
                forms[form] = kind
    return forms


def basic_auth_form(user: str, password: str) -> bytes:
    """The credentials of ``Authorization: Basic`` exactly as `sandgate.inject` sends them.

    The pair's base64 is not a form of the password alone when the user name is not a multiple
    of three bytes long; listing it whole also catches the user name part. ``surrogatepass``
    keeps this from raising (and so from naming a character of the value in an error) on a
    value that injection itself could not have sent.
    """
    return base64.b64encode(f"{user}:{password}".encode("utf-8", "surrogatepass"))


def query_forms(value: str) -> frozenset[bytes]:
    """The query-string spellings of `value` that Sandgate's query injection produces.

    ``request.query[name] = value`` in mitmproxy goes through ``mitmproxy.net.http.url.encode``,
    which is ``urllib.parse.urlencode(..., errors="surrogateescape")``: ``quote_plus`` with
    ``safe=""``, spaces as ``+``. An upstream that logs and echoes the URL may normalise the
    escapes to lower case, so that spelling is listed too. A value that cannot be encoded
    could not have been injected either: it has no query forms.
    """
    try:
        sent = urllib.parse.quote_plus(value, safe="", errors="surrogateescape")
    except UnicodeEncodeError:
        return frozenset()
    if not sent:
        return frozenset()
    return frozenset({sent.encode("ascii"), _lower_escapes(sent).encode("ascii")})


def _base64_forms(value: bytes) -> list[bytes]:
    """Base64 of `value` wherever it sits inside a larger encoded blob.

    Base64 maps 3 bytes to 4 characters, so the characters depend on the value's offset in the
    blob modulo 3. At offset k (0, 1, 2) only characters whose 6 bits all come from the value
    are fixed; the partial characters at either edge mix in unknown neighbour bits and are left
    out. That core is what must disappear: without it at most a few bits of the value remain.
    When the value ends the blob, the encoder also emits the last partial character (its
    unknown bits are zero) and ``=`` padding: that longer form is listed too, so a scrub takes
    the padding with it. Each form comes in the standard and the URL-safe alphabet.
    """
    out: list[bytes] = []
    for k in range(3):
        encoded = base64.b64encode(bytes(k) + value)
        first = (8 * k + 5) // 6  # first character with no bit of the k filler bytes
        last = 8 * (k + len(value)) // 6  # characters before this hold no bit beyond the value
        for form in (encoded[first:last], encoded[first:]):
            out.append(form)
            out.append(form.translate(_URLSAFE))
    return out


def _percent_forms(value: bytes) -> list[bytes]:
    """Percent-encodings a URL, form or cookie may carry, with upper and lower case escapes.

    ``quote(safe="")`` (a query value), ``quote`` with its default ``safe="/"`` (a path),
    ``quote_plus`` (forms), JavaScript's encodeURIComponent safe set, and every byte escaped
    (some encoders escape everything). RFC 3986 makes escape case insignificant, so servers
    echo either.
    """
    upper = [
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote(value, safe="/"),
        urllib.parse.quote_plus(value, safe=""),
        urllib.parse.quote(value, safe=_JS_COMPONENT_SAFE),
        "".join(f"%{b:02X}" for b in value),
    ]
    out: list[bytes] = []
    for form in upper:
        out.append(form.encode("ascii"))
        out.append(_lower_escapes(form).encode("ascii"))
    return out


def _json_forms(value: bytes) -> list[bytes]:
    """The value as it appears inside a JSON string, for the common encoders.

    ``json.dumps`` escapes quotes, backslashes and control characters and, by default, every
    non-ASCII character as ``\\uXXXX`` (lower-case hex); other encoders use upper-case hex,
    write non-ASCII as raw UTF-8, escape ``/`` as ``\\/`` (PHP, some Java), or escape every
    character (obfuscating encoders, some templating). A value that is not UTF-8 has no JSON
    string form. Lone surrogates pass through (``surrogatepass``) the way a lenient encoder
    writes them; nothing here may raise with a piece of the value in its message.
    """
    try:
        text = value.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return []
    out: list[bytes] = []
    for ensure_ascii in (True, False):
        base = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1]
        for form in (base, _upper_json_escapes(base)):
            out.append(form.encode("utf-8", "surrogatepass"))
            out.append(form.replace("/", "\\/").encode("utf-8", "surrogatepass"))
    units = text.encode("utf-16-be", "surrogatepass")
    codes = [units[i] << 8 | units[i + 1] for i in range(0, len(units), 2)]
    out.append("".join(f"\\u{c:04x}" for c in codes).encode("ascii"))
    out.append("".join(f"\\u{c:04X}" for c in codes).encode("ascii"))
    return out


def _qp_forms(value: bytes) -> list[bytes]:
    """Quoted-printable (RFC 2045 section 6.7): ``=`` and bytes outside printable ASCII as
    ``=XX``, upper-case hex as the RFC says and lower-case as some encoders write it; a space
    or tab literal or escaped (encoders differ). Soft line breaks: `sandgate.scrub.unwrap`."""
    out: list[bytes] = []
    for hexfmt in ("={:02X}", "={:02x}"):
        for literal in (b" \t", b""):
            out.append(b"".join(
                bytes([c]) if (33 <= c <= 126 and c != 61) or c in literal
                else hexfmt.format(c).encode("ascii") for c in value))
    return out


def _lower_escapes(quoted: str) -> str:
    """Lower-case the hex digits of ``%XX`` escapes, nothing else (``%`` itself is ``%25``)."""
    return _PERCENT_ESCAPE.sub(lambda m: m.group().lower(), quoted)


def _upper_json_escapes(dumped: str) -> str:
    """Upper-case the hex of ``\\uxxxx`` escapes in `json.dumps` output, nothing else.

    Escapes are tokenised left to right, so an escaped backslash followed by a literal
    ``u0041`` is left alone.
    """

    def upper(m: re.Match[str]) -> str:
        token = m.group()
        return "\\u" + token[2:].upper() if token.startswith("\\u") else token

    return _JSON_ESCAPE.sub(upper, dumped)
