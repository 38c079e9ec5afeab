"""Assertions about secret values that never print them, even when they fail.

pytest's assertion rewriting shows both sides of a failed `assert a == b`; with a secret on
one side that would put the value into the test output. These raise plain AssertionErrors
(this module is not rewritten) that name only a short fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def fingerprint(value: str | None) -> str:
    if value is None:
        return "none"
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


def assert_secret_equal(actual: str | None, expected: str, what: str) -> None:
    if actual != expected:
        raise AssertionError(f"{what}: got {fingerprint(actual)}, expected {fingerprint(expected)}")


def assert_secret_in(haystack: str, secret: str, what: str) -> None:
    if secret not in haystack:
        raise AssertionError(f"{what}: {fingerprint(secret)} not present")


def assert_no_secret(texts: Iterable[str], secrets: Iterable[str], what: str = "output") -> None:
    texts = list(texts)
    found = [fingerprint(s) for s in secrets if any(s in t for t in texts)]
    if found:
        raise AssertionError(f"secret value(s) {found} appeared in {what}")
