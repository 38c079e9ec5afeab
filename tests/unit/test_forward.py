"""forward.py: the head the upstream receives is the one that was judged."""

from __future__ import annotations

import gzip

import pytest
from mitmproxy.test import tutils

from sandgate.errors import BadRequest, Code
from sandgate.request import RequestInfo
from sandgate.stages.forward import (
    check_authority,
    check_upgrade,
    inspectable_body,
    is_websocket_upgrade,
    prepare,
)

INFO = RequestInfo("https", "api.example", 443, "POST", "/v1")


def test_prepare_removes_what_was_not_judged():
    req = tutils.treq(headers=[
        (b"host", b"api.example"), (b"X-Sandgate-Reason", b"forged"), (b"x-sandgate-id", b"x"),
        (b"connection", b"keep-alive, Authorization, X-Custom"), (b"authorization", b"a"),
        (b"x-custom", b"1"), (b"keep-alive", b"5"), (b"proxy-connection", b"keep-alive"),
        (b"te", b"trailers"), (b"upgrade", b"h2c"), (b"http2-settings", b"AAA"),
        (b"transfer-encoding", b"chunked"), (b"x-keep", b"yes"),
    ], content=b"hello")
    req.trailers = tutils.treq(headers=[(b"x-t", b"1")]).headers
    prepare(req, websocket=False)
    names = {k.lower() for k, _ in req.headers.fields}
    assert names == {b"host", b"x-keep", b"content-length"}
    assert req.headers["content-length"] == "5" and req.trailers is None


def test_prepare_removes_every_proxy_header():
    """Proxy-* headers are for the proxy (Sandgate's token among them): none reaches the
    upstream, whatever its name, so none escapes what an approval binds either."""
    req = tutils.treq(headers=[(b"host", b"api.example"), (b"Proxy-Authorization", b"t"),
                               (b"proxy-foo", b"x"), (b"PROXY-STATUS", b"y"), (b"x-keep", b"1")],
                      content=b"")
    prepare(req, websocket=False)
    assert {k.lower() for k, _ in req.headers.fields} == {b"host", b"x-keep"}


def test_prepare_keeps_a_websocket_upgrade():
    req = tutils.treq(method=b"GET", headers=[(b"host", b"h"), (b"connection", b"Upgrade"),
                                              (b"upgrade", b"websocket"),
                                              (b"sec-websocket-key", b"k")], content=b"")
    assert is_websocket_upgrade(req)
    prepare(req, websocket=True)
    assert req.headers["upgrade"] == "websocket" and req.headers["connection"] == "Upgrade"
    assert "content-length" not in req.headers


def test_prepare_sends_origin_form():
    req = tutils.treq(authority=b"api.example", content=b"")
    prepare(req, websocket=False)
    assert req.authority == ""


@pytest.mark.parametrize("authority,ok", [
    (b"", True), (b"api.example", True), (b"api.example:443", True), (b"API.example.", True),
    (b"other.example", False), (b"api.example:8443", False),
])
def test_check_authority(authority, ok):
    req = tutils.treq(authority=authority)
    if ok:
        check_authority(req, INFO)
    else:
        with pytest.raises(BadRequest):
            check_authority(req, INFO)


def test_check_authority_refuses_a_url_as_path():
    req = tutils.treq(path=b"https://other.example/x")
    with pytest.raises(BadRequest):
        check_authority(req, INFO)


@pytest.mark.parametrize("headers,ok", [
    ([], True),
    ([(b"connection", b"Upgrade"), (b"upgrade", b"websocket")], True),
    ([(b"connection", b"Upgrade"), (b"upgrade", b"h2c"), (b"http2-settings", b"AA")], False),
    ([(b"connection", b"Upgrade"), (b"upgrade", b"foo")], False),
    ([(b"http2-settings", b"AA")], False),
])
def test_only_websocket_may_upgrade(headers, ok):
    req = tutils.treq(method=b"GET", headers=[(b"host", b"h"), *headers])
    if ok:
        check_upgrade(req)
    else:
        with pytest.raises(BadRequest):
            check_upgrade(req)


def test_inspectable_body_decodes_bounded():
    raw = b"FAKE-value " * 10
    req = tutils.treq(headers=[(b"content-encoding", b"gzip")], content=gzip.compress(raw))
    assert inspectable_body(req, 1000) == raw
    bomb = tutils.treq(headers=[(b"content-encoding", b"gzip")],
                       content=gzip.compress(b"\0" * 5_000_000))
    with pytest.raises(BadRequest) as e:
        inspectable_body(bomb, 1_000_000)
    assert e.value.code is Code.TOO_LARGE
    with pytest.raises(BadRequest):
        inspectable_body(tutils.treq(headers=[(b"content-encoding", b"br")], content=b"x"), 9)
    with pytest.raises(BadRequest):
        inspectable_body(tutils.treq(headers=[(b"content-encoding", b"gzip")],
                                     content=b"not gzip"), 99)


def test_prepare_keeps_the_clients_wish_to_close():
    req = tutils.treq(headers=[(b"host", b"h"), (b"connection", b"close, x-a"), (b"x-a", b"1")],
                      content=b"")
    prepare(req, websocket=False)
    assert req.headers["connection"] == "close" and "x-a" not in req.headers


@pytest.mark.parametrize("info,host", [
    (INFO, "api.example"),
    (RequestInfo("https", "api.example", 8443, "GET", "/"), "api.example:8443"),
    (RequestInfo("http", "plain.example", 80, "GET", "/"), "plain.example"),
])
def test_prepare_gives_a_request_without_host_the_judged_one(info, host):
    """HTTP/1.0 may leave Host out; the upstream must get the origin that was judged."""
    req = tutils.treq(headers=[(b"x-a", b"1")], http_version=b"HTTP/1.0", authority=b"")
    prepare(req, websocket=False, info=info)
    assert req.headers.fields[0] == (b"Host", host.encode())


def test_prepare_keeps_a_host_that_was_judged():
    req = tutils.treq(headers=[(b"host", b"api.example")])
    prepare(req, websocket=False, info=INFO)
    assert req.headers.get_all("host") == ["api.example"]
