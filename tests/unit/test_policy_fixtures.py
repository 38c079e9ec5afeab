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
                                                           "/a", (("b", "c"),))),
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


# --- fixtures say what the proxy does: addresses, injected secrets, CONNECT verdicts ---------

ADDR_POLICY = """version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
  pypi: {vault: secret/data/pypi, field: token}
identities:
  a:
    rules:
      - {name: internal-ip, hosts: [10.0.0.5], methods: [GET]}
      - {name: named, hosts: [wiki.corp.example], methods: [GET]}
      - {name: cidr, hosts: [10.1.2.3, git.corp.example], methods: [GET],
         private_cidrs: [10.1.2.0/24]}
      - name: github
        hosts: [api.github.com]
        methods: [GET, POST]
        inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}
      - {name: index, hosts: [pypi.org], methods: [GET]}
      - {name: db, hosts: [db.corp.example], ports: [5432], passthrough: true}
      - {name: upload, hosts: [upload.pypi.org], methods: [POST], substitute: [pypi]}
tests:
"""


def _fixtures(tmp_path: Path, tests: str, resolve: dict[str, str] | None = None):
    (tmp_path / "p.yaml").write_text(ADDR_POLICY + tests)
    return run_policy_tests(load_policy_dir(tmp_path), resolve or {})


def test_ip_literal_outside_private_cidrs_is_internal_address(tmp_path):
    """Found: check said allow, the proxy answers internal_address."""
    results = _fixtures(tmp_path,
                        "  - {identity: a, request: GET https://10.0.0.5/, expect: allow}\n"
                        "  - {identity: a, request: GET https://10.0.0.5/, expect: deny,"
                        " code: internal_address, rule: internal-ip}\n"
                        "  - {identity: a, request: GET https://10.1.2.3/, expect: allow,"
                        " rule: cidr}\n")
    assert [r.passed for r in results] == [False, True, True]
    assert "internal_address" in results[0].message
    assert results[1].address is not None and "10.0.0.5" in results[1].address


def test_resolve_pins_a_name_like_the_proxy(tmp_path):
    tests = ("  - {identity: a, request: GET https://wiki.corp.example/, expect: allow}\n"
             "  - {identity: a, request: GET https://git.corp.example/, expect: allow}\n")
    unpinned = _fixtures(tmp_path, tests)
    assert [r.passed for r in unpinned] == [True, True]
    assert unpinned[0].address == "address not checked: resolved at request time"
    pinned = _fixtures(tmp_path, tests, {"wiki.corp.example": "192.168.1.9",
                                         "git.corp.example": "10.1.2.7"})
    assert [r.passed for r in pinned] == [False, True]
    assert "internal_address" in pinned[0].message


def test_code_needs_a_known_address(tmp_path):
    (r,) = _fixtures(tmp_path, "  - {identity: a, request: GET https://wiki.corp.example/,"
                     " expect: deny, code: internal_address}\n")
    assert not r.passed and "--resolve" in r.message


def test_inject_assertions(tmp_path):
    results = _fixtures(
        tmp_path,
        "  - {identity: a, request: GET https://api.github.com/user, expect: allow, inject: [gh]}\n"
        "  - {identity: a, request: GET https://pypi.org/simple/, expect: allow, inject: none}\n"
        "  - {identity: a, request: GET https://pypi.org/simple/, expect: allow, inject: [gh]}\n"
        "  - {identity: a, request: GET https://api.github.com/user, expect: allow,"
        " inject: none}\n"
        "  - {identity: a, request: POST https://upload.pypi.org/legacy/, expect: allow,"
        " inject: [pypi]}\n"
        "  - {identity: a, request: GET https://example.com/, expect: deny, inject: none,"
        " code: no_rule}\n"
        "  - {identity: a, request: GET https://example.com/, expect: deny,"
        " code: denied_by_rule}\n")
    assert [r.passed for r in results] == [True, True, False, False, True, True, False]
    assert "expected inject [gh], got none" in results[2].message
    assert "expected inject none, got [gh]" in results[3].message
    assert "expected code denied_by_rule, got no_rule" in results[6].message


def test_connect_fixtures(tmp_path):
    results = _fixtures(
        tmp_path,
        "  - {identity: a, request: CONNECT db.corp.example:5432, expect: allow, rule: db,"
        " passthrough: true}\n"
        "  - {identity: a, request: CONNECT api.github.com:443, expect: allow,"
        " passthrough: false}\n"
        "  - {identity: a, request: CONNECT api.github.com:443, expect: allow,"
        " passthrough: true}\n"
        "  - {identity: a, request: CONNECT db.corp.example:443, expect: deny, code: no_rule}\n",
        {"db.corp.example": "10.9.9.9"})
    assert [r.passed for r in results] == [False, True, False, True]
    assert "internal_address" in results[0].message  # the tunnel dials an unnamed private IP
    assert "expected passthrough" in results[2].message
