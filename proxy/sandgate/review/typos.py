"""Edit distance for the lints that name a likely typo (a host, a tool, a method one or two
edits away from one the policy names)."""

from __future__ import annotations


def edits(a: str, b: str) -> int:
    """Levenshtein distance between `a` and `b`, capped at 3: the lints only ask "two edits or
    fewer?", so strings whose lengths differ by more than two are not compared."""
    if abs(len(a) - len(b)) > 2:
        return 3
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return min(prev[-1], 3)
