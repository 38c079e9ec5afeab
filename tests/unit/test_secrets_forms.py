"""The forms of a secret value that scrubbing and exfiltration checks look for.

Each form is checked against the real encoder it stands for, with the value embedded in a
larger input. All values are obvious fakes or random hypothesis data.
"""

from __future__ import annotations

import base64
import binascii
import json
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from sandgate.secrets.forms import (
    MIN_DERIVED_LEN,
    basic_auth_form,
    classified_forms,
    encoded_forms,
    query_forms,
)

FAKE = b"FAKE-test-key-0123456789"
SETTINGS = settings(max_examples=150, deadline=None, database=None)

values = st.binary(min_size=1, max_size=40)
texts = st.text(min_size=1, max_size=24)
fillers = st.binary(max_size=6)


def test_empty_value_has_no_forms() -> None:
    assert encoded_forms(b"") == frozenset()
    assert classified_forms(b"") == {}


def test_raw_always_kept_even_when_short() -> None:
    assert classified_forms(b"a") == {b"a": "raw"}  # every derived form is under the minimum
    assert classified_forms(b"ab") == {b"ab": "raw", b"\\u0061\\u0062": "json"}


@SETTINGS
@given(values)
def test_derived_forms_respect_the_minimum_and_raw_comes_first(value: bytes) -> None:
    forms = classified_forms(value)
    assert next(iter(forms.items())) == (value, "raw")
    assert all(len(f) >= MIN_DERIVED_LEN for f, kind in forms.items() if kind != "raw")
    assert encoded_forms(value) == frozenset(forms)


def test_fake_key_forms_by_kind() -> None:
    forms = classified_forms(FAKE)
    by_kind: dict[str, set[bytes]] = {}
    for form, kind in forms.items():
        by_kind.setdefault(kind, set()).add(form)
    assert by_kind["raw"] == {FAKE}
    assert by_kind["hex"] == {FAKE.hex().encode(), FAKE.hex().upper().encode()}
    assert base64.b64encode(FAKE) in by_kind["base64"]
    assert "".join(f"%{b:02x}" for b in FAKE).encode() in by_kind["percent"]
    assert "".join(f"\\u{b:04X}" for b in FAKE).encode() in by_kind["json"]
    # its quote() and json.dumps() spellings are the raw value itself: listed once, as raw
    assert urllib.parse.quote(FAKE, safe="").encode() == FAKE
    assert json.dumps(FAKE.decode())[1:-1].encode() == FAKE


@SETTINGS
@given(values, fillers, fillers, st.booleans())
def test_base64_core_occurs_in_any_enclosing_blob(
    value: bytes, prefix: bytes, suffix: bytes, urlsafe: bool
) -> None:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    blob = encode(prefix + value + suffix)
    k = len(prefix) % 3
    core = encode(bytes(k) + value)[(8 * k + 5) // 6: 8 * (k + len(value)) // 6]
    assert core in blob
    if len(core) >= MIN_DERIVED_LEN:
        assert core in encoded_forms(value)
    # ending the blob, the padded tail is a form too (the longest one, so a scrub takes it all)
    padded = encode(bytes(k) + value)[(8 * k + 5) // 6:]
    assert encode(prefix + value).endswith(padded)
    if len(padded) >= MIN_DERIVED_LEN:
        assert padded in encoded_forms(value)


@SETTINGS
@given(values, fillers, fillers)
def test_hex_occurs_in_any_enclosing_dump(value: bytes, prefix: bytes, suffix: bytes) -> None:
    dump = binascii.hexlify(prefix + value + suffix)
    forms = encoded_forms(value)
    if 2 * len(value) >= MIN_DERIVED_LEN:
        assert binascii.hexlify(value) in forms and binascii.hexlify(value) in dump
        assert binascii.hexlify(value).upper() in forms


@SETTINGS
@given(texts, st.sampled_from(["", "/", "!~*'()"]), st.booleans())
def test_percent_forms_match_urllib(text: str, safe: str, plus: bool) -> None:
    value = text.encode()
    quoted = (urllib.parse.quote_plus if plus else urllib.parse.quote)(value, safe=safe).encode()
    forms = encoded_forms(value)
    if len(quoted) >= MIN_DERIVED_LEN and (not plus or safe == ""):
        assert quoted in forms
    every = "".join(f"%{b:02X}" for b in value).encode()
    if len(every) >= MIN_DERIVED_LEN:
        assert every in forms and every.lower() in forms


@SETTINGS
@given(texts)
def test_json_forms_match_json_dumps(text: str) -> None:
    forms = encoded_forms(text.encode())
    for ensure_ascii in (True, False):
        dumped = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1].encode()
        slashed = dumped.replace(b"/", b"\\/")
        for form in (dumped, slashed):
            if len(form) >= MIN_DERIVED_LEN:
                assert form in forms
    assert all(json.loads(b'"' + f + b'"') == text for f, k in classified_forms(
        text.encode()).items() if k == "json")


def test_json_upper_case_escapes_leave_escaped_backslashes_alone() -> None:
    text = "FAKE\\u00e9-\u00e9"  # a literal backslash-u, then a real e-acute
    forms = encoded_forms(text.encode())
    assert b"FAKE\\\\u00e9-\\u00E9" in forms
    assert b"FAKE\\\\U00E9-\\u00E9" not in forms


def test_values_that_are_not_utf8_have_no_json_forms() -> None:
    forms = classified_forms(b"FAKE\xff\xfe-not-utf8")
    assert "json" not in forms.values()
    assert "hex" in forms.values()


def test_lone_surrogates_never_raise() -> None:
    value = "FAKE-\ud800-lone".encode("utf-8", "surrogatepass")
    assert value in encoded_forms(value)
    assert query_forms("FAKE-\ud800") == frozenset()  # injection could not have sent it
    assert basic_auth_form("u", "FAKE-\ud800")


def test_basic_auth_form_is_what_injection_sends() -> None:
    form = basic_auth_form("FAKE-user", "FAKE-pass:w\u00f6rd")
    assert base64.b64decode(form) == "FAKE-user:FAKE-pass:w\u00f6rd".encode()


@SETTINGS
@given(st.text(min_size=1, max_size=30))
def test_query_forms_match_what_mitmproxy_puts_on_the_wire(value: str) -> None:
    req = http.Request.make("GET", "http://example.test/path?a=1")
    req.query["key"] = value
    sent = req.path.encode()
    forms = query_forms(value)
    assert any(b"key=" + f in sent for f in forms)
    assert all(f == f.strip() for f in forms)


@pytest.mark.parametrize(
    "value, sent, lowered",
    [
        ("FAKE key+a/b", "FAKE+key%2Ba%2Fb", "FAKE+key%2ba%2fb"),
        ("FAKE-\u00e9", "FAKE-%C3%A9", "FAKE-%c3%a9"),
        ("FAKE-plain", "FAKE-plain", "FAKE-plain"),
    ],
)
def test_query_forms_examples(value: str, sent: str, lowered: str) -> None:
    assert query_forms(value) == {sent.encode(), lowered.encode()}
    assert query_forms("") == frozenset()
