"""The canonical one-line form of a brokered credential: `gh-app(repo=acme/api, contents=read)`,
`aws(service=s3, region=eu-west-1)`.

One writer (`form`) and one reader (`parse_form`) so that `explain`, the reach report and a
fixture's `inject:` cannot drift apart: explain and the report print `form(...)`, a fixture's
entry is normalised by `parse_form` (whitespace, order of the key=value pairs) and compared with
`form(...)` of what the proxy would inject. Pure: no policy, no values (a name, a scope, never a
secret)."""

from __future__ import annotations

import re
from collections.abc import Iterable

# The kinds with a form, and the keys each puts first (in this order); other keys follow
# sorted by key then value. gh-app: the repositories, then the permissions.
KINDS: dict[str, tuple[str, ...]] = {"gh-app": ("repo",), "aws": ("service", "region")}
_SHAPE = re.compile(r"\s*([a-z][a-z0-9-]*)\s*\((.*)\)\s*", re.DOTALL)
_TOKEN = re.compile(r"[^\s,()=]+")


def is_form(entry: str) -> bool:
    """Is a fixture's `inject:` entry a credential form (not a secret name)? Names have no
    parentheses."""
    return "(" in entry or ")" in entry


def form(kind: str, pairs: Iterable[tuple[str, str]]) -> str:
    """`kind(k=v, ...)` with the pairs in the canonical order."""
    first = KINDS.get(kind, ())

    def rank(p: tuple[str, str]) -> tuple[int, str, str]:
        return (first.index(p[0]) if p[0] in first else len(first), p[0], p[1])

    return f"{kind}({', '.join(f'{k}={v}' for k, v in sorted(set(pairs), key=rank))})"


def aws_form(service: str, region: str) -> str:
    """`aws(service=s3, region=eu-west-1)`: the scope Sandgate signs for."""
    return form("aws", [("service", service), ("region", region)])


def parse_form(text: str) -> str:
    """The canonical form of `text`; ValueError saying what is wrong."""
    m = _SHAPE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is neither a secret name nor a credential form like "
                         "gh-app(repo=acme/api, contents=read)")
    kind, body = m.group(1), m.group(2)
    if kind not in KINDS:
        raise ValueError(f"unknown credential kind {kind!r} in {text!r} (known: "
                         f"{', '.join(sorted(KINDS))})")
    pairs: list[tuple[str, str]] = []
    for item in body.split(",") if body.strip() else []:
        k, eq, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not eq or not _TOKEN.fullmatch(k) or not _TOKEN.fullmatch(v):
            raise ValueError(f"{item.strip()!r} in {text!r} is not key=value")
        pairs.append((k, v))
    keys = [k for k, _ in pairs]
    if kind == "aws":
        for k in keys:
            if k not in KINDS["aws"]:
                raise ValueError(f"aws() takes service= and region=, not {k!r} ({text!r})")
        for k in KINDS["aws"]:
            if keys.count(k) != 1:
                raise ValueError(f"aws() needs exactly one {k}= ({text!r})")
    return form(kind, pairs)
