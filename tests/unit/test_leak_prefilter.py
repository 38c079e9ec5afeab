"""find_leaks' joined search (inject.no_values) never hides a leak the part-by-part search finds."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.inject import find_leaks_in, no_values
from sandgate.scrub.scrubber import SecretSet

pytestmark = pytest.mark.unit

KEY = "fake-key-0123456789abcdef"
SECRETS = SecretSet({"api": KEY, "padded": "fake-pad-a"})  # base64 of the latter ends in "="
FORMS = [KEY.encode(), KEY.upper().encode(), base64.b64encode(KEY.encode()),
         base64.b64encode(b"fake-pad-a"), b"fake-pad-a"]


@st.composite
def blob(draw: st.DrawFn) -> bytes:
    pieces = draw(st.lists(st.one_of(
        st.sampled_from(FORMS),
        st.sampled_from([b"\n", b"\r\n", b"\r", b"=", b"=\n", b"\n\n", b"\x00", b" "]),
        st.binary(max_size=6)), max_size=6))
    out = b"".join(pieces)
    if draw(st.booleans()) and out:  # cut a form by a break somewhere (wrapped base64, MIME)
        i = draw(st.integers(0, len(out)))
        out = out[:i] + draw(st.sampled_from([b"\n", b"\r\n", b"=\n", b"=\r\n"])) + out[i:]
    return out


def _one_by_one(blobs: list[bytes]) -> list[str]:
    return sorted(lk.secret for b in blobs for lk in find_leaks_in(b, "x", {}, SECRETS,
                                                                    frozenset()))


@given(st.lists(blob(), min_size=1, max_size=4))
def test_no_values_only_when_no_part_has_one(blobs: list[bytes]) -> None:
    if no_values(blobs, SECRETS):
        assert _one_by_one(blobs) == []


PAD = base64.b64encode(b"fake-pad-a")  # ends in "=="


@pytest.mark.parametrize("blobs", [
    [b"/v1/x", PAD[:4] + b"\n" + PAD[4:]],  # the value's view ends a part with "="
    [PAD[:6] + b"=\n" + PAD[6:], b"b"],  # a soft break inside it
    [b"a", KEY.encode()[:5] + b"\r\n" + KEY.encode()[5:]],
    [b"head: " + KEY.encode(), b""],
    [b"", b"", PAD],
])
def test_a_value_in_any_part_is_seen(blobs: list[bytes]) -> None:
    assert _one_by_one(blobs)  # what the part-by-part search finds...
    assert not no_values(blobs, SECRETS)  # ...the joined one does not rule out


def test_large_requests_are_searched_part_by_part() -> None:
    assert not no_values([b"x" * (64 * 1024 + 1)], SECRETS)
    assert no_values([b"x" * 100, b"y"], SECRETS)
