"""Scrubbing secret values: whole buffers, headers, and streams split at every possible point.

All "secrets" here are obvious fakes.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterable, Mapping

import pytest

from proxy.scrub import StreamScrubber, find_secrets, scrub_bytes, scrub_text

FAKE = {"api": b"FAKE-KEY-123"}
PREFIXES = {"short": b"FAKEKEY", "long": b"FAKEKEY-EXTENDED", "mid": b"FAKEKEY-EXT"}
OVERLAP = {"aba": b"abab", "bab": b"babx"}
TINY = {"one": b"x", "two": b"yz", "three": b"zzz"}


def stream(chunks: Iterable[bytes], secrets: Mapping[str, bytes]) -> tuple[bytes, StreamScrubber]:
    s = StreamScrubber(secrets)
    out = []
    for c in chunks:
        out.append(s.feed(c))
        assert s.held < max(s.max_len, 1)
    out.append(s.flush())
    assert s.held == 0
    return b"".join(out), s


def chunkings(data: bytes, cuts: int) -> Iterable[list[bytes]]:
    for points in itertools.combinations_with_replacement(range(len(data) + 1), cuts):
        bounds = [0, *points, len(data)]
        yield [data[a:b] for a, b in itertools.pairwise(bounds)]


# ------------------------------------------------------------------------------- whole buffers


def test_scrub_bytes_basic() -> None:
    out, n = scrub_bytes(b'{"key": "FAKE-KEY-123"} and FAKE-KEY-123', FAKE)
    assert out == b'{"key": "[REDACTED:api]"} and [REDACTED:api]'
    assert n == 2


def test_scrub_bytes_nothing_to_do() -> None:
    assert scrub_bytes(b"hello", FAKE) == (b"hello", 0)
    assert scrub_bytes(b"hello", {}) == (b"hello", 0)
    assert scrub_bytes(b"hello", {"empty": b""}) == (b"hello", 0)
    assert scrub_bytes(b"", FAKE) == (b"", 0)


def test_longest_match_at_a_position_wins() -> None:
    out, n = scrub_bytes(b"FAKEKEY-EXTENDED FAKEKEY-EXT FAKEKEY FAKEKEY-EX", PREFIXES)
    assert out == b"[REDACTED:long] [REDACTED:mid] [REDACTED:short] [REDACTED:short]-EX"
    assert n == 4


def test_secret_at_start_and_end() -> None:
    assert scrub_bytes(b"FAKE-KEY-123", FAKE) == (b"[REDACTED:api]", 1)
    assert scrub_bytes(b"FAKE-KEY-123FAKE-KEY-123", FAKE) == (b"[REDACTED:api]" * 2, 2)


def test_special_regex_characters_are_literal() -> None:
    secrets = {"re": b"a.b*c(d)[e]+?\\"}
    assert scrub_bytes(b"xa.b*c(d)[e]+?\\y aXbbc", secrets) == (b"x[REDACTED:re]y aXbbc", 1)


def test_shared_value_uses_the_first_name() -> None:
    assert scrub_bytes(b"same", {"first": b"same", "second": b"same"})[0] == b"[REDACTED:first]"


def test_scrub_text() -> None:
    text, n = scrub_text("Bearer FAKE-TOKEN-xyz; other=FAKE-TOKEN-xyz", {"tok": "FAKE-TOKEN-xyz"})
    assert text == "Bearer [REDACTED:tok]; other=[REDACTED:tok]"
    assert n == 2
    assert scrub_text("plain", {"tok": "FAKE-TOKEN-xyz", "e": ""}) == ("plain", 0)
    assert scrub_text("FAKEKEY-EXTENDED", {k: v.decode() for k, v in PREFIXES.items()}) == (
        "[REDACTED:long]", 1)


def test_find_secrets() -> None:
    needles = {"a": "FAKE-PLACEHOLDER-A", "b": "fake-value-b", "empty": ""}
    assert find_secrets("x FAKE-PLACEHOLDER-A y", needles) == ["a"]
    assert find_secrets(b"fake-value-b FAKE-PLACEHOLDER-A", needles) == ["a", "b"]
    assert find_secrets(b"nothing", needles) == []
    assert find_secrets("", needles) == []
    assert find_secrets("caf\u00e9-FAKE", {"u": "caf\u00e9"}) == ["u"]
    assert find_secrets("caf\u00e9-FAKE".encode(), {"u": "caf\u00e9"}) == ["u"]


# ------------------------------------------------------------------------------------ streams

STREAMS = [
    (b"..FAKE-KEY-123..FAKE-KEY-12..FAKE-KEY-123", FAKE),
    (b"FAKEKEY-EXTENDED|FAKEKEY-EXT|FAKEKEY|FAKEKEY-EXTENDE", PREFIXES),
    (b"ababab babx abababx", OVERLAP),
    (b"xyzzzzyzx", TINY),
]


@pytest.mark.parametrize("data, secrets", STREAMS)
@pytest.mark.parametrize("cuts", [1, 2, 3])
def test_every_chunking_equals_whole(data: bytes, secrets: Mapping[str, bytes], cuts: int) -> None:
    want, want_n = scrub_bytes(data, secrets)
    for chunks in chunkings(data, cuts):
        got, s = stream(chunks, secrets)
        assert got == want, chunks
        assert s.replacements == want_n


@pytest.mark.parametrize("data, secrets", STREAMS)
def test_one_byte_at_a_time(data: bytes, secrets: Mapping[str, bytes]) -> None:
    want, want_n = scrub_bytes(data, secrets)
    got, s = stream([data[i:i + 1] for i in range(len(data))], secrets)
    assert (got, s.replacements) == (want, want_n)


def test_random_chunkings() -> None:
    rng = random.Random(1234)
    secrets = {**FAKE, **PREFIXES, **OVERLAP, "z": b"zz"}
    pieces = [b"FAKE-KEY-123", b"FAKEKEY", b"FAKEKEY-EXTENDED", b"abab", b"babx", b"zz", b"z",
              b"FAKE-", b"-EXT", b"..", b"a", b"b", b"x", b"hello world "]
    for _ in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        want, want_n = scrub_bytes(data, secrets)
        chunks, i = [], 0
        while i < len(data):
            step = rng.choice([0, 1, 1, 2, 3, 5, 8, 13, 40])
            chunks.append(data[i:i + step])
            i += step
        got, s = stream(chunks, secrets)
        assert got == want
        assert s.replacements == want_n


def test_secret_split_across_many_chunks_is_never_emitted_in_part() -> None:
    s = StreamScrubber(FAKE)
    emitted = b""
    for b in b"pre FAKE-KEY-123 post":
        emitted += s.feed(bytes([b]))
        assert b"FAKE-KEY" not in emitted
    emitted += s.flush()
    assert emitted == b"pre [REDACTED:api] post"


def test_holdback_is_bounded() -> None:
    s = StreamScrubber(FAKE)
    out = s.feed(b"abcdefghijklmnopqrstuvwxyz")
    assert out == b"abcdefghijklmno"  # all but max_len - 1 = 11 bytes
    assert s.held == 11
    assert s.flush() == b"pqrstuvwxyz"
    assert s.held == 0


def test_no_secrets_passes_through() -> None:
    s = StreamScrubber({})
    assert s.feed(b"abc") == b"abc"
    assert s.flush() == b""
    s = StreamScrubber({"e": b""})
    assert s.feed(b"abc") == b"abc"


def test_short_secrets() -> None:
    got, s = stream([b"a", b"x", b"b", b"yz", b"y", b"z"], TINY)
    assert got == b"a[REDACTED:one]b[REDACTED:two][REDACTED:two]"
    assert s.replacements == 3


def test_flush_then_reuse() -> None:
    s = StreamScrubber(FAKE)
    assert s.feed(b"FAKE-KEY") == b""
    assert s.flush() == b"FAKE-KEY"
    assert s.feed(b"-123FAKE-KEY-123") == b"-123[REDACTED:api]"


def test_memory_bounded_and_fast_for_large_clean_streams() -> None:
    s = StreamScrubber({**FAKE, **PREFIXES})
    chunk = (b"The quick brown fox jumps over the lazy dog. FAKE " * 1400)[:64 * 1024]
    total = 0
    t0 = time.monotonic()
    for _ in range(160):  # 10 MiB
        total += len(s.feed(chunk))
        assert s.held < s.max_len
    total += len(s.flush())
    assert total == 160 * len(chunk)
    assert time.monotonic() - t0 < 5


def test_one_mib_chunks_with_secrets() -> None:
    rng = random.Random(7)
    filler = bytes(rng.randrange(32, 127) for _ in range(4096)).replace(b"F", b"f")
    body = (filler + b"FAKE-KEY-123") * 256 + filler  # ~1 MiB
    want, want_n = scrub_bytes(body, FAKE)
    assert want_n == 256
    t0 = time.monotonic()
    got, s = stream([body[: len(body) // 2], body[len(body) // 2:]], FAKE)
    assert got == want and s.replacements == 256
    assert time.monotonic() - t0 < 2
