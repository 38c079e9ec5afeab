"""Assertions about secret values that never print them, even when they fail.

pytest's assertion rewriting shows both sides of a failed `assert a == b`; with a secret on
one side that would put the value into the test output. These raise plain AssertionErrors
(this module is not rewritten) that name only a short fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping


def fingerprint(value: str | None) -> str:
    if value is None:
        return "none"
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


def assert_secret_equal(actual: str | None, expected: str, what: str) -> None:
    __tracebackhide__ = True  # pytest would show this frame's arguments: the values
    if actual != expected:
        raise AssertionError(f"{what}: got {fingerprint(actual)}, expected {fingerprint(expected)}")


def assert_secret_in(haystack: str, secret: str, what: str) -> None:
    __tracebackhide__ = True
    if secret not in haystack:
        raise AssertionError(f"{what}: {fingerprint(secret)} not present")


def assert_no_secret(texts: Iterable[str], secrets: Iterable[str], what: str = "output") -> None:
    __tracebackhide__ = True
    texts = list(texts)
    found = [fingerprint(s) for s in secrets if any(s in t for t in texts)]
    if found:
        raise AssertionError(f"secret value(s) {found} appeared in {what}")


def longest_secret_run(haystack: str, secret: str) -> int:
    """The length of the longest contiguous piece of `secret` (from any offset) that occurs in
    `haystack`, ignoring ASCII case."""
    hay, sec = haystack.lower(), secret.lower()
    best = 0
    for start in range(len(sec)):
        n = best + 1
        while start + n <= len(sec) and sec[start:start + n] in hay:
            best = n
            n += 1
    return best


def assert_secret_runs_at_most(texts: Mapping[str, str], secret: str, bound: int) -> None:
    """No run of `secret` longer than `bound` characters in any of `texts` (where -> text):
    each offender is reported by where, run length and fingerprint, never by its characters."""
    __tracebackhide__ = True  # pytest would show this frame's arguments: the texts
    runs = {where: longest_secret_run(text, secret) for where, text in texts.items()}
    over = [f"{where}: {n}" for where, n in runs.items() if n > bound]
    if over:
        raise AssertionError(f"runs of {fingerprint(secret)} longer than {bound} characters "
                             f"(where: length): {'; '.join(over)}")
