"""Host normalisation and host patterns."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.policy import hosts
from sandgate.policy.hosts import compile_host_pattern, normalise_host


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("example.com", "example.com"),
        ("EXAMPLE.Com", "example.com"),
        ("  example.com  ", "example.com"),
        ("example.com.", "example.com"),
        ("api.anthropic.com.", "api.anthropic.com"),
        ("under_score.example", "under_score.example"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("例え.テスト", "xn--r8jz45g.xn--zckzah"),
        ("example\u3002com", "example.com"),  # ideographic full stop is a label separator
        ("127.0.0.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("0x7F.0.0.1", "127.0.0.1"),
        ("127.0.0.1.", "127.0.0.1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("[0:0:0:0:0:0:0:1]", "::1"),
        ("::FFFF:127.0.0.1", "::ffff:127.0.0.1"),
        ("::ffff:7f00:1", "::ffff:127.0.0.1"),
        ("[2001:DB8::1]", "2001:db8::1"),
    ],
)
def test_normalise_host(raw, want):
    assert normalise_host(raw) == want


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        (".", "empty"),
        ("example..com", "empty label"),
        (".example.com", "empty label"),
        ("example.com..", "empty label"),
        ("user@example.com", "userinfo"),
        ("user:pw@example.com", "userinfo"),
        ("example.com:443", "port"),
        ("[::1]:443", "port"),
        ("exa mple.com", "whitespace"),
        ("example.com/path", "path"),
        ("example.com\\x", "path"),
        ("ex!ample.com", "characters"),
        ("ex*ample.com", "characters"),
        ("example.com\x00", "control"),
        ("1.2.3.999", "ends in a number"),
        ("example.0x1f", "ends in a number"),
        ("a" * 64 + ".com", "longer than 63"),
        ("[example.com]", "IPv6"),
    ],
)
def test_normalise_host_rejects(raw, fragment):
    with pytest.raises(ValueError, match=None) as ei:
        normalise_host(raw)
    assert fragment in str(ei.value)


@pytest.mark.parametrize(
    ("pattern", "host", "match"),
    [
        ("*.example.com", "a.example.com", True),
        ("*.example.com", "a.b.example.com", True),
        ("*.example.com", "example.com", False),
        ("*.example.com", "badexample.com", False),
        ("*.example.com", "a.example.com.evil", False),
        ("*.Example.COM.", "x.example.com", True),
        ("example.com", "example.com", True),
        ("example.com", "a.example.com", False),
        ("example.com", "example.co", False),
        ("API.example.com", "api.example.com", True),
        ("127.1", "127.0.0.1", True),
        ("[::1]", "::1", True),
        ("::1", "::1", True),
        ("bücher.example", "xn--bcher-kva.example", True),
    ],
)
def test_host_pattern_matches(pattern, host, match):
    assert compile_host_pattern(pattern).matches(host) is match


def test_host_pattern_compiled_form():
    p = compile_host_pattern("*.GitHub.com")
    assert (p.text, p.wildcard, p.suffix) == ("*.github.com", True, ".github.com")
    e = compile_host_pattern("API.github.com.")
    assert (e.text, e.wildcard, e.suffix) == ("api.github.com", False, "api.github.com")


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        ("*", "every host"),
        ("*.com", "single label"),
        ("*.", "empty"),
        ("a.*.b", "whole leading label"),
        ("*foo.com", "whole leading label"),
        ("foo*.com", "whole leading label"),
        ("**.x.com", "whole leading label"),
        ("*.*.x.com", "only one"),
        ("https://example.com", "scheme"),
        ("example.com:443", "port"),
        ("*.example.com:443", "port"),
        ("example.com/v1", "path"),
        ("exa mple.com", "spaces"),
        ("*.127.0.0.1", "IP address"),
        ("user@example.com", "userinfo"),
        ("", "empty"),
    ],
)
def test_host_pattern_rejects(pattern, fragment):
    with pytest.raises(ValueError) as ei:
        compile_host_pattern(pattern)
    assert fragment in str(ei.value)


# normalise_host remembers answers for host-sized input: the same answer, or the same error,
# as computing it, for any text (including text that fails, text that is too long to keep).
@given(st.one_of(st.text(max_size=40), st.sampled_from(
    ["example.com", "EXAMPLE.com.", "bücher.example", "127.1", "[::1]", "a@b", " x .y",
     "a" * 300, " " * 300 + "example.com"])))
def test_normalise_host_remembered_equals_computed(raw: str) -> None:
    def outcome(fn: Callable[[str], str]) -> tuple[str, str]:
        try:
            return "ok", fn(raw)
        except ValueError as e:
            return "error", str(e)

    first = outcome(normalise_host)
    assert first == outcome(hosts._normalise_host)
    assert outcome(normalise_host) == first  # asked again: remembered, or computed again
