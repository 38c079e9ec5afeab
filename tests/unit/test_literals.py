"""`sandgate.scrub.literals.LiteralSet`: every occurrence of every word, checked against a
brute-force reference, for any bytes (NUL and non-ASCII included), from any thread; and the
streaming scrubber built on it equal to the whole-body scrub for large bodies cut anywhere.

Values are random hypothesis data or obvious fakes, compared, never printed.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.scrub.literals import LiteralSet
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.forms import classified_forms
from tests.unit.fuzz import examples

SETTINGS = settings(max_examples=examples(150), deadline=None, database=None)


def reference(words: dict[bytes, int], data: bytes, start: int = 0) -> list[tuple[int, int]]:
    """Every (last index, value), ascending index, longest first at one index."""
    found = [(i + len(w) - 1, len(w), v) for w, v in words.items()
             for i in range(start, len(data) - len(w) + 1) if data.startswith(w, i)]
    return [(end, v) for end, _, v in sorted(found, key=lambda f: (f[0], -f[1]))]


@SETTINGS
@given(st.lists(st.binary(min_size=1, max_size=6), min_size=1, max_size=8),
       st.binary(max_size=80), st.integers(min_value=0, max_value=90))
def test_every_occurrence_like_the_reference(words: list[bytes], data: bytes,
                                             start: int) -> None:
    table = {w: i for i, w in enumerate(dict.fromkeys(words))}
    lit = LiteralSet(table)
    assert lit.ends(data, start) == reference(table, data, start)


@SETTINGS
@given(st.lists(st.sampled_from([b"\x00", b"a", b"\x00a", b"a\x00", b"\xff", b"\x00\x00"]),
                min_size=1, max_size=5),
       st.lists(st.sampled_from([b"\x00", b"a", b"b", b"\xff"]), max_size=40))
def test_nul_bytes_are_part_of_a_word(words: list[bytes], pieces: list[bytes]) -> None:
    """The binding's pure-literal compiler would cut a word at a NUL: such words go through
    escaped patterns, and both kinds match together."""
    table = {w: i for i, w in enumerate(dict.fromkeys(words))}
    data = b"".join(pieces)
    assert LiteralSet(table).ends(data) == reference(table, data)


@SETTINGS
@given(st.lists(st.binary(min_size=1, max_size=5), min_size=1, max_size=8),
       st.binary(max_size=6))
def test_prefix_state(words: list[bytes], s: bytes) -> None:
    lit = LiteralSet(dict.fromkeys(words, 0))
    longer = any(w.startswith(s) and len(w) > len(s) for w in words)
    assert lit.prefix_state(s) == (longer, s in words)


def test_empty_word_is_refused_and_no_words_match_nothing() -> None:
    with pytest.raises(ValueError, match="empty word"):
        LiteralSet({b"": 1})
    assert LiteralSet({}).ends(b"anything") == []


def test_scans_from_many_threads_at_once() -> None:
    """Hyperscan releases the GIL while scanning: each thread has its own scratch space."""
    words = {b"FAKE-KEY-%d" % i: i for i in range(50)}
    lit = LiteralSet(words)
    rng = random.Random(7)
    data = b"".join(rng.choice([b"FAKE-KEY-%d" % rng.randrange(60), os.urandom(30)])
                    for _ in range(3000))
    want = reference(words, data)
    results: list[list[tuple[int, int]]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                results.append(lit.ends(data))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 20 and all(r == want for r in results)


def test_large_body_streamed_in_random_chunks_equals_whole() -> None:
    """A download's worth of bytes with every form of two fake keys scattered in it (some cut
    across chunk boundaries): the stream scrubs exactly as the whole body does."""
    values = {"one": b"fake-bulk-key-0001", "two": bytes(range(256))[:40]}
    secrets = SecretSet(values)
    rng = random.Random(99)
    forms = sorted({f for v in values.values() for f in classified_forms(v)})
    body = bytearray()
    while len(body) < 3 * 1024 * 1024:
        body += os.urandom(rng.randrange(1, 64 * 1024))
        body += rng.choice(forms)
    data = bytes(body)
    want, want_n = secrets.scrub(data)
    assert want_n >= 40
    s = secrets.scrubber()
    out, i = [], 0
    while i < len(data):
        step = rng.choice([1, 7, 4096, 65536, 262144, 1 << 20])
        out.append(s.feed(data[i:i + step]))
        i += step
    out.append(s.flush())
    assert b"".join(out) == want and s.replacements == want_n
