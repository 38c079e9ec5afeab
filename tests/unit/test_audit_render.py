"""The audit line's rendering and the audit fields' scrubbing, against what they replaced."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.audit import events as A
from sandgate.audit.chain import render
from sandgate.scrub.scrubber import SecretSet

pytestmark = pytest.mark.unit

FAKE = {"k": "FAKE-VALUE-123", "other": "another-fake-value-456"}


def _scrubbed_one_by_one(fields: dict[str, Any], secrets: SecretSet) -> dict[str, Any]:
    """scrub_fields as it was: each field scanned on its own."""
    for key in A.SCRUBBED:
        value = fields.get(key)
        if isinstance(value, str):
            fields[key] = secrets.scrub_text(value)[0]
    for call in fields.get("rpc") or ():
        for k, v in call.items():
            if isinstance(v, str):
                call[k] = secrets.scrub_text(v)[0]
    return fields


piece = st.one_of(st.sampled_from([*FAKE.values(), "FAKE-VALUE", "\n", "%2F", "é"]),
                  st.text(max_size=6))
text = st.lists(piece, max_size=4).map("".join)
fields = st.fixed_dictionaries(
    {}, optional={A.PATH: text, A.HOST: text, A.REASON: text, A.ERROR: st.none(),
                  "rpc": st.lists(st.fixed_dictionaries({"method": text, "id": st.integers()}),
                                  max_size=2)})


@given(fields)
def test_scrub_fields_equals_the_field_by_field_scrub(f: dict[str, Any]) -> None:
    secrets = SecretSet(FAKE)
    want = _scrubbed_one_by_one(json.loads(json.dumps(f)), secrets)
    assert A.scrub_fields(json.loads(json.dumps(f)), secrets) == want


def test_scrub_fields_with_a_value_in_one_field_only() -> None:
    secrets = SecretSet(FAKE)
    out = A.scrub_fields({A.PATH: "/x", A.HOST: "h", A.REASON: "got FAKE-VALUE-123",
                          "rpc": [{"tool": "t"}]}, secrets)
    assert "FAKE-VALUE-123" not in json.dumps(out) and out[A.PATH] == "/x"


@given(st.dictionaries(st.text(max_size=5), st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.text(max_size=3), max_size=3), st.just(datetime(2026, 1, 2, tzinfo=UTC))),
    max_size=6))
def test_render_is_json_dumps_with_str_default(obj: dict[str, Any]) -> None:
    assert render(obj) == json.dumps(obj, default=str)


def _scrub_headers_one_by_one(h: Any, secrets: SecretSet) -> int:
    """scrub_headers as it was: every name and every value scanned on its own."""
    count = 0
    fields = []
    for k, v in h.fields:
        if secrets.find(k):
            count += 1
            continue
        clean, n = secrets.scrub(v)
        fields.append((k, clean))
        count += n
    if count:
        h.fields = tuple(fields)
    return count


header_bytes = st.lists(st.one_of(
    st.sampled_from([v.encode() for v in FAKE.values()] + [b"FAKE-VALUE-123".lower(), b"\x00"]),
    st.binary(max_size=5)), max_size=3).map(b"".join)


@given(st.lists(st.tuples(header_bytes.filter(bool), header_bytes), max_size=5))
def test_scrub_headers_equals_the_field_by_field_scrub(fs: list[tuple[bytes, bytes]]) -> None:
    from mitmproxy import http

    from sandgate.scrub.stream import scrub_headers

    secrets = SecretSet(FAKE)
    want, got = http.Headers(fs), http.Headers(fs)
    assert scrub_headers(got, secrets) == _scrub_headers_one_by_one(want, secrets)
    assert got.fields == want.fields
