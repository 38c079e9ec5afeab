"""Response framing while scrubbing: exact lengths when small, HTTP/1.1 chunked otherwise."""

from __future__ import annotations

import gzip

from mitmproxy.test import tutils

from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.stream import (
    WHOLE_BODY_LIMIT,
    ResponseScrubber,
    clean_head,
    scrub_whole,
    scrub_whole_candidate,
)

SECRETS = SecretSet({"k": "FAKE-value-0123456789"})


def test_small_known_length_is_scrubbed_whole_with_its_exact_length():
    resp = tutils.tresp(content=b"x FAKE-value-0123456789 y")
    assert scrub_whole_candidate(resp, SECRETS)
    assert scrub_whole(resp, SECRETS) == 1
    assert resp.raw_content == b"x [REDACTED:k] y"
    assert resp.headers["content-length"] == str(len(resp.raw_content))


def test_gzip_body_is_decoded_scrubbed_and_sent_plain():
    resp = tutils.tresp(content=b"")
    resp.headers["content-encoding"] = "gzip"
    resp.raw_content = gzip.compress(b"FAKE-value-0123456789")
    resp.headers["content-length"] = str(len(resp.raw_content))
    assert scrub_whole_candidate(resp, SECRETS)
    assert scrub_whole(resp, SECRETS) == 1
    assert resp.raw_content == b"[REDACTED:k]" and "content-encoding" not in resp.headers


def test_large_or_unknown_length_or_no_secrets_streams():
    big = tutils.tresp(content=b"")
    big.headers["content-length"] = str(WHOLE_BODY_LIMIT + 1)
    chunked = tutils.tresp(content=b"")
    del chunked.headers["content-length"]
    chunked.headers["transfer-encoding"] = "chunked"
    assert not scrub_whole_candidate(big, SECRETS)
    assert not scrub_whole_candidate(chunked, SECRETS)
    assert not scrub_whole_candidate(tutils.tresp(), SecretSet({}))


def test_http10_upstream_is_answered_chunked_to_an_http11_client():
    resp = tutils.tresp(http_version=b"HTTP/1.0", content=b"")
    del resp.headers["content-length"]
    ResponseScrubber(SECRETS, "identity", resp, "HTTP/1.1")
    assert resp.http_version == "HTTP/1.1"
    assert resp.headers["transfer-encoding"] == "chunked"


def test_clean_head_sets_the_standard_reason_and_drops_control_bytes():
    resp = tutils.tresp(reason=b"OK FAKE-value-0123456789",
                        headers=[(b"x-a", b"FAKE-value-0123456789"), (b"x-b", b"a\rb"),
                                 (b"X-Sandgate-Reason", b"forged")])
    assert clean_head(resp, SECRETS) == 1
    assert resp.reason == "OK"
    assert resp.headers["x-a"] == "[REDACTED:k]"
    assert "x-b" not in resp.headers and "x-sandgate-reason" not in resp.headers
