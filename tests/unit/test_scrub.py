"""Scrubbing and detecting secret values: whole buffers, every encoded form, and streams split
at every possible point, checked against a brute-force reference.

All "secrets" here are obvious fakes or random hypothesis data; values are only ever compared
with `in` / `not in`, never printed.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import random
import re
import string
import urllib.parse
from collections.abc import Iterable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.scrub.scrubber import (
    REDACTED_TEMPLATE,
    Hit,
    SecretSet,
    StreamScrubber,
)
from sandgate.secrets.forms import basic_auth_form, classified_forms, query_forms
from tests.unit.fuzz import examples

FAKE = {"api": b"FAKE-KEY-123"}
PREFIXES = {"short": b"FAKEKEY", "long": b"FAKEKEY-EXTENDED", "mid": b"FAKEKEY-EXT"}
OVERLAP = {"aba": b"abab", "bab": b"babx"}
TINY = {"one": b"x", "two": b"yz", "three": b"zzz"}

SETTINGS = settings(max_examples=examples(120), deadline=None, database=None)
MARKER = re.compile(rb"\[REDACTED:[^\]]*\]")

Secrets = Mapping[str, str | bytes]


# ------------------------------------------------------------------------- reference model


def needle_table(secrets: Secrets, extra: Mapping[str, Iterable[bytes]] | None = None
                 ) -> dict[bytes, str]:
    """needle -> name, derived independently of SecretSet from the documented rules."""
    table: dict[bytes, str] = {}
    for name, value in secrets.items():
        raw = value.encode() if isinstance(value, str) else value
        for form in classified_forms(raw):
            table.setdefault(form, name)
    for name, forms in (extra or {}).items():
        for form in forms:
            if form:
                table.setdefault(form, name)
    return table


def longest_at(data: bytes, p: int, table: Mapping[bytes, str]) -> bytes | None:
    return max((k for k in table if data.startswith(k, p)), key=len, default=None)


def reference_scrub(data: bytes, table: Mapping[bytes, str]) -> tuple[bytes, int]:
    """Leftmost, longest at a position, non-overlapping: one position at a time."""
    out, p, n = bytearray(), 0, 0
    while p < len(data):
        best = longest_at(data, p, table)
        if best is None:
            out.append(data[p])
            p += 1
        else:
            out += REDACTED_TEMPLATE.format(name=table[best]).encode()
            p += len(best)
            n += 1
    return bytes(out), n


def reference_hold(data: bytes, table: Mapping[bytes, str]) -> int:
    """The least a stream may hold back after `data`: from the first position, on the whole
    scrub's path, whose rest is a proper prefix of some needle."""
    p = 0
    while p < len(data):
        rest = data[p:]
        if any(len(k) > len(rest) and k.startswith(rest) for k in table):
            return len(rest)
        best = longest_at(data, p, table)
        p += len(best) if best else 1
    return 0


def stream(chunks: Iterable[bytes], secrets: SecretSet) -> tuple[bytes, StreamScrubber]:
    s = secrets.scrubber()
    out = []
    for c in chunks:
        out.append(s.feed(c))
        assert s.held < max(secrets.max_len, 1)
    out.append(s.flush())
    assert s.held == 0
    return b"".join(out), s


def chunkings(data: bytes, cuts: int) -> Iterable[list[bytes]]:
    for points in itertools.combinations_with_replacement(range(len(data) + 1), cuts):
        bounds = [0, *points, len(data)]
        yield [data[a:b] for a, b in itertools.pairwise(bounds)]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def unmarked(data: bytes) -> bytes:
    """What a client gets by simply deleting the markers and joining the rest."""
    return MARKER.sub(b"", data)


# ------------------------------------------------------------------------------ whole buffers


def test_scrub_basic() -> None:
    out, n = SecretSet(FAKE).scrub(b'{"key": "FAKE-KEY-123"} and FAKE-KEY-123')
    assert out == b'{"key": "[REDACTED:api]"} and [REDACTED:api]'
    assert n == 2


def test_scrub_nothing_to_do() -> None:
    assert SecretSet(FAKE).scrub(b"hello") == (b"hello", 0)
    assert SecretSet({}).scrub(b"hello") == (b"hello", 0)
    assert SecretSet({"empty": b""}).scrub(b"hello") == (b"hello", 0)
    assert SecretSet({"empty": ""}, extra={"e": [b""]}).empty
    assert SecretSet(FAKE).scrub(b"") == (b"", 0)


def test_longest_match_at_a_position_wins() -> None:
    out, n = SecretSet(PREFIXES).scrub(b"FAKEKEY-EXTENDED FAKEKEY-EXT FAKEKEY FAKEKEY-EX")
    assert out == b"[REDACTED:long] [REDACTED:mid] [REDACTED:short] [REDACTED:short]-EX"
    assert n == 4


def test_secret_at_start_and_end() -> None:
    s = SecretSet(FAKE)
    assert s.scrub(b"FAKE-KEY-123") == (b"[REDACTED:api]", 1)
    assert s.scrub(b"FAKE-KEY-123FAKE-KEY-123") == (b"[REDACTED:api]" * 2, 2)


def test_special_regex_characters_are_literal() -> None:
    s = SecretSet({"re": b"a.b*c(d)[e]+?\\"})
    assert s.scrub(b"xa.b*c(d)[e]+?\\y aXbbc") == (b"x[REDACTED:re]y aXbbc", 1)


def test_shared_value_uses_the_first_name() -> None:
    assert SecretSet({"first": "same", "second": "same"}).scrub(b"same")[0] == (
        b"[REDACTED:first]")
    # also when one name's derived form is another's extra form
    s = SecretSet({"a": "FAKE-shared"}, extra={"b": [b"FAKE-shared", b"FAKE-own"]})
    assert s.scrub(b"FAKE-shared FAKE-own") == (b"[REDACTED:a] [REDACTED:b]", 2)


def test_scrub_text() -> None:
    s = SecretSet({"tok": "FAKE-TOKEN-xyz", "e": ""})
    text, n = s.scrub_text("Bearer FAKE-TOKEN-xyz; other=FAKE-TOKEN-xyz")
    assert text == "Bearer [REDACTED:tok]; other=[REDACTED:tok]"
    assert n == 2
    assert s.scrub_text("plain") == ("plain", 0)
    prefixes = SecretSet({k: v.decode() for k, v in PREFIXES.items()})
    assert prefixes.scrub_text("FAKEKEY-EXTENDED") == ("[REDACTED:long]", 1)


def test_scrub_text_non_ascii() -> None:
    s = SecretSet({"u": "FAKE-caf\u00e9-\u2603"})
    value = "FAKE-caf\u00e9-\u2603"
    text, n = s.scrub_text(f"\u00e0 {value} \u00e0 " + json.dumps(value))
    assert text == '\u00e0 [REDACTED:u] \u00e0 "[REDACTED:u]"'
    assert n == 2
    assert s.scrub_text("caf\u00e9") == ("caf\u00e9", 0)
    assert SecretSet({}).scrub_text("x") == ("x", 0)


def test_every_form_of_a_fake_key_is_scrubbed() -> None:
    key = "FAKE-test-key-with/slash+plus=0123456789"
    s = SecretSet({"api": key})
    for form in classified_forms(key.encode()):
        out, n = s.scrub(b"<" + form + b">")
        assert out == b"<[REDACTED:api]>" and n == 1


def test_extra_forms_are_scrubbed_exactly() -> None:
    s = SecretSet(
        {"pw": "FAKE-pass"},
        extra={"pw": [basic_auth_form("FAKE-user", "FAKE-pass"), *query_forms("FAKE pass/x")]},
    )
    header = b"Authorization: Basic " + basic_auth_form("FAKE-user", "FAKE-pass")
    assert s.scrub(header) == (b"Authorization: Basic [REDACTED:pw]", 1)
    assert s.scrub(b"GET /?k=FAKE+pass%2Fx HTTP/1.1") == (b"GET /?k=[REDACTED:pw] HTTP/1.1", 1)
    # the password's own base64 core sits inside the pair's: detection reports both
    assert s.find(header) == [Hit("pw", "base64"), Hit("pw", "own")]


@SETTINGS
@given(
    st.lists(st.text(alphabet="ab", min_size=1, max_size=5), min_size=1, max_size=6),
    st.text(alphabet="abc", max_size=40),
)
def test_scrub_matches_the_reference(needles: list[str], data: str) -> None:
    extra = {f"n{i}": [n.encode()] for i, n in enumerate(needles)}
    s = SecretSet({}, extra=extra)
    assert s.scrub(data.encode()) == reference_scrub(data.encode(), needle_table({}, extra))


# ------------------------------------------------------------------------ every encoded form

byte_values = st.binary(min_size=8, max_size=40)
text_values = st.text(min_size=3, max_size=20).filter(lambda t: len(t.encode()) >= 8)
fillers = st.binary(max_size=5)


def check_found_and_scrubbed(secrets: SecretSet, data: bytes) -> bytes:
    assert "k" in {h.name for h in secrets.find(data)}
    out, n = secrets.scrub(data)
    assert n >= 1
    return out


@SETTINGS
@given(st.one_of(byte_values, text_values.map(str.encode)), st.binary(max_size=20),
       st.binary(max_size=20))
def test_raw_value_in_random_data(value: bytes, before: bytes, after: bytes) -> None:
    out = check_found_and_scrubbed(SecretSet({"k": value}), before + value + after)
    assert value not in out and value not in unmarked(out)


def b64_decodings(data: bytes) -> list[bytes]:
    """Every way a client could decode base64 runs in `data`, at every alignment."""
    out = []
    for run in re.findall(rb"[A-Za-z0-9+/_-]+", data.replace(b"=", b"")):
        run = run.translate(bytes.maketrans(b"-_", b"+/"))
        for off in range(4):
            piece = run[off:]
            piece = piece[: len(piece) // 4 * 4]
            out.append(base64.b64decode(piece))
    return out


@SETTINGS
@given(byte_values, fillers, fillers, st.booleans())
def test_base64_in_a_real_blob(value: bytes, prefix: bytes, suffix: bytes, urlsafe: bool) -> None:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    for pre in (prefix[:n] for n in range(6)):
        blob = encode(pre + value + suffix)
        out = check_found_and_scrubbed(SecretSet({"k": value}), b'{"b": "' + blob + b'"}')
        for decoded in b64_decodings(out) + b64_decodings(unmarked(out)):
            assert value not in decoded


@SETTINGS
@given(text_values, st.text(max_size=5), st.text(max_size=5))
def test_base64_of_text_values(value: str, prefix: str, suffix: str) -> None:
    blob = base64.b64encode((prefix + value + suffix).encode())
    out = check_found_and_scrubbed(SecretSet({"k": value}), blob)
    for decoded in b64_decodings(out) + b64_decodings(unmarked(out)):
        assert value.encode() not in decoded


@SETTINGS
@given(st.one_of(byte_values, text_values.map(str.encode)), fillers, fillers, st.booleans())
def test_hex_in_a_real_dump(value: bytes, prefix: bytes, suffix: bytes, upper: bool) -> None:
    dump = binascii.hexlify(prefix + value + suffix)
    dump = dump.upper() if upper else dump
    out = unmarked(check_found_and_scrubbed(SecretSet({"k": value}), b"0x" + dump + b"\n"))
    for run in re.findall(rb"[0-9A-Fa-f]+", out):
        for off in (0, 1):
            piece = run[off:]
            assert value not in binascii.unhexlify(piece[: len(piece) // 2 * 2])


@SETTINGS
@given(st.one_of(byte_values, text_values.map(str.encode)), fillers, fillers,
       st.sampled_from(["quote", "quote/", "quote_plus", "every"]), st.booleans())
def test_percent_in_a_real_url(value: bytes, prefix: bytes, suffix: bytes, how: str,
                               lower: bool) -> None:
    whole = prefix + value + suffix
    if how == "every":
        quoted = "".join(f"%{b:02X}" for b in whole)
    elif how == "quote_plus":
        quoted = urllib.parse.quote_plus(whole, safe="")
    else:
        quoted = urllib.parse.quote(whole, safe="/" if how == "quote/" else "")
    if lower:
        quoted = re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), quoted)
    out = check_found_and_scrubbed(SecretSet({"k": value}), f"/p?q={quoted}&x=1".encode())
    for candidate in (out, unmarked(out)):
        if how == "quote_plus":
            candidate = candidate.replace(b"+", b" ")
        assert value not in urllib.parse.unquote_to_bytes(candidate)


@SETTINGS
@given(text_values, st.text(max_size=5), st.text(max_size=5), st.booleans(), st.booleans())
def test_json_in_a_real_document(value: str, prefix: str, suffix: str, ensure_ascii: bool,
                                 as_bytes: bool) -> None:
    doc = json.dumps({"echo": prefix + value + suffix}, ensure_ascii=ensure_ascii).encode()
    secrets = SecretSet({"k": value.encode() if as_bytes else value})
    out = check_found_and_scrubbed(secrets, doc)
    for candidate in (out, unmarked(out)):
        assert value not in json.loads(candidate)["echo"]


def test_json_escapes_other_encoders_use() -> None:
    key = "FAKE/key/\u00e9"
    s = SecretSet({"k": key})
    for doc in (b'"FAKE\\/key\\/\\u00E9"', b'"FAKE\\/key\\/\\u00e9"',
                "".join(f"\\u{ord(c):04X}" for c in key).encode()):
        assert s.scrub(doc)[1] == 1
        assert s.find(doc) == [Hit("k", "json")]


# ------------------------------------------------------------------------------ streams

STREAMS = [
    (b"..FAKE-KEY-123..FAKE-KEY-12..FAKE-KEY-123", FAKE),
    (b"FAKEKEY-EXTENDED|FAKEKEY-EXT|FAKEKEY|FAKEKEY-EXTENDE", PREFIXES),
    (b"ababab babx abababx", OVERLAP),
    (b"xyzzzzyzx", TINY),
]


@pytest.mark.parametrize("data, secrets", STREAMS)
@pytest.mark.parametrize("cuts", [1, 2, 3])
def test_every_chunking_equals_whole(data: bytes, secrets: Secrets, cuts: int) -> None:
    compiled = SecretSet(secrets)
    want, want_n = compiled.scrub(data)
    assert (want, want_n) == reference_scrub(data, needle_table(secrets))
    for chunks in chunkings(data, cuts):
        got, s = stream(chunks, compiled)
        assert got == want, chunks
        assert s.replacements == want_n


@pytest.mark.parametrize("data, secrets", STREAMS)
def test_one_byte_at_a_time(data: bytes, secrets: Secrets) -> None:
    compiled = SecretSet(secrets)
    want, want_n = compiled.scrub(data)
    got, s = stream([data[i:i + 1] for i in range(len(data))], compiled)
    assert (got, s.replacements) == (want, want_n)


def test_random_chunkings() -> None:
    rng = random.Random(1234)
    secrets = SecretSet({**FAKE, **PREFIXES, **OVERLAP, "z": b"zz"})
    pieces = [b"FAKE-KEY-123", b"FAKEKEY", b"FAKEKEY-EXTENDED", b"abab", b"babx", b"zz", b"z",
              b"FAKE-", b"-EXT", b"..", b"a", b"b", b"x", b"hello world ",
              b"46414b454b4559", b"RkFLRUtFWS1FWFRFTkRFRA==", b"%46%41%4b%45"]
    for _ in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        want, want_n = secrets.scrub(data)
        chunks, i = [], 0
        while i < len(data):
            step = rng.choice([0, 1, 1, 2, 3, 5, 8, 13, 40])
            chunks.append(data[i:i + step])
            i += step
        got, s = stream(chunks, secrets)
        assert got == want
        assert s.replacements == want_n


@SETTINGS
@given(
    st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=6),
    st.text(alphabet="abc", max_size=60),
    st.lists(st.integers(min_value=0, max_value=60), max_size=8),
)
def test_stream_equals_whole_and_holds_back_the_least(
    needles: list[str], data: str, cuts: list[int]
) -> None:
    """Needles that are prefixes of each other, overlap and repeat: the hard cases."""
    extra = {f"n{i}": [n.encode()] for i, n in enumerate(needles)}
    table = needle_table({}, extra)
    secrets = SecretSet({}, extra=extra)
    raw = data.encode()
    s = secrets.scrubber()
    out, seen = b"", b""
    for chunk in split(raw, cuts):
        out += s.feed(chunk)
        seen += chunk
        assert s.held == reference_hold(seen, table)
    out += s.flush()
    assert (out, s.replacements) == reference_scrub(raw, table)


@SETTINGS
@given(
    st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=3),
    st.lists(st.sampled_from(range(12)), max_size=12),
    st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_stream_equals_whole_with_real_forms(
    values: list[bytes], picks: list[int], cuts: list[int]
) -> None:
    """Every form of a few values, cut at random points: the output never changes."""
    secrets = {f"k{i}": v for i, v in enumerate(values)}
    table = needle_table(secrets)
    forms = sorted(table, key=lambda f: (len(f), f))
    pieces = [*forms, *(f[: len(f) // 2] for f in forms), *(f[1:] for f in forms), b"=", b" "]
    data = b"".join(pieces[p % len(pieces)] for p in picks)
    compiled = SecretSet(secrets)
    want = compiled.scrub(data)
    assert want == reference_scrub(data, table)
    got, s = stream(split(data, cuts), compiled)
    assert (got, s.replacements) == want


# Secret values from an alphabet with no character of a marker's frame ("[", "]", ":") and no
# upper case, so a value (or any of its forms) can only appear in the output if it survived.
SECRET_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-_."


@settings(SETTINGS, max_examples=examples(60))
@given(
    st.lists(st.text(alphabet=SECRET_ALPHABET, min_size=8, max_size=24), min_size=5,
             max_size=20, unique=True),
    st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 3)), max_size=40),
    st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
)
def test_no_secret_survives_any_chunking_with_many_secrets(
    values: list[str], picks: list[tuple[int, int]], cuts: list[int]
) -> None:
    """Many secrets, their every form, fragments and filler, cut anywhere: no value and no form
    of one is ever in the output, and nothing but markers is added."""
    secrets = {f"s{i}": v for i, v in enumerate(values)}
    compiled = SecretSet(secrets)
    forms = [sorted(classified_forms(v.encode())) for v in values]
    pieces: list[bytes] = []
    for pick, how in picks:
        i = pick % len(values)
        form = forms[i][pick % len(forms[i])]
        # a whole form, a form cut short, a form with a byte dropped, or filler
        pieces.append([form, form[:-1], form[:3] + form[4:], b" <x> "][how])
    data = b"".join(pieces)
    out, scrubber = stream(split(data, cuts), compiled)
    assert (out, scrubber.replacements) == compiled.scrub(data)
    for v, fs in zip(values, forms, strict=True):
        assert v.encode() not in out
        for f in fs:
            assert f not in out
    # Nothing but markers is added: one per replacement, and the rest is input bytes.
    assert len(MARKER.findall(out)) == scrubber.replacements
    assert len(unmarked(out)) <= len(data)


def test_secret_split_across_many_chunks_is_never_emitted_in_part() -> None:
    s = SecretSet(FAKE).scrubber()
    emitted = b""
    for b in b"pre FAKE-KEY-123 post":
        emitted += s.feed(bytes([b]))
        assert b"FAKE-KEY" not in emitted
    emitted += s.flush()
    assert emitted == b"pre [REDACTED:api] post"


def test_holdback_is_minimal() -> None:
    s = SecretSet(FAKE).scrubber()
    assert s.feed(b"abcdefghijklmnopqrstuvwxyz") == b"abcdefghijklmnopqrstuvwxyz"
    assert s.held == 0
    assert s.feed(b"xx FAKE-KEY") == b"xx "  # only what could still become the key
    assert s.held == len(b"FAKE-KEY")
    assert s.feed(b"-12!") == b"FAKE-KEY-12!"
    assert s.held == 0
    assert s.feed(b"4") == b""  # could begin the hex form, 46414b45...
    assert s.held == 1
    assert s.feed(b"5") == b"45"
    assert s.flush() == b""


def test_a_match_whose_longest_alternative_is_undecided_is_held() -> None:
    s = SecretSet(PREFIXES).scrubber()
    # "FAKEKEY" is complete, but "FAKEKEY-EX" may still become FAKEKEY-EXT or -EXTENDED
    assert s.feed(b"a FAKEKEY-EX") == b"a "
    assert s.held == len(b"FAKEKEY-EX")
    assert s.feed(b"TEN") == b""
    assert s.feed(b"X") == b"[REDACTED:mid]ENX"
    assert s.feed(b" FAKEKEY-EXTENDED") == b" [REDACTED:long]"
    assert s.held == 0


def test_sse_events_leave_at_once() -> None:
    key = "FAKE-test-key-" + "q7Zr2mKx9PwLd4Vb8NcHs1Tj5Gf"
    s = SecretSet({"api": key, "other": "FAKE-other-value-0123456789"}).scrubber()
    for event in (b'data: {"delta": "hello"}\n\n', b"event: ping\ndata: {}\n\n",
                  b'data: {"k": "' + key.encode() + b'"}\n\n'):
        out = s.feed(event)
        assert s.held == 0
        assert out == event.replace(key.encode(), b"[REDACTED:api]")


keys40 = st.text(alphabet=string.ascii_letters + string.digits, min_size=40, max_size=40)


@SETTINGS
@given(st.lists(keys40, min_size=1, max_size=3), st.text(max_size=60), st.booleans(),
       st.booleans())
def test_no_holdback_after_a_blank_line(keys: list[str], body: str, embed: bool,
                                        blank: bool) -> None:
    secrets = {f"k{i}": k for i, k in enumerate(keys)}
    table = needle_table(secrets)
    data = (body + (keys[0] if embed else "")).encode() + (b"\n\n" if blank else b"")
    s = SecretSet(secrets).scrubber()
    out = s.feed(data)
    assert s.held == reference_hold(data, table)
    if blank:
        assert s.held == 0
    assert out + s.flush() == reference_scrub(data, table)[0]


def test_no_secrets_passes_through() -> None:
    for secrets in (SecretSet({}), SecretSet({"e": b""})):
        assert secrets.empty and secrets.max_len == 0
        s = secrets.scrubber()
        assert s.feed(b"abc") == b"abc"
        assert s.held == 0
        assert s.flush() == b""
        d = secrets.detector()
        assert d.feed(b"abc") == [] and d.held == 0
        assert secrets.find(b"abc") == []


def test_short_secrets() -> None:
    got, s = stream([b"a", b"x", b"b", b"yz", b"y", b"z"], SecretSet(TINY))
    assert got == b"a[REDACTED:one]b[REDACTED:two][REDACTED:two]"
    assert s.replacements == 3


def test_flush_then_reuse() -> None:
    s = SecretSet(FAKE).scrubber()
    assert s.feed(b"FAKE-KEY") == b""
    assert s.flush() == b"FAKE-KEY"
    assert s.feed(b"-123FAKE-KEY-123") == b"-123[REDACTED:api]"


def test_memory_bounded_for_large_clean_streams() -> None:
    secrets = SecretSet({**FAKE, **PREFIXES})
    s = secrets.scrubber()
    chunk = (b"The quick brown fox jumps over the lazy dog. FAKE " * 1400)[:64 * 1024]
    total = 0
    for _ in range(160):  # 10 MiB
        total += len(s.feed(chunk))
        assert s.held < secrets.max_len
    total += len(s.flush())
    assert total == 160 * len(chunk)


def test_one_mib_chunks_with_secrets() -> None:
    rng = random.Random(7)
    filler = bytes(rng.randrange(32, 127) for _ in range(4096)).replace(b"F", b"f")
    body = (filler + b"FAKE-KEY-123") * 256 + filler  # ~1 MiB
    secrets = SecretSet(FAKE)
    want, want_n = secrets.scrub(body)
    assert want_n == 256
    got, s = stream([body[: len(body) // 2], body[len(body) // 2:]], secrets)
    assert got == want and s.replacements == 256


def test_fifty_secrets_build_one_automaton() -> None:
    # (speed is bench/'s business: no timed assertion here)
    rng = random.Random(3)
    alphabet = string.ascii_letters + string.digits
    secrets = {f"s{i}": "FAKE-" + "".join(rng.choice(alphabet) for _ in range(48))
               for i in range(50)}
    compiled = SecretSet(secrets)
    assert compiled.scrub(secrets["s7"].encode()) == (b"[REDACTED:s7]", 1)


# ----------------------------------------------------------------------------- detection


def test_find_reports_each_secret_and_form_once() -> None:
    s = SecretSet({"a": "FAKE-aaaa-1111", "b": "FAKE-bbbb-2222"})
    data = b"FAKE-bbbb-2222 x FAKE-aaaa-1111 " + base64.b64encode(b"FAKE-bbbb-2222") * 2
    assert s.find(data) == [Hit("b", "raw"), Hit("a", "raw"), Hit("b", "base64")]
    assert s.find(b"nothing here") == []


def test_find_ignores_ascii_case() -> None:
    value = "FAKE-Mixed-Case-Key-42"
    s = SecretSet({"k": value})
    for variant in (value.upper(), value.lower(), value.swapcase()):
        assert s.find(variant.encode()) == [Hit("k", "raw")]
    assert s.find(value.encode().hex().upper().encode()) == [Hit("k", "hex")]
    # scrubbing stays exact: only forms a standard encoder produces are replaced
    assert s.scrub(value.lower().encode())[1] == 0


def test_find_folds_ascii_only() -> None:
    s = SecretSet({"k": "FAKE-\u00c0-key"})
    assert s.find("fake-\u00c0-KEY".encode()) == [Hit("k", "raw")]
    assert s.find("fake-\u00e0-key".encode()) == []  # not an ASCII case change


@SETTINGS
@given(st.one_of(byte_values, text_values.map(str.encode)), st.binary(max_size=30),
       st.binary(max_size=30), st.sampled_from(["upper", "lower", "same"]))
def test_find_case_changed_values(value: bytes, before: bytes, after: bytes, case: str) -> None:
    changed = value.upper() if case == "upper" else value.lower() if case == "lower" else value
    assert "k" in {h.name for h in SecretSet({"k": value}).find(before + changed + after)}


@SETTINGS
@given(
    st.lists(keys40, min_size=1, max_size=3),
    st.lists(st.sampled_from(range(8)), max_size=10),
    st.lists(st.integers(min_value=0, max_value=600), max_size=12),
)
def test_detector_counts_each_occurrence_once_across_chunks(
    keys: list[str], picks: list[int], cuts: list[int]
) -> None:
    secrets = SecretSet({f"k{i}": k for i, k in enumerate(keys)})
    forms = [k.encode() for k in keys] + [base64.b64encode(k.encode()) for k in keys]
    pieces = [*forms, b" filler ", b"\n"]
    data = b"".join(pieces[p % len(pieces)] for p in picks)
    whole = secrets.detector()
    want = whole.feed(data)
    d = secrets.detector()
    got: list[Hit] = []
    for chunk in split(data, cuts):
        new = d.feed(chunk)
        assert not set(new) & set(got)  # new hits only
        got += new
        assert d.held <= secrets.max_len - 1
    assert set(got) == set(want) == set(secrets.find(data))
    assert d.occurrences == whole.occurrences
    assert d.hits == got


def test_detector_finds_a_key_split_byte_by_byte() -> None:
    s = SecretSet({"k": "FAKE-split-key-0123"})
    d = s.detector()
    data = b"xx FAKE-split-key-0123 yy FAKE-split-key-0123" + b"." * 200
    hits = [h for b in data for h in d.feed(bytes([b]))]
    assert hits == [Hit("k", "raw")]
    assert d.occurrences == 2
    assert d.held == s.max_len - 1


def test_detector_window_is_bounded() -> None:
    s = SecretSet({"k": "FAKE-window-key"})
    d = s.detector()
    for _ in range(100):
        d.feed(b"y" * 1000)
        assert d.held == s.max_len - 1
    assert d.feed(b"") == []

