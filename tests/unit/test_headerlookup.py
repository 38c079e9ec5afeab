"""headerlookup's Headers.get / in / get_all answer exactly what mitmproxy 11.0.2's do."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.coretypes.multidict import _MultiDict

from sandgate.mitm.speedups import headerlookup

pytestmark = pytest.mark.unit

NAMES = ["Host", "content-length", "Content-Length", "X-Ä", "x-ä", "CONNECTION", "expect"]
name_bytes = st.one_of(st.sampled_from([n.encode() for n in NAMES]),
                       st.binary(min_size=1, max_size=6))
value_bytes = st.one_of(st.sampled_from([b"", b"close", b"12", b"\xff\xfe", "ü".encode()]),
                        st.binary(max_size=8))
fields = st.lists(st.tuples(name_bytes, value_bytes), max_size=6)
keys = st.one_of(st.sampled_from(NAMES), st.sampled_from([n.encode() for n in NAMES]),
                 st.text(max_size=4), st.binary(max_size=4))


def _original(op: str, h: http.Headers, key: Any) -> Any:
    try:
        if op == "get":
            return ("ok", _MultiDict.get(h, key, "default"))  # Mapping.get over the originals
        if op == "in":
            return ("ok", _MultiDict.__contains__(h, key))
        return ("ok", headerlookup.ORIGINAL_GET_ALL(h, key))
    except Exception as e:  # the same failure is part of the contract
        return ("raises", type(e))


def _patched(op: str, h: http.Headers, key: Any) -> Any:
    try:
        if op == "get":
            return ("ok", headerlookup.get(h, key, "default"))
        if op == "in":
            return ("ok", headerlookup.contains(h, key))
        return ("ok", headerlookup.get_all(h, key))
    except Exception as e:
        return ("raises", type(e))


@pytest.fixture(autouse=True)
def originals(monkeypatch: pytest.MonkeyPatch) -> None:
    # the comparison runs against mitmproxy's own code, whether or not install() ran before
    monkeypatch.setattr(http.Headers, "get_all", headerlookup.ORIGINAL_GET_ALL)
    monkeypatch.setattr(http.Headers, "get", headerlookup.ORIGINAL_GET)
    monkeypatch.setattr(http.Headers, "__contains__", headerlookup.ORIGINAL_CONTAINS)
    monkeypatch.setattr(http.Headers, headerlookup._MARK, False, raising=False)  # undone after


@given(fields, keys, st.sampled_from(["get", "in", "get_all"]))
def test_lookups_equal_mitmproxys(fs: list[tuple[bytes, bytes]], key: Any, op: str) -> None:
    h = http.Headers(fs)
    assert _patched(op, h, key) == _original(op, h, key)


@pytest.mark.parametrize("key", [None, 3, 1.5, ["host"]])
@pytest.mark.parametrize("op", ["get", "in", "get_all"])
def test_names_that_are_not_str_or_bytes_fail_as_before(key: Any, op: str) -> None:
    h = http.Headers([(b"Host", b"a")])
    got, want = _patched(op, h, key), _original(op, h, key)
    assert got == want and got[0] == "raises"


def test_install_puts_them_on_headers_once() -> None:
    headerlookup.install()
    headerlookup.install()
    assert headerlookup.installed()
    h = http.Headers([(b"Content-Length", b"1"), (b"x-a", b"1"), (b"X-A", b"\xff")])
    assert h.get("content-length") == "1" and h.get("missing") is None
    assert h.get("x-a") == "1, \udcff"  # folded, undecodable bytes kept (surrogateescape)
    assert h.get_all(b"X-a") == ["1", "\udcff"]
    assert "CONTENT-LENGTH" in h and "missing" not in h
    assert h.pop("x-a") == "1, \udcff" and "x-a" not in h


def test_name_cache_is_bounded_and_answers_like_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headerlookup, "_KEYS", {})
    h = http.Headers([(b"X-0", b"a")])
    for i in range(1100):
        assert headerlookup.get(h, f"x-{i}") == ("a" if i == 0 else None)
    assert len(headerlookup._KEYS) == 1024
    assert headerlookup.get(h, "X-0") == "a" and headerlookup.contains(h, "x-1099") is False


edit = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(NAMES), st.text(max_size=3)),
    st.tuples(st.just("add"), st.sampled_from(NAMES), st.text(max_size=3)),
    st.tuples(st.just("del"), st.sampled_from(NAMES), st.just("")),
    st.tuples(st.just("fields"), st.just(""), st.just("")),
)


@given(fields, st.lists(st.tuples(edit, keys, st.sampled_from(["get", "in", "get_all"])),
                        max_size=8))
def test_remembered_names_follow_every_change(fs: list[tuple[bytes, bytes]],
                                              steps: list[Any]) -> None:
    h = http.Headers(fs)
    for (change, name, value), key, op in steps:
        if change == "set":
            h[name] = value
        elif change == "add":
            h.add(name, value)
        elif change == "del" and name in h:
            del h[name]
        elif change == "fields":
            h.fields = (*h.fields, (b"X-New", b"v"))
        assert _patched(op, h, key) == _original(op, h, key)
