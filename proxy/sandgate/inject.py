"""Put credentials into an allowed request, and catch them where they do not belong."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from mitmproxy import http

from sandgate.errors import UnsafeValue
from sandgate.policy.model import Policy, Rule
from sandgate.scrub.scrubber import SecretSet
from sandgate.scrub.unwrap import unwrapped_view
from sandgate.secrets.body import BodyPlan
from sandgate.secrets.body import render as render_body
from sandgate.secrets.forms import basic_auth_form, query_forms
from sandgate.text import breaks_header


def _checked(name: str, value: str) -> str:
    if breaks_header(value):
        raise UnsafeValue(f"the rendered value for '{name}' contains CR, LF or NUL; not injected")
    return value


def apply(
    rule: Rule, req: http.Request, values: Mapping[str, str], placeholders: Mapping[str, str],
    body_plan: BodyPlan | None = None,
) -> None:
    """Inject the rule's credentials and swap its bound placeholders for values.

    `values` maps secret name -> value for every secret in `rule.secrets` (and "NAME.username"
    -> the user name of a dynamic secret that has one); `placeholders` maps
    secret name -> its placeholder text. Injected headers replace whatever the client sent
    under that name (in any case); they never duplicate it.
    """
    _substitute(rule, req, values, placeholders)
    if body_plan is not None:
        # the plan was made from this body when it was judged (stages/s30_body.py)
        req.content = render_body(req.raw_content or b"", body_plan, values,
                                  {p: n for n, p in placeholders.items()})
    inj = rule.inject
    if inj is None:
        return
    for name, template in inj.headers:
        req.headers[name] = _checked(name, template.render(values))
    if inj.basic is not None:
        user = _checked("basic.username", inj.basic[0].render(values))
        password = _checked("basic.password", inj.basic[1].render(values))
        req.headers["authorization"] = "Basic " + basic_auth_form(user, password).decode("ascii")
    if inj.query:
        query = req.query
        for param, template in inj.query:
            query[param] = _checked(param, template.render(values))
        req.query = query


def _substitute(rule: Rule, req: http.Request, values: Mapping[str, str],
                placeholders: Mapping[str, str]) -> None:
    """Swap the placeholders of the rule's `substitute` secrets for their values, only in the
    headers the rule names (`substitute_headers`): SDKs send the key they hold there. A
    placeholder anywhere else stays a placeholder, so an upstream endpoint that reflects some
    other header can never hand the value back."""
    swaps = [(placeholders[n].encode(), n, values[n].encode("utf-8"))
             for n in sorted(rule.substitute) if n in values and n in placeholders]
    if not swaps:
        return
    fields = list(req.headers.fields)
    changed = False
    for i, (key, raw) in enumerate(fields):
        if key.lower().decode("latin-1") not in rule.substitute_headers:
            continue
        new = raw
        for placeholder, name, secret in swaps:
            if placeholder in new:
                new = new.replace(placeholder, _checked(name, secret.decode("utf-8")).encode())
        if new != raw:
            fields[i] = (key, new)
            changed = True
    if changed:
        req.headers.fields = tuple(fields)


def own_forms(policy: Policy, values: Mapping[str, str]) -> dict[str, list[bytes]]:
    """The exact encodings Sandgate itself produces from cached values on the way out.

    A Basic pair is sent as base64 of "user:password" and a query value percent-encoded; an
    upstream that echoes either must be scrubbed although neither is a form of the value alone.
    """
    out: dict[str, list[bytes]] = {}
    for ident in policy.identities.values():
        for rule in ident.rules:
            inj = rule.inject
            if inj is None:
                continue
            if inj.basic is not None:
                user, password = inj.basic
                need = user.keys | password.keys
                if need and need <= values.keys():
                    form = basic_auth_form(user.render(values), password.render(values))
                    for name in sorted(user.secrets | password.secrets):
                        out.setdefault(name, []).append(form)
            for _, template in inj.query:
                if template.secrets and template.keys <= values.keys():
                    forms = query_forms(template.render(values))
                    for name in sorted(template.secrets):
                        out.setdefault(name, []).extend(sorted(forms))
    return out


@dataclass(frozen=True)
class Leak:
    secret: str
    kind: str  # "placeholder" or "value"
    where: str  # "header", "url" or "body"


def find_leaks(
    req: http.Request,
    body: bytes,
    placeholders: Mapping[str, str],
    secrets: SecretSet,
    bound: frozenset[str],
) -> list[Leak]:
    """Placeholders of secrets the rule does not bind, and any real secret value (in any of its
    encodings, in any case), in a request's headers, target and (decoded) body.

    `placeholders` maps placeholder text -> secret name; `secrets` holds every cached value
    with its encodings (a sandbox must never hold a real value, bound or not).
    """
    parts: list[tuple[str, bytes]] = [
        ("header", b"\n".join(k + b": " + v for k, v in req.headers.fields)),
        ("url", req.path.encode("utf-8", "surrogateescape")),
        ("url", unquote(req.path).encode("utf-8", "surrogateescape")),  # percent-encoding
        ("body", body),
    ]
    values = not no_values([blob for _, blob in parts], secrets)
    leaks: list[Leak] = []
    for where, blob in parts:
        leaks += find_leaks_in(blob, where, placeholders, secrets, bound, values=values)
    return leaks


PREFILTER_MAX = 64 * 1024  # larger requests are searched part by part (no joined copy)


def no_values(blobs: list[bytes], secrets: SecretSet) -> bool:
    """True when no secret value is in any of `blobs` (as `find_leaks_in` looks for them), from
    two searches of their concatenation instead of up to two per blob; False when unsure.

    Each blob is a part of the concatenation, so a value in a blob is in it too. The blobs are
    joined by a NUL byte, which is neither a line break nor the "=" of a soft break: no run of
    breaks crosses a seam, so the unwrapped view of the concatenation is the blobs' own views
    joined by NUL, and a value in a blob's view is in it too. The converse does not hold (a
    value across a seam): then the blobs are searched one by one, as before."""
    if sum(len(b) for b in blobs) > PREFILTER_MAX:
        return False
    joined = b"\x00".join(blobs)
    return not secrets.find(joined) and not secrets.find(unwrapped_view(joined))


def find_leaks_in(blob: bytes, where: str, placeholders: Mapping[str, str], secrets: SecretSet,
                  bound: frozenset[str], *, values: bool = True) -> list[Leak]:
    """The leaks in one piece of outgoing data (a header block, a body, a WebSocket message).
    `values=False`: the caller knows no secret value is in it (`no_values`)."""
    hits: dict[str, None] = {}
    if values:
        hits.update(dict.fromkeys(hit.name for hit in secrets.find(blob)))
    view = unwrapped_view(blob) if values else blob
    if view is not blob:  # a value cut by line breaks or written with =XX escapes (MIME)
        hits.update(dict.fromkeys(hit.name for hit in secrets.find(view)))
    leaks = [Leak(name, "value", where) for name in hits]
    # A bound placeholder may contain an unbound one ("...-openai-admin" holds "...-openai"):
    # take the bound ones out before looking for the others.
    for p in sorted((p.encode() for p, n in placeholders.items() if n in bound), key=len,
                    reverse=True):
        blob = blob.replace(p, b"")
    for placeholder, name in placeholders.items():
        if name not in bound and placeholder.encode() in blob:
            leaks.append(Leak(name, "placeholder", where))
    return leaks
