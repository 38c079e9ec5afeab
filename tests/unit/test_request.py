"""The request head checks: what mitmproxy would re-serialise must not carry unjudged bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.errors import BadRequest, Code
from sandgate.request import RequestInfo, check_head, check_tunnel, split_authority

FORBIDDEN = [b"\r", b"\n", b"\r\n", b"\x00", b"\x0b", b"\x1f", b"\x7f"]
ALLOWED_VALUE_BYTES = st.sampled_from([b"\t", b" ", *[bytes([c]) for c in range(0x21, 0x7F)],
                                       *[bytes([c]) for c in range(0x80, 0x100)]])


def _fields(value: bytes, name: bytes = b"x-a") -> list[tuple[bytes, bytes]]:
    return [(b"host", b"api.example"), (name, value)]


@pytest.mark.parametrize("bad", FORBIDDEN)
def test_control_bytes_in_a_value_are_refused(bad):
    with pytest.raises(BadRequest) as e:
        check_head("POST", "/v1", _fields(b"v" + bad + b"X-Injected: 1"))
    assert e.value.code is Code.BAD_REQUEST and "x-a" in e.value.reason


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(ALLOWED_VALUE_BYTES, max_size=40), st.sampled_from(FORBIDDEN),
       st.lists(ALLOWED_VALUE_BYTES, max_size=40))
def test_any_value_with_a_forbidden_byte_is_refused(before, bad, after):
    with pytest.raises(BadRequest):
        check_head("GET", "/", _fields(b"".join(before) + bad + b"".join(after)))


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(ALLOWED_VALUE_BYTES, max_size=60))
def test_field_values_without_control_bytes_pass(parts):
    check_head("GET", "/", _fields(b"".join(parts)))


@pytest.mark.parametrize("name", [b"x a", b"x:a", b"x\ra", b"", b"x\x00", b"(x)", b"\xc3\xa9"])
def test_bad_header_names_are_refused(name):
    with pytest.raises(BadRequest):
        check_head("GET", "/", _fields(b"v", name))


@pytest.mark.parametrize("method,path", [
    ("GET /evil HTTP/1.1\r\nX:", "/"), ("GET", "/p HTTP/1.1\r\nInjected: 1"), ("GET", "/a b"),
    ("G\x00T", "/"), ("", "/"), ("GET", "/\x7f"),
])
def test_method_and_target_cannot_split_the_request_line(method, path):
    with pytest.raises(BadRequest):
        check_head(method, path, [])


def test_a_normal_head_passes():
    check_head("POST", "/v1/messages?x=1", [(b"content-type", b"application/json"),
                                            (b"authorization", b"Bearer a\tb")])


@pytest.mark.parametrize("authority,want", [
    ("api.example", ("api.example", 443)), ("API.example.:8443", ("api.example", 8443)),
    ("[::1]:80", ("::1", 80)), ("127.1", ("127.0.0.1", 443)),
])
def test_split_authority(authority, want):
    assert split_authority(authority, "https") == want


@pytest.mark.parametrize("authority", ["a.example:", "a.example:0", "a.example:99999", "::1:80",
                                       "a b:1", "[::1"])
def test_split_authority_refuses(authority):
    with pytest.raises(BadRequest):
        split_authority(authority, "https")


def test_check_tunnel():
    info = RequestInfo("https", "api.example", 443, "GET", "/")
    check_tunnel(info, "api.example", 443, True, "API.example.")
    for args, code in [(("api.example", 443, False, "api.example"), Code.NOT_TLS),
                       (("other.example", 443, True, "other.example"), Code.BAD_REQUEST),
                       (("api.example", 443, True, "other.example"), Code.BAD_REQUEST),
                       (("api.example", 443, True, None), Code.BAD_REQUEST)]:
        with pytest.raises(BadRequest) as e:
            check_tunnel(info, *args)
        assert e.value.code is code
