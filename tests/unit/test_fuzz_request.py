"""Property-based fuzzing of the request parsers: `parse_url` (check, explain, fixtures, the API)
and `check_head` (what may be re-serialised to an upstream)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.errors import BadRequest, Code
from sandgate.policy.hosts import normalise_host
from sandgate.request import RequestInfo, check_head, parse_url
from tests.unit.fuzz import examples

# ----------------------------------------------------------------------------------- parse_url

AUTHORITY_PARTS = ["api.example.com", "EXAMPLE.com.", "127.1", "0x7f000001", "[::1]", "[::1",
                   "::1]", "[abc]", "[::1]x", "[::ffff:127.0.0.1]", "[fe80::1%25eth0]", "u:p@h",
                   "@h", "h:", "h:0", "h:65535", "h:65536", "h:-1", "h:+1", "h: 1", "h:0x10",
                   "h:\u0661", "b\u00fccher.de", "a..b", "", "x%2ey", "h#", "h?", "h\\x"]
url_texts = st.one_of(
    st.builds(lambda s, a, p: f"{s}{a}{p}",
              st.sampled_from(["https://", "http://", "HTTP://", "ftp://", "https:", "https:/",
                               "//", ""]),
              st.one_of(st.sampled_from(AUTHORITY_PARTS), st.text(max_size=12)),
              st.one_of(st.sampled_from(["", "/", "/v1?x=1", "#f", "?q", "/a b", "/%zz",
                                         "/\x00"]),
                        st.text(max_size=10))),
    st.text(max_size=40),
)
methods = st.one_of(st.sampled_from(["GET", "get", " POST ", "", "GE T", "M\u00e9"]),
                    st.text(max_size=6))


@settings(max_examples=examples(300))
@given(methods, url_texts)
def test_parse_url_returns_a_request_or_raises_bad_request(method: str, url: str) -> None:
    try:
        info = parse_url(method, url)
    except BadRequest as e:
        assert isinstance(e, ValueError)
        assert e.code == Code.BAD_REQUEST and e.reason
        return
    assert isinstance(info, RequestInfo)
    assert info.scheme in ("https", "http")
    assert normalise_host(info.host) == info.host
    assert 1 <= info.port <= 65535
    assert info.method == info.method.upper() and info.method
    assert info.path.startswith("/")
    assert "?" not in info.path and "#" not in info.path


@pytest.mark.parametrize("url", ["http://[::1", "http://[abc]/", "http://a]/", "https://[::1]x/",
                                 "https://[::1]x:443/"])
def test_malformed_brackets_are_bad_requests(url: str) -> None:
    """Regressions: urlsplit's own ValueError escaped parse_url as a plain ValueError, and text
    between ']' and the port was silently dropped (judging a URL as another host)."""
    with pytest.raises(BadRequest):
        parse_url("GET", url)


def test_bracketed_hosts_still_parse() -> None:
    assert parse_url("GET", "https://[::1]/x").host == "::1"
    assert parse_url("GET", "https://[::1]:8443/x").port == 8443
    assert parse_url("GET", "https://[::ffff:127.0.0.1]:80/").host == "::ffff:127.0.0.1"


# ---------------------------------------------------------------------------------- check_head

TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
BAD_VALUE_BYTES = bytes([*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F])
GOOD_VALUE_BYTES = bytes(b for b in range(256) if b not in BAD_VALUE_BYTES)

def bytes_of(alphabet: bytes, min_size: int = 0, max_size: int = 10) -> st.SearchStrategy[bytes]:
    return st.text(alphabet=alphabet.decode("latin-1"), min_size=min_size,
                   max_size=max_size).map(lambda t: t.encode("latin-1"))


names = st.one_of(bytes_of(TCHAR, min_size=1, max_size=12), st.binary(max_size=12))
good_values = bytes_of(GOOD_VALUE_BYTES, max_size=20)
fields = st.lists(st.tuples(names, st.one_of(good_values, st.binary(max_size=20))), max_size=5)


def is_token(name: bytes) -> bool:
    return bool(name) and all(b in TCHAR for b in name)


def value_ok(value: bytes) -> bool:
    return not any(b in BAD_VALUE_BYTES for b in value)


@settings(max_examples=examples(200))
@given(st.sampled_from(["GET", "POST", "M-SEARCH"]), st.sampled_from(["/", "/v1/x?y=1", "*"]),
       fields)
def test_check_head_accepts_exactly_the_valid_heads(method: str, path: str,
                                                    head: list[tuple[bytes, bytes]]) -> None:
    valid = all(is_token(n) and value_ok(v) for n, v in head)
    try:
        check_head(method, path, head)
    except BadRequest as e:
        assert e.code == Code.BAD_REQUEST
        assert not valid, head
        return
    assert valid, head


@given(st.lists(st.tuples(bytes_of(TCHAR, min_size=1, max_size=8), good_values),
                max_size=3),
       bytes_of(TCHAR, min_size=1, max_size=8), good_values, good_values,
       st.sampled_from(BAD_VALUE_BYTES))
def test_any_control_byte_in_a_value_is_refused(before: list[tuple[bytes, bytes]], name: bytes,
                                                left: bytes, right: bytes, bad: int) -> None:
    check_head("GET", "/", before)
    with pytest.raises(BadRequest):
        check_head("GET", "/", [*before, (name, left + bytes([bad]) + right)])


@given(bytes_of(TCHAR, max_size=6), bytes_of(TCHAR, max_size=6),
       st.integers(0, 255).filter(lambda b: b not in TCHAR), good_values)
def test_any_non_token_name_is_refused(left: bytes, right: bytes, bad: int,
                                       value: bytes) -> None:
    with pytest.raises(BadRequest):
        check_head("GET", "/", [(left + bytes([bad]) + right, value)])
    with pytest.raises(BadRequest):
        check_head("GET", "/", [(b"", value)])


@given(st.text(max_size=8), st.text(max_size=12))
def test_method_and_target(method: str, path: str) -> None:
    ok = (bool(method) and all(ord(c) < 128 and c.encode() in [bytes([b]) for b in TCHAR]
                               for c in method)
          and not any(ord(c) <= 0x20 or ord(c) == 0x7F for c in path))
    try:
        check_head(method, path, [])
    except BadRequest:
        assert not ok
        return
    assert ok
