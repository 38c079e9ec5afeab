"""The exfiltration check reads a request body the way the upstream will decode it: every gzip
member, stacked codings, deflate, br and zstd; what Sandgate cannot decode is refused.

All "secrets" here are obvious fakes.
"""

from __future__ import annotations

import gzip
import itertools
import zlib

import brotli
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.test import tutils

from sandgate.errors import BadRequest, Code
from sandgate.inject import find_leaks
from sandgate.scrub.scrubber import SecretSet
from sandgate.stages.forward import inspectable_body

FAKE = "FAKE-exfil-probe-value-0123456789"
SECRETS = SecretSet({"probe": FAKE})


def request(body: bytes, coding: str) -> object:
    return tutils.treq(headers=[(b"host", b"api.example"), (b"content-encoding",
                                                            coding.encode())], content=body)


def leaked(body: bytes, coding: str, limit: int = 1 << 20) -> list[str]:
    req = request(body, coding)
    decoded = inspectable_body(req, limit)  # type: ignore[arg-type]
    return sorted({lk.secret for lk in find_leaks(req, decoded, {}, SECRETS,  # type: ignore[arg-type]
                                                   frozenset())})


def test_a_key_in_the_second_gzip_member_is_seen():
    body = gzip.compress(b'{"note": "harmless"}') + gzip.compress(FAKE.encode())
    assert gzip.decompress(body).endswith(FAKE.encode())  # what an upstream reads
    assert leaked(body, "gzip") == ["probe"]


def test_stacked_codings_are_undone_in_reverse_order():
    plain = b"data=" + FAKE.encode()
    body = brotli.compress(gzip.compress(plain))  # gzip applied first, then br
    assert leaked(body, "gzip, br") == ["probe"]
    z = zstandard.ZstdCompressor()
    assert leaked(z.compress(b"x" * 5000) + z.compress(plain), "zstd") == ["probe"]  # 2 frames
    assert leaked(zlib.compress(plain), "deflate") == ["probe"]
    assert leaked(gzip.compress(gzip.compress(plain)), "gzip, identity, gzip") == ["probe"]


# (ids, not the bodies: gzip stamps the time into its header, and xdist's workers must collect
# the same test names)
@pytest.mark.parametrize("coding,body,code", [
    ("compress", b"\x1f\x9d whatever", Code.BAD_REQUEST),  # unknown to Sandgate
    ("gzip, snappy", b"x", Code.BAD_REQUEST),
    ("gzip", gzip.compress(b"fine") + b"trailing junk", Code.BAD_REQUEST),  # corrupt member
    ("br", b"not brotli at all", Code.BAD_REQUEST),
    ("br", brotli.compress(b"x" * 1000 + FAKE.encode())[:-4], Code.BAD_REQUEST),  # cut short
    ("gzip", gzip.compress(FAKE.encode())[:-9], Code.BAD_REQUEST),
    ("zstd", zstandard.ZstdCompressor().compress(b"a" * 99 + FAKE.encode())[:-5],
     Code.BAD_REQUEST),
    ("gzip", gzip.compress(b"\0" * 200_000) + gzip.compress(b"\0" * 200_000), Code.TOO_LARGE),
], ids=["compress", "unknown-stacked", "gzip-trailing-junk", "br-garbage", "br-cut",
        "gzip-cut", "zstd-cut", "gzip-bomb"])
def test_what_cannot_be_decoded_is_refused(coding, body, code):
    with pytest.raises(BadRequest) as e:
        inspectable_body(request(body, coding), 300_000)  # type: ignore[arg-type]
    assert e.value.code is code
    assert "content-encoding" in e.value.reason.lower() or code is not Code.BAD_REQUEST \
        or "corrupt" in e.value.reason


@given(prefix=st.binary(max_size=200), suffix=st.binary(max_size=200),
       cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=5),
       level=st.integers(min_value=0, max_value=9))
def test_gzip_bodies_of_any_member_split_are_detected(prefix, suffix, cuts, level):
    plain = prefix + FAKE.encode() + suffix
    bounds = sorted({0, len(plain), *(c % (len(plain) + 1) for c in cuts)})
    body = b"".join(gzip.compress(plain[a:b], compresslevel=level)
                    for a, b in itertools.pairwise(bounds))
    assert gzip.decompress(body) == plain
    assert leaked(body, "gzip") == ["probe"]
