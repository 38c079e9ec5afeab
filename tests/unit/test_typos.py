"""review/typos.py: the capped edit distance the typo lints use."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st

from sandgate.review.typos import edits

words = st.text(alphabet="abc.-", max_size=8)


def _levenshtein(a: str, b: str) -> int:
    """The textbook recursion, as the reference."""

    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


@given(words, words)
def test_edits_is_levenshtein_capped_at_three(a: str, b: str) -> None:
    assert edits(a, b) == min(_levenshtein(a, b), 3)


@given(words, words)
def test_edits_is_symmetric(a: str, b: str) -> None:
    assert edits(a, b) == edits(b, a)


def test_typos_of_a_host() -> None:
    assert edits("api.github.com", "api.github.com") == 0
    assert edits("api.githb.com", "api.github.com") == 1  # a letter dropped
    assert edits("api.gihtub.com", "api.github.com") == 2  # two letters swapped
    assert edits("api.github.com", "github.com") == 3  # lengths apart: not a typo
