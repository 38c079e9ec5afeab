"""readable.answer_early: which refusals are sent before the body is read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow, tutils

from sandgate.mitm.guards import readable


def _flow(headers: list[tuple[bytes, bytes]], version: bytes = b"HTTP/1.1") -> http.HTTPFlow:
    f = tflow.tflow(req=tutils.treq(headers=headers, http_version=version, content=b""))
    f.response = http.Response.make(403, b"{}")
    return f


@pytest.mark.parametrize("headers", [
    [(b"content-length", b"10")],
    [(b"transfer-encoding", b"chunked")],
    [(b"content-length", b"10"), (b"expect", b"100-continue")],
])
def test_http1_refusal_with_a_body_to_come_is_answered_now_and_closes(headers):
    f = _flow(headers)
    assert readable.answer_early(f)
    assert f.metadata[readable.EARLY]
    assert f.response is not None and f.response.headers["connection"] == "close"
    assert "expect" not in f.request.headers  # no 100 Continue for a refused request


def test_no_body_keeps_mitmproxy_order_but_never_a_100():
    f = _flow([(b"expect", b"100-continue")])
    assert not readable.answer_early(f)
    assert "expect" not in f.request.headers


def test_http2_refusal_is_answered_now_without_connection_header():
    f = _flow([(b"content-length", b"10")], b"HTTP/2.0")
    assert readable.answer_early(f)
    assert f.response is not None and "connection" not in f.response.headers


def _chunked(data: bytes) -> list[object]:
    from h11._readers import ChunkedReader
    from h11._receivebuffer import ReceiveBuffer

    readable.install()
    reader, buf = ChunkedReader(), ReceiveBuffer()
    buf += data
    return [reader(buf), reader(buf)]


@given(st.integers(min_value=readable.MAX_CHUNK + 1, max_value=16**40),
       st.sampled_from(["{:x}", "{:X}", "000{:x}"]))
def test_a_chunk_size_past_any_length_is_a_protocol_error(size: int, spelling: str):
    import h11

    with pytest.raises(h11.ProtocolError):  # (past 20 digits: h11's own refusal)
        _chunked(spelling.format(size).encode() + b"\r\nabc\r\n")


@given(st.integers(min_value=3, max_value=readable.MAX_CHUNK))
def test_a_chunk_size_within_bounds_reads_as_before(size: int):
    first, _ = _chunked(f"{size:x}\r\nabc".encode())
    assert bytes(first.data) == b"abc"  # type: ignore[attr-defined]


@given(st.binary(min_size=2, max_size=2).filter(lambda b: b != b"\r\n"))
def test_a_chunk_without_its_crlf_is_a_protocol_error(footer: bytes):
    # h11 0.16 (CVE-2025-43859): the two bytes after a chunk must be CRLF; h11 0.14 skipped
    # any two, so "1\r\naXY..." could smuggle bytes past a proxy and a server that disagree.
    import h11

    with pytest.raises(h11.ProtocolError):
        _chunked(b"1\r\na" + footer + b"0\r\n\r\n")
