"""Policy fixtures: the `tests:` of policy files, run by `sandgate check`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.decision import Decision, decide
from proxy.policy.hosts import normalise_host
from proxy.policy.model import Policy, PolicyTest
from proxy.refusal import Code
from proxy.request import RequestInfo

_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def request_from_url(method: str, url: str) -> RequestInfo:
    """The RequestInfo for `METHOD URL` as the proxy would see it.

    Default port by scheme, host normalised, path raw (without query or fragment; "/" when
    empty). ValueError on anything that is not an absolute http(s) URL without userinfo.
    """
    m = method.strip().upper()
    if not m or not all(c in _TCHARS for c in m):
        raise ValueError(f"{method!r} is not an HTTP method")
    if not url or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError(f"URL {url!r} is empty or contains spaces or control characters")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"URL {url!r} must start with https:// or http://")
    if not parts.netloc:
        raise ValueError(f"URL {url!r} has no host")
    if "@" in parts.netloc:
        raise ValueError(f"URL {url!r} contains userinfo ('user@'); credentials never go in URLs")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"URL {url!r} has a bad port: {e}") from e
    if port is None:
        if parts.netloc.endswith(":"):
            raise ValueError(f"URL {url!r} has an empty port")
        port = 443 if scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise ValueError(f"URL {url!r} has port {port} out of range")
    hostname = parts.hostname
    if not hostname:
        raise ValueError(f"URL {url!r} has no host")
    host = normalise_host(f"[{hostname}]" if ":" in hostname else hostname)
    path = parts.path or "/"
    if not path.startswith("/"):
        raise ValueError(f"URL {url!r} has a relative path")
    return RequestInfo(scheme=scheme, host=host, port=port, method=m, path=path)


@dataclass(frozen=True, slots=True)
class FixtureResult:
    test: PolicyTest
    decision: Decision
    passed: bool
    message: str


def run_policy_tests(policy: Policy) -> list[FixtureResult]:
    return [run_policy_test(policy, t) for t in policy.tests]


def run_policy_test(policy: Policy, test: PolicyTest) -> FixtureResult:
    try:
        req = request_from_url(test.method, test.url)
    except ValueError as e:
        d = Decision(False, Code.BAD_REQUEST, f"bad request: {e}")
        return FixtureResult(test, d, False, str(e))
    d = decide(policy, test.identity, req)
    got = "allow" if d.allowed else "deny"
    if got != test.expect:
        why = d.reason if d.allowed else f"{d.code}: {d.reason}"
        return FixtureResult(test, d, False, f"expected {test.expect}, got {got} ({why})")
    if test.rule is not None and d.rule_name != test.rule:
        return FixtureResult(test, d, False, f"expected rule {test.rule!r}, got "
                             f"{d.rule_name!r} ({d.reason})")
    return FixtureResult(test, d, True, "ok")
