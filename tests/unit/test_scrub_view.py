"""The unwrapping view (sandgate.scrub.view): the fast path for text wrapped the usual way gives
the same view and the same offsets as the general loop, whatever the data."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.scrub import view
from sandgate.scrub.view import View, view_text
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(100), deadline=None, database=None)


@SETTINGS
@given(st.lists(st.text(alphabet="ab=x", max_size=9), max_size=12),
       st.sampled_from(["\n", "\r\n"]), st.text(alphabet="ab=\r\n", max_size=6))
def test_the_fast_view_equals_the_general_one(lines: list[str], sep: str, tail: str) -> None:
    for data in ((sep.join(lines)).encode(), (sep.join(lines) + tail).encode()):
        fast = View(data)
        slow = View(b"")
        slow.data = data
        slow.text = slow._general(data)
        assert fast.text == slow.text
        for i in range(len(fast.text)):
            assert fast.origin(i) == slow.origin(i), (data, i)
        for tail_window in (4096, 0):  # the walk back from the end, and the full list
            view._TAIL = tail_window
            try:
                for i in range(len(fast.text)):
                    assert View(data).origin(i) == slow.origin(i)
            finally:
                view._TAIL = 4096


def test_a_needle_is_spelled_as_the_view_spells_it() -> None:
    assert view_text(b"plain") == b"plain"
    assert view_text(b"ab=3Dcd") == b"ab=cd"  # an escape decoded
    assert view_text(b"abc\ndef") == b"abcdef"  # a lone break taken out
    assert view_text(b"abc\n\ndef") == b"abc\n\ndef"  # a blank line kept
