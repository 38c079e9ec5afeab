"""parse_url and the `tests:` fixture runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.policy.fixtures import run_policy_tests
from sandgate.policy.loader import load_policy_dir
from sandgate.request import RequestInfo, parse_url

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("method", "url", "want"),
    [
        ("GET", "https://pypi.org/simple/", RequestInfo("https", "pypi.org", 443, "GET",
                                                       "/simple/")),
        ("get", "https://PyPI.org.", RequestInfo("https", "pypi.org", 443, "GET", "/")),
        ("POST", "http://example.com/a?b=c#d", RequestInfo("http", "example.com", 80, "POST",
                                                           "/a")),
        ("GET", "https://example.com:8443/x%2F..", RequestInfo("https", "example.com", 8443,
                                                              "GET", "/x%2F..")),
        ("GET", "http://[::1]:8080/", RequestInfo("http", "::1", 8080, "GET", "/")),
        ("GET", "http://0x7f000001/", RequestInfo("http", "127.0.0.1", 80, "GET", "/")),
        ("GET", "https://bücher.example/", RequestInfo("https", "xn--bcher-kva.example", 443,
                                                       "GET", "/")),
    ],
)
def test_request_from_url(method, url, want):
    assert parse_url(method, url) == want


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("GET", "ftp://example.com/"),
        ("GET", "example.com/"),
        ("GET", "https://"),
        ("GET", "https://user:pw@example.com/"),
        ("GET", "https://user@example.com/"),
        ("GET", "https://example.com:99999/"),
        ("GET", "https://example.com:0/"),
        ("GET", "https://example.com:/"),
        ("GET", "https://exa mple.com/"),
        ("GET", "https://example.com/a\nb"),
        ("G ET", "https://example.com/"),
        ("", "https://example.com/"),
        ("GET", "https://[::1/"),
        ("GET", "https://a..b/"),
    ],
)
def test_request_from_url_rejects(method, url):
    with pytest.raises(ValueError):
        parse_url(method, url)


def _pol(tmp_path: Path, tests: str):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: [example.com], methods: [GET]}\n"
        "      - {name: d, action: deny, hosts: [example.com], paths: [/admin/**]}\n"
        "tests:\n" + tests)
    return load_policy_dir(tmp_path)


def test_fixtures_pass_and_fail(tmp_path):
    pol = _pol(tmp_path,
               "  - {identity: a, request: GET https://example.com/, expect: allow, rule: r}\n"
               "  - {identity: a, request: POST https://example.com/, expect: allow}\n"
               "  - {identity: a, request: GET https://example.com/, expect: allow, rule: d}\n"
               "  - {identity: a, request: GET https://example.com/admin/x, expect: deny,"
               " rule: d}\n"
               "  - {identity: a, request: GET https://example.com/admin/x, expect: deny,"
               " rule: r}\n"
               "  - {identity: a, request: GET https://other.com/, expect: deny}\n")
    results = run_policy_tests(pol)
    assert [r.passed for r in results] == [True, False, False, True, False, True]
    assert "expected allow, got deny" in results[1].message
    assert "no_rule" in results[1].message
    assert "expected rule 'd', got 'r'" in results[2].message
    assert results[3].decision.rule_name == "d"
    assert results[0].test.source.line == 8


def test_shipped_policy_fixtures_all_pass():
    pol = load_policy_dir(ROOT / "policies")
    results = run_policy_tests(pol)
    assert len(results) >= 20
    failed = [r for r in results if not r.passed]
    assert not failed, [(r.test.source, r.message) for r in failed]
    # bash-tool is refused what web-fetch may do
    web = {(t.method, t.url) for t in pol.tests if t.identity == "web-fetch"
           and t.expect == "allow"}
    bash_denied = {(t.method, t.url) for t in pol.tests if t.identity == "bash-tool"
                   and t.expect == "deny"}
    assert web - {("GET", "https://pypi.org/project/requests/")} <= bash_denied
