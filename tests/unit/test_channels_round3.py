"""Every channel, every encoding: header names, MIME transfer encodings (wrapped base64,
quoted-printable), stacked and uncommon content codings, and WebSocket control frames.

The end-to-end versions (a real upstream, curl, a wsproto client) are in
tests/integration/test_round3_channels.py.
"""

from __future__ import annotations

import base64
import binascii
import email.generator
import email.mime.application
import email.mime.multipart
import email.mime.text
import email.policy
import gzip
import io
import quopri
import zlib

import brotli
import pytest
import wsproto.events as ws_events
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tutils

from sandgate.errors import Code
from sandgate.inject import find_leaks_in
from sandgate.mitm.guards import wscontrol
from sandgate.refusal import Refusal
from sandgate.scrub import decoding, unwrap
from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.stream import ResponseScrubber, answer_instead, clean_head, scrub_whole
from sandgate.scrub.unwrap import scrub_unwrapped, unwrapping_scrubber
from sandgate.secrets.forms import classified_forms
from tests.unit.fuzz import examples

KEY = "test-round3-FAKE-key-0a1b2c3d4e5f6a7b8c9d"
SECRETS = SecretSet({"api": KEY})
SETTINGS = settings(max_examples=examples(100), deadline=None, database=None)


def _no_key(data: bytes) -> None:
    """Nothing a client could decode back into the key: raw, base64 (lines joined), QP."""
    assert KEY.encode() not in data
    joined = data.replace(b"\r", b"").replace(b"=\n", b"").replace(b"\n", b"")
    assert KEY.encode() not in joined
    assert base64.b64encode(KEY.encode())[4:-4] not in joined
    try:
        assert KEY.encode() not in quopri.decodestring(data)
    except (ValueError, binascii.Error):
        pass


# ------------------------------------------------------------------ header names


def test_a_header_name_carrying_the_key_is_dropped() -> None:
    resp = tutils.tresp()
    resp.headers.fields = ((KEY.encode().hex().encode(), b"1"), (b"X-" + KEY.encode(), b"2"),
                           (KEY.upper().encode(), b"3"), (b"x-fine", KEY.encode()))
    n = clean_head(resp, SECRETS)
    names = [k for k, _ in resp.headers.fields]
    assert names == [b"x-fine"] and resp.headers["x-fine"] == "[REDACTED:api]" and n == 4


# ------------------------------------------------------------------ MIME


def _multipart(payload: bytes, cte: str, linesep: str) -> bytes:
    msg = email.mime.multipart.MIMEMultipart()
    if cte == "base64":
        part = email.mime.application.MIMEApplication(payload)  # base64, 76 columns
    else:
        part = email.mime.text.MIMEText(payload.decode(), "plain", "utf-8")
        del part["Content-Transfer-Encoding"]
        part["Content-Transfer-Encoding"] = "quoted-printable"
        part.set_payload(quopri.encodestring(payload).decode())
    msg.attach(part)
    out = io.StringIO()
    email.generator.Generator(out, policy=email.policy.default.clone(linesep=linesep)).flatten(
        msg)
    return out.getvalue().encode()


@SETTINGS
@given(st.integers(0, 80), st.sampled_from(["base64", "quoted-printable"]),
       st.sampled_from(["\n", "\r\n"]))
def test_key_in_a_mime_part_at_any_offset_is_scrubbed(pad: int, cte: str, linesep: str) -> None:
    body = _multipart(b"p" * pad + KEY.encode() + b" end", cte, linesep)
    # the email package (what a sandbox would use) gets the key back from the raw body
    parsed = email.message_from_bytes(body, policy=email.policy.default)
    part = next(iter(parsed.iter_parts()))
    assert KEY.encode() in part.get_payload(decode=True)
    out, n = scrub_unwrapped(SECRETS, body)
    assert n >= 1
    _no_key(out)
    again = email.message_from_bytes(out, policy=email.policy.default)
    assert KEY.encode() not in (next(iter(again.iter_parts())).get_payload(decode=True) or b"")


@SETTINGS
@given(st.binary(max_size=60), st.binary(max_size=60), st.integers(8, 100),
       st.sampled_from([b"\n", b"\r\n"]))
def test_base64_wrapped_at_any_width(before: bytes, after: bytes, width: int,
                                     nl: bytes) -> None:
    flat = base64.b64encode(before + KEY.encode() + after)
    wrapped = nl.join(flat[i:i + width] for i in range(0, len(flat), width))
    out, n = scrub_unwrapped(SECRETS, wrapped)
    assert n >= 1
    joined = out.replace(nl, b"")
    for form, kind in classified_forms(KEY.encode()).items():
        if kind == "base64":  # every alignment's core: none survives once the lines are joined
            assert form not in joined


@SETTINGS
@given(st.text(alphabet="ab=\n\r x", max_size=80), st.integers(1, 9), st.data())
def test_unwrapping_stream_equals_whole(noise: str, cuts: int, data: st.DataObject) -> None:
    qp = quopri.encodestring(b"q" * 7 + KEY.encode() + b"=" * 3)
    wrapped = b"\r\n".join(base64.b64encode(KEY.encode() * 2)[i:i + 5] for i in range(0, 80, 5))
    body = noise.encode() + qp + noise.encode() + wrapped + b"\n\n" + KEY.encode() + b"="
    points = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=cuts)))
    s = unwrapping_scrubber(SECRETS)
    out, prev = b"", 0
    for p in [*points, len(body)]:
        out += s.feed(body[prev:p])
        assert s.held < 4 * len(body) and s.held <= 4 * SECRETS.max_len + 1
        prev = p
    out += s.flush()
    assert out == scrub_unwrapped(SECRETS, body)[0]
    _no_key(out)


def test_a_blank_line_ends_the_hold_back() -> None:
    s = unwrapping_scrubber(SECRETS)
    event = b"data: " + KEY[:10].encode() + b"\n\n"  # could be a prefix, but a blank line ends it
    assert s.feed(event) == event and s.held == 0


def test_exfiltration_of_a_wrapped_value_is_detected() -> None:
    flat = base64.b64encode(b"xy" + KEY.encode())
    wrapped = b"\n".join(flat[i:i + 10] for i in range(0, len(flat), 10))
    assert find_leaks_in(wrapped, "body", {}, SECRETS, frozenset())


def test_qp_escapes_are_forms() -> None:
    value = "fake=value with=equals"
    s = SecretSet({"v": value})
    out, n = s.scrub(b"x " + quopri.encodestring(value.encode()) + b" y")
    assert n == 1 and b"equals" not in out


# ------------------------------------------------------------------ content codings


def _gz(b: bytes) -> bytes:
    return gzip.compress(b)


ENCODERS = {
    "gzip": _gz,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
}


@SETTINGS
@given(st.lists(st.sampled_from(sorted(ENCODERS)), min_size=1, max_size=3),
       st.binary(max_size=3000), st.integers(1, 700))
def test_stacked_codings_stream_decode(chain: list[str], filler: bytes, step: int) -> None:
    plain = filler + KEY.encode() + filler
    data = plain
    for c in chain:
        data = ENCODERS[c](data)
    resp = http.Response.make(200)
    resp.headers["content-encoding"] = ", ".join(chain)
    resp.headers["transfer-encoding"] = "chunked"
    scrub = ResponseScrubber(SECRETS, ", ".join(chain), resp)
    assert scrub.refuse_reason is None and "content-encoding" not in resp.headers
    out = b"".join(b"".join(scrub(data[i:i + step])) for i in range(0, len(data), step))
    out += b"".join(scrub(b""))
    assert out == plain.replace(KEY.encode(), b"[REDACTED:api]")


@pytest.mark.parametrize("chain", [["gzip", "gzip"], ["br"], ["zstd"], ["deflate", "br"]])
def test_whole_body_codings_are_decoded(chain: list[str]) -> None:
    data = b"you sent " + KEY.encode()
    for c in chain:
        data = ENCODERS[c](data)
    resp = http.Response.make(200)
    resp.headers["content-encoding"] = ", ".join(chain)
    resp.raw_content = data
    assert scrub_whole(resp, SECRETS) == 1
    assert resp.content == b"you sent [REDACTED:api]" and "content-encoding" not in resp.headers


def test_concatenated_gzip_members_are_all_decoded() -> None:
    data = _gz(b"first " + KEY.encode()) + _gz(b" second " + KEY.encode())
    assert decoding.decode_all(data, ["gzip"], 1 << 20) == (
        b"first " + KEY.encode() + b" second " + KEY.encode())


@pytest.mark.parametrize("chain", [["br"], ["zstd"], ["gzip"]])
def test_corrupt_or_oversized_bodies_raise_a_safe_error(chain: list[str]) -> None:
    with pytest.raises(ValueError, match="corrupt") as e:
        decoding.decode_all(b"not compressed at all " + KEY.encode(), chain, 1 << 20)
    assert KEY not in str(e.value)
    bomb = ENCODERS[chain[0]](b"\0" * (1 << 20))
    with pytest.raises(ValueError, match="decodes to more"):
        decoding.decode_all(bomb, chain, 1000)


def test_unknown_codings_are_refused_readably() -> None:
    resp = http.Response.make(200, b"", {"transfer-encoding": "chunked", "x-up": "1"})
    resp.headers["content-encoding"] = "gzip, compress"
    scrub = ResponseScrubber(SECRETS, "gzip, compress", resp)
    assert scrub.refuse_reason is not None and "compress" in scrub.refuse_reason
    refusal = Refusal(Code.UPSTREAM_ERROR, scrub.refuse_reason)
    stream = answer_instead(resp, refusal, http1=True)
    assert resp.status_code == 502 and "x-up" not in resp.headers
    assert resp.headers["x-sandgate-reason"] == "upstream_error"
    body = b"".join(stream(b"upstream bytes " + KEY.encode()))
    assert body == refusal.body() and resp.headers["content-length"] == str(len(body))
    assert stream(b"more") == [] and stream(b"") == []


# ------------------------------------------------------------------ WebSocket control frames


def test_control_patch_installs_on_this_mitmproxy() -> None:
    # (its sources are pinned by test_mitm_registry.py::test_source_is_pinned[wscontrol])
    from sandgate.mitm.guards import corrections

    corrections.install()
    wscontrol.install()  # its own entry in sandgate.mitm.registry.PATCHES, after corrections
    assert wscontrol.installed() and corrections.installed()
    from mitmproxy.proxy.layers import websocket as layer

    assert layer.WebsocketConnection.events is wscontrol._events  # type: ignore[comparison-overlap]


def _handler(from_client: bool, payload: bytes) -> bytes | None:
    if from_client:
        return None if SECRETS.find(payload) else payload
    return SECRETS.scrub(payload)[0]


@pytest.mark.parametrize("kind", [ws_events.Ping, ws_events.Pong])
def test_ping_and_pong_payloads(kind: type) -> None:
    key = b"k=" + KEY.encode()
    out = wscontrol.judged(kind(payload=key), False, _handler)
    assert isinstance(out, kind) and KEY.encode() not in out.payload
    assert len(out.payload) <= wscontrol.PING_MAX
    assert wscontrol.judged(kind(payload=key), True, _handler) is None  # not relayed
    same = kind(payload=b"hello")
    assert wscontrol.judged(same, True, _handler) is same
    assert wscontrol.judged(kind(payload=key), False, None).payload == b""  # no handler: empty


def test_close_reasons() -> None:
    close = ws_events.CloseConnection(code=4000, reason="bye " + KEY)
    out = wscontrol.judged(close, False, _handler)
    assert isinstance(out, ws_events.CloseConnection) and out.code == 4000
    assert KEY not in (out.reason or "")
    out = wscontrol.judged(close, True, _handler)  # the close happens, without its reason
    assert isinstance(out, ws_events.CloseConnection) and out.code == 4000 and not out.reason
    long_reason = ws_events.CloseConnection(code=1000, reason="é" * 100)
    out = wscontrol.judged(long_reason, False, lambda f, p: p + b"x")
    assert len((out.reason or "").encode()) <= wscontrol.REASON_MAX


def test_a_handler_that_fails_empties_the_payload() -> None:
    def boom(from_client: bool, payload: bytes) -> bytes | None:
        raise RuntimeError("bug")

    out = wscontrol.judged(ws_events.Ping(payload=KEY.encode()), False, boom)
    assert isinstance(out, ws_events.Ping) and out.payload == b""


@SETTINGS
@given(st.lists(st.text(alphabet="ab=x", max_size=9), max_size=12),
       st.sampled_from(["\n", "\r\n"]), st.text(alphabet="ab=\r\n", max_size=6))
def test_the_fast_view_equals_the_general_one(lines: list[str], sep: str, tail: str) -> None:
    from sandgate.scrub.unwrap import _View

    for data in ((sep.join(lines)).encode(), (sep.join(lines) + tail).encode()):
        fast = _View(data)
        slow = _View(b"")
        slow.data = data
        slow.text = slow._general(data)
        assert fast.text == slow.text
        for i in range(len(fast.text)):
            assert fast.origin(i) == slow.origin(i), (data, i)
        for tail_window in (4096, 0):  # the walk back from the end, and the full list
            unwrap._TAIL = tail_window
            try:
                for i in range(len(fast.text)):
                    assert _View(data).origin(i) == slow.origin(i)
            finally:
                unwrap._TAIL = 4096


def test_binary_media_types_are_scrubbed_without_the_view() -> None:
    assert unwrap.applies_to("multipart/mixed; boundary=x") and unwrap.applies_to("")
    assert unwrap.applies_to("text/plain") and unwrap.applies_to("application/json")
    assert not unwrap.applies_to("image/png") and not unwrap.applies_to("Application/Zip")
    wrapped = b"\n".join(base64.b64encode(b"pad" + KEY.encode())[i:i + 9] for i in range(0, 60, 9))
    for ctype, cut in (("text/plain", True), ("image/png", False)):
        resp = http.Response.make(200, b"", {"content-type": ctype, "transfer-encoding": "chunked"})
        scrub = ResponseScrubber(SECRETS, "", resp)
        out = b"".join(scrub(wrapped)) + b"".join(scrub(b""))
        assert (b"REDACTED" in out) is cut
