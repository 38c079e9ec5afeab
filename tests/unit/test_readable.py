"""readable.answer_early: which refusals are sent before the body is read."""

from __future__ import annotations

import pytest
from mitmproxy import http
from mitmproxy.test import tflow, tutils

from sandgate.addons import readable


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
