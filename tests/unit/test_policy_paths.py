"""Path normalisation and path globs."""

from __future__ import annotations

import pytest

from sandgate.policy.paths import compile_path_pattern, match_segments, normalise_path


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("/", "/"),
        ("/v1/messages", "/v1/messages"),
        ("/v1/messages/", "/v1/messages/"),
        ("/v1/messages?x=1", "/v1/messages"),
        ("/v1/messages#frag", "/v1/messages"),
        ("/v1/messages?next=/../admin", "/v1/messages"),
        ("//v1//messages", "/v1/messages"),
        ("/v1///messages//", "/v1/messages/"),
        ("/v1/./messages", "/v1/messages"),
        ("/v1/messages/.", "/v1/messages/"),
        ("/v1/x/../messages", "/v1/messages"),
        ("/v1/messages/..", "/v1/"),
        ("/../../etc/passwd", "/etc/passwd"),
        ("/..", "/"),
        ("/v1/%2e%2e/admin", "/admin"),
        ("/v1/%2E%2E/admin", "/admin"),
        ("/v1/.%2e/admin", "/admin"),
        ("/v1/%2e/messages", "/v1/messages"),
        ("/v1/messages%2F..%2F..%2Fadmin", "/admin"),
        ("/v1/messages%2f..%2f..%2fadmin", "/admin"),
        ("/v1\\..\\admin", "/admin"),
        ("/v1/messages%5C..%5C..%5Cadmin", "/admin"),
        ("/a%20b", "/a b"),
        ("/caf%C3%A9", "/café"),
        ("/v1/%252e%252e/admin", "/v1/%2e%2e/admin"),  # decoded once only
        ("/%2F%2Fv1", "/v1"),
    ],
)
def test_normalise_path(raw, want):
    assert normalise_path(raw) == want


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("", "start with '/'"),
        ("v1/messages", "start with '/'"),
        ("*", "start with '/'"),
        ("http://x/y", "start with '/'"),
        ("/a%00b", "control"),
        ("/a%0d%0aHost:x", "control"),
        ("/a\x01", "control"),
        ("/a%ff", "UTF-8"),
        ("/a%c3", "UTF-8"),
        ("/a%zz", "percent-escape"),
        ("/a%2", "percent-escape"),
    ],
)
def test_normalise_path_rejects(raw, fragment):
    with pytest.raises(ValueError) as ei:
        normalise_path(raw)
    assert fragment in str(ei.value)


def _m(pattern: str, path: str) -> bool:
    return compile_path_pattern(pattern).matches(normalise_path(path))


@pytest.mark.parametrize(
    ("pattern", "path", "match"),
    [
        ("/v1/messages", "/v1/messages", True),
        ("/v1/messages", "/v1/messages/", False),
        ("/v1/messages", "/v1/messagesX", False),
        ("/v1/messages", "/V1/messages", False),
        ("/v1/messages/*", "/v1/messages/batches", True),
        ("/v1/messages/*", "/v1/messages/a/b", False),
        ("/v1/messages/*", "/v1/messages", False),
        ("/v1/messages/*", "/v1/messages/", False),
        ("/v1/*/files", "/v1/abc/files", True),
        ("/v1/*/files", "/v1/a/b/files", False),
        ("/v1/msg-*", "/v1/msg-123", True),
        ("/v1/msg-*", "/v1/msg-", True),
        ("/v1/msg-*", "/v1/msg/x", False),
        ("/v1/*.json", "/v1/a.json", True),
        ("/v1/*.json", "/v1/a.jsonx", False),
        ("/v1/**", "/v1", True),
        ("/v1/**", "/v1/", True),
        ("/v1/**", "/v1/a/b", True),
        ("/v1/**", "/v2/a", False),
        ("/v1/**", "/v10", False),
        ("/**", "/", True),
        ("/**", "/anything/at/all", True),
        ("/", "/", True),
        ("/", "/a", False),
        ("/*", "/", False),
        ("/*", "/a", True),
        ("/a/**/z", "/a/z", True),
        ("/a/**/z", "/a/b/c/z", True),
        ("/a/**/z", "/a/b/c/y", False),
        ("/a/**/b/**/c", "/a/x/b/y/b/z/c", True),
        ("/a/**/b/*", "/a/b/c/d", False),
        ("/a/**/b/*", "/a/x/b/c", True),
        ("/admin/**", "/v1/messages%2F..%2F..%2Fadmin", True),
        ("/v1/messages/*", "/v1/messages%2F..%2F..%2Fadmin", False),
        ("/v1/messages/*", "/v1/messages/%2e%2e", False),
        ("/files/a b", "/files/a%20b", True),
    ],
)
def test_glob_semantics(pattern, path, match):
    assert _m(pattern, path) is match


def test_compiled_segments():
    assert compile_path_pattern("/v1/messages/*").segments == ("v1", "messages", "*")
    assert compile_path_pattern("/v1/**").segments == ("v1", "**")
    assert compile_path_pattern("/").segments == ("",)
    assert match_segments(("v1", "**"), "/v1/x")


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("v1/messages", "start with '/'"),
        ("", "start with '/'"),
        ("/v1/a**", "whole segment"),
        ("/v1/**b", "whole segment"),
        ("/v1/***", "whole segment"),
        ("/v1//x", "empty segment"),
        ("/v1/../admin", "'..' segment"),
        ("/v1/./x", "'.' segment"),
        ("/v1?x=1", "query"),
        ("/v1#x", "fragment"),
        ("/v1\\x", "backslash"),
        ("/v1/%2e", "percent"),
    ],
)
def test_path_pattern_rejects(pattern, fragment):
    with pytest.raises(ValueError) as ei:
        compile_path_pattern(pattern)
    assert fragment in str(ei.value)


def test_matching_is_linear_enough():
    # many `**` against a long non-matching path must not blow up
    p = compile_path_pattern("/" + "/".join(["**", "a"] * 10) + "/zz")
    path = "/" + "/".join(["a"] * 200)
    assert not p.matches(path)
