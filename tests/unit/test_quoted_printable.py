"""Quoted-printable with any byte escaped (issue 34): RFC 2045 lets an encoder write any octet
as =XX (decoders take either hex case), with soft line breaks anywhere between tokens. The
scrubber's view decodes every escape; the exfiltration check reads the same view.

The secret is an obvious fake with "/", "+" and "=" in it (the bytes the found report had
escaped).
"""

from __future__ import annotations

import email
import email.policy
import quopri

from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.test import tutils

from sandgate.inject import find_leaks
from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.unwrap import _View, scrub_unwrapped, unwrapping_scrubber

KEY = "FAKE/qp+probe/value=0123+abcdef/XYZ"
SECRETS = SecretSet({"qp": KEY})


def qp(value: bytes, escaped: set[int], upper: set[int], breaks: dict[int, bytes]) -> bytes:
    """`value` quoted-printable: the bytes at `escaped` (and every byte that must be) as =XX,
    upper-case hex at `upper`, a soft break (with its line ending) before token `breaks`."""
    out = bytearray()
    for i, byte in enumerate(value):
        if i in breaks:
            out += b"=" + breaks[i]
        if i in escaped or byte == 0x3D or not 33 <= byte <= 126:
            out += (f"={byte:02X}" if i in upper else f"={byte:02x}").encode()
        else:
            out.append(byte)
    return bytes(out)


def sent(body: bytes) -> list[str]:
    req = tutils.treq(headers=[(b"host", b"api.example"),
                               (b"content-type", b"text/plain")], content=body)
    return sorted({lk.secret for lk in find_leaks(req, body, {}, SECRETS, frozenset())})


def mime(payload: bytes, linesep: bytes) -> bytes:
    lines = [b"MIME-Version: 1.0", b'Content-Type: multipart/mixed; boundary="b1"', b"",
             b"--b1", b"Content-Type: text/plain",
             b"Content-Transfer-Encoding: quoted-printable", b"", payload, b"--b1--", b""]
    return linesep.join(lines)


def test_the_found_mime_part_is_scrubbed_and_detected():
    """Found: / written =2F and + written =2B, with soft breaks, reached the client."""
    key = KEY.encode()
    payload = (key.replace(b"=", b"=3D").replace(b"/", b"=2F").replace(b"+", b"=2B")
               [:14] + b"=\r\n" + key.replace(b"=", b"=3D").replace(b"/", b"=2F")
               .replace(b"+", b"=2B")[14:])
    body = mime(b"key: " + payload + b" end", b"\r\n")
    part = next(iter(email.message_from_bytes(body, policy=email.policy.default).iter_parts()))
    assert key in part.get_payload(decode=True)  # what a client gets back
    out, n = scrub_unwrapped(SECRETS, body)
    assert n == 1 and b"[REDACTED:qp]" in out
    again = next(iter(email.message_from_bytes(out, policy=email.policy.default).iter_parts()))
    assert key not in again.get_payload(decode=True)
    assert sent(body) == ["qp"]


@given(escaped=st.sets(st.integers(0, len(KEY) - 1)),
       upper=st.sets(st.integers(0, len(KEY) - 1)),
       breaks=st.dictionaries(st.integers(1, len(KEY) - 1),
                              st.sampled_from([b"\n", b"\r\n"]), max_size=6),
       before=st.text("ab xy:\n", max_size=12).map(str.encode),
       after=st.text("ab xy:\n", max_size=12).map(str.encode),
       cuts=st.lists(st.integers(0, 200), max_size=4))
def test_any_escapes_and_soft_breaks_are_scrubbed_and_detected(escaped, upper, breaks, before,
                                                               after, cuts):
    encoded = qp(KEY.encode(), escaped, upper, breaks)
    assert quopri.decodestring(encoded) == KEY.encode()  # a decoder gets the key back
    body = before + b"k=3D" + encoded + b" " + after
    out, n = scrub_unwrapped(SECRETS, body)
    assert n >= 1
    assert KEY.encode() not in quopri.decodestring(out)
    assert sent(body) == ["qp"]
    s = unwrapping_scrubber(SECRETS)  # any chunking gives the same
    streamed, prev = b"", 0
    for p in [*sorted(c % (len(body) + 1) for c in cuts), len(body)]:
        streamed += s.feed(body[prev:p])
        prev = p
    assert streamed + s.flush() == out


def test_a_value_after_a_literal_equals_sign_is_still_scrubbed():
    """The view reads "=ab" as an escape; a hex-led value after "=" must not slip by."""
    s = SecretSet({"hex": "ab12cd34ef56-fake-hex-token"})
    for body in (b"token=ab12cd34ef56-fake-hex-token&x=1",
                 b"token=ab12cd34ef56-fake-hex-token=41\n"):
        out, n = scrub_unwrapped(s, body)
        assert n == 1 and b"fake-hex-token" not in out


def test_a_secret_holding_an_escape_is_matched_as_written():
    """A raw value with "=4A" in it reads otherwise in the view: its own spelling still goes."""
    s = SecretSet({"odd": "FAKE=4Avalue=2Fwith-escapes"})
    out, n = scrub_unwrapped(s, b"x FAKE=4Avalue=2Fwith-escapes y")
    assert (out, n) == (b"x [REDACTED:odd] y", 1)


@given(st.lists(st.sampled_from([b"=", b"a", b"F", b"0", b"9", b" ", b"\n", b"\r\n", b"=0A",
                                 b"=3d", b"=C3", b"==", b"x"]), max_size=30))
def test_the_fast_view_reads_as_the_general_loop(parts):
    """Escapes decoded line by line (offsets mapped on demand) give the general loop's view."""
    data = b"".join(parts)
    fast = _View(data)
    text = fast.text
    general = _View(data)
    assert general._general(data) == text  # the loop itself, whatever path __init__ took
    for i in range(len(text)):  # mapping back (forces the lazy map): same bytes of the data
        start, end = fast.origin(i), fast.end(i)
        assert _View(data[start:end]).text == text[i:i + 1] or data[start:end] == text[i:i + 1]
