"""Put credentials into an allowed request, and catch them where they do not belong."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from mitmproxy import http

from proxy.policy.model import Rule

_FORBIDDEN = ("\r", "\n", "\0")


class UnsafeValue(ValueError):
    """A rendered credential would corrupt the request (CR, LF or NUL). Safe to show."""


def _checked(name: str, value: str) -> str:
    if any(c in value for c in _FORBIDDEN):
        raise UnsafeValue(f"the rendered value for '{name}' contains CR, LF or NUL; not injected")
    return value


def apply(
    rule: Rule, req: http.Request, values: Mapping[str, str], placeholders: Mapping[str, str]
) -> None:
    """Inject the rule's credentials and swap its bound placeholders for values.

    `values` maps secret name -> value for every secret in `rule.secrets`; `placeholders` maps
    secret name -> its placeholder text. Injected headers replace whatever the client sent
    under that name (in any case); they never duplicate it.
    """
    _substitute(req, values, placeholders)
    inj = rule.inject
    if inj is None:
        return
    for name, template in inj.headers:
        req.headers[name] = _checked(name, template.render(values))
    if inj.basic is not None:
        user = _checked("basic.username", inj.basic[0].render(values))
        password = _checked("basic.password", inj.basic[1].render(values))
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        req.headers["authorization"] = f"Basic {token}"
    if inj.query:
        query = req.query
        for param, template in inj.query:
            query[param] = _checked(param, template.render(values))
        req.query = query


def _substitute(
    req: http.Request, values: Mapping[str, str], placeholders: Mapping[str, str]
) -> None:
    """Swap placeholders of the bound secrets in header values: SDKs send what they hold."""
    swaps = [(placeholders[n], v) for n, v in values.items() if n in placeholders]
    if not swaps:
        return
    fields = list(req.headers.fields)
    changed = False
    for i, (key, raw) in enumerate(fields):
        text = raw.decode("latin-1")
        new = text
        for placeholder, secret in swaps:
            if placeholder in new:
                new = new.replace(placeholder, _checked(key.decode("latin-1"), secret))
        if new != text:
            fields[i] = (key, new.encode("latin-1"))
            changed = True
    if changed:
        req.headers.fields = tuple(fields)


@dataclass(frozen=True)
class Leak:
    secret: str
    kind: str  # "placeholder" or "value"
    where: str  # "header", "url" or "body"


def find_leaks(
    req: http.Request,
    placeholders: Mapping[str, str],
    values: Mapping[str, str],
    bound: frozenset[str],
) -> list[Leak]:
    """Placeholders of secrets the rule does not bind, and any real secret value, in a request.

    `placeholders` maps placeholder text -> secret name; `values` secret name -> cached value.
    """
    leaks: list[Leak] = []
    parts: list[tuple[str, str | bytes]] = [
        ("header", "\n".join(f"{k}: {v}" for k, v in req.headers.items(multi=True))),
        ("url", req.path),
        ("url", unquote(req.path)),  # percent-encoding must not hide a credential
        ("body", req.raw_content or b""),
    ]
    # A bound placeholder may contain an unbound one ("...-openai-admin" holds "...-openai"):
    # take the bound ones out before looking for the others.
    bound_texts = sorted((p for p, n in placeholders.items() if n in bound), key=len, reverse=True)
    for where, blob in parts:
        for p in bound_texts:
            blob = blob.replace(p, "") if isinstance(blob, str) else blob.replace(p.encode(), b"")
        text = blob if isinstance(blob, str) else None
        for placeholder, name in placeholders.items():
            if name in bound:
                continue
            if _contains(blob, text, placeholder):
                leaks.append(Leak(name, "placeholder", where))
        for name, value in values.items():
            if value and _contains(blob, text, value):
                leaks.append(Leak(name, "value", where))
    return leaks


def _contains(blob: str | bytes, text: str | None, needle: str) -> bool:
    if text is not None:
        return needle in text
    assert isinstance(blob, bytes)
    return needle.encode() in blob
