"""Public suffixes: is a `*.domain` wildcard a grant over many owners' hosts?

Uses the Public Suffix List shipped with the `publicsuffixlist` package (ICANN and PRIVATE
sections; nothing is fetched). `*.D` is over-broad when D is itself a public suffix (`co.uk`,
`github.io`, `googleapis.com`) or when the list names suffixes below D (`amazonaws.com` has
`s3.amazonaws.com`, `*.compute.amazonaws.com`...): hosts under D then belong to different
registrants, so one rule would reach all of them.
"""

from __future__ import annotations

import functools

from publicsuffixlist import PSLFILE, PublicSuffixList


@functools.cache
def _psl() -> PublicSuffixList:
    return PublicSuffixList(only_icann=False)


@functools.cache
def _parents_of_suffixes() -> frozenset[str]:
    """Every domain that has a public-suffix rule strictly below it (e.g. amazonaws.com)."""
    out: set[str] = set()
    with open(PSLFILE, encoding="utf-8") as f:
        for line in f:
            rule = line.strip().split(" ")[0].lower()
            if not rule or rule.startswith("//"):
                continue
            rule = rule.lstrip("!")
            if rule.startswith("*."):
                rule = rule[2:]
                out.add(rule)  # `*.x.y` makes every label under x.y a suffix: x.y is a parent
            try:
                rule = rule.encode("idna").decode("ascii")
            except UnicodeError:
                continue
            labels = rule.split(".")
            for i in range(1, len(labels)):
                parent = ".".join(labels[i:])
                if parent:
                    out.add(parent)
    return frozenset(out)


def is_public_suffix(domain: str) -> bool:
    """Is `domain` itself a public suffix (`com`, `home.arpa`, an unknown TLD such as
    `internal`)? Such a name is nobody's host."""
    d = domain.strip(".").lower()
    return bool(d) and bool(_psl().is_public(d))


def overbroad_wildcard(suffix: str) -> str | None:
    """Why `*.<suffix>` spans many owners (a sentence naming the list), or None when it does not.

    `suffix` is the normalised domain after `*.`, e.g. "github.io".
    """
    d = suffix.strip(".").lower()
    if not d:
        return None
    if _psl().is_public(d):
        return (f"'*.{d}' is a wildcard directly under a public suffix: {d} is on the Public "
                "Suffix List, so its subdomains belong to different owners")
    if d in _parents_of_suffixes():
        return (f"'*.{d}' covers public suffixes: the Public Suffix List names suffixes under "
                f"{d}, so hosts matching it belong to different owners")
    return None
