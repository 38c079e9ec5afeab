"""The two pure helpers the Claude Code test (tests/integration/test_agent_claude_code.py) rests
on: the stand-in's deltas really cut each copy of the key where asked, and the leak measure
finds the longest run of a secret, against a brute-force reference."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.anthropic_api import split_copies
from tests.support.secrets import assert_secret_runs_at_most, longest_secret_run

ALNUM = string.ascii_letters + string.digits
keys = st.text(ALNUM, min_size=2, max_size=40)


@given(keys, st.data())
def test_each_copy_is_cut_at_its_positions(key: str, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.lists(st.integers(0, len(key)), max_size=4), max_size=6))
    deltas = split_copies(key, cuts)
    joined = "".join(deltas)
    assert joined.startswith("Here are the copies.\n") and joined.endswith("That is all.")
    assert joined.count(f": {key}\n") == len(cuts)
    # Where each delta ends, counted in the joined text: copy i starts after its label, and
    # every one of its positions is a boundary.
    ends, at = set(), 0
    for d in deltas:
        at += len(d)
        ends.add(at)
    for i, ks in enumerate(cuts):
        start = joined.index(f"copy {i}: ") + len(f"copy {i}: ")
        assert joined[start:start + len(key)] == key
        assert {start + k for k in ks} <= ends


def test_a_single_cut_and_a_character_per_delta() -> None:
    key = "fakeKeyABCDEF"
    assert split_copies(key, [(4,)]) == ["Here are the copies.\ncopy 0: fake",
                                         "KeyABCDEF\nThat is all."]
    deltas = split_copies(key, [range(1, len(key))])
    assert deltas[1:-1] == list(key[1:-1])


def reference_run(haystack: str, secret: str) -> int:
    hay, sec = haystack.lower(), secret.lower()
    return max((j - i for i in range(len(sec)) for j in range(i + 1, len(sec) + 1)
                if sec[i:j] in hay), default=0)


@given(st.text("abAB01-", max_size=30), st.text("abAB01-", max_size=12))
def test_longest_run_matches_the_reference(haystack: str, secret: str) -> None:
    assert longest_secret_run(haystack, secret) == reference_run(haystack, secret)


def test_a_split_key_rejoined_is_a_full_run() -> None:
    key = "fakeKeyABCDEFGH1234"
    assert longest_secret_run("".join(split_copies(key, [(5,)])), key) == len(key)
    assert longest_secret_run(f"x {key[:7]}[REDACTED:k] y", key) == 7
    assert longest_secret_run(f"x {key[:7].upper()} y", key) == 7  # case is ignored


def test_the_assertion_names_where_and_how_long_never_the_value() -> None:
    key = "fakeKeyABCDEFGH1234"
    assert_secret_runs_at_most({"ok": key[:7]}, key, 7)
    with pytest.raises(AssertionError) as err:
        assert_secret_runs_at_most({"ok": key[:7], "out": f"a {key[2:12]} b"}, key, 7)
    message = str(err.value)
    assert "out: 10" in message and "ok:" not in message
    assert longest_secret_run(message, key) <= 3
