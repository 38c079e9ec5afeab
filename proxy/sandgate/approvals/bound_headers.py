"""The request headers an approval binds, and what approvers see of them.

An approval covers the request as it will be forwarded, headers included: a header such as
`X-HTTP-Method-Override: DELETE`, another `Content-Type` or `x-target-env: production` changes
what the upstream does as much as the method or the body. The headers bound are the ones the
sandbox sent that reach the upstream, as the ask stage (s38) sees them, which is the same at ask
time and at retry time:

- not the hop-by-hop ones (Connection and the names it nominates, Keep-Alive, TE, Trailer,
  Transfer-Encoding, Upgrade, HTTP2-Settings), `Proxy-*` (Sandgate's own credentials among
  them) or the reserved `X-Sandgate-*` (sandgate.stages.forward.forwarded_fields, which the
  forward stage applies too); a WebSocket upgrade is bound as a flag instead;
- not Host and Content-Length: the judged origin (in the URL) and the body's length (in the
  body digest) bind them;
- not the headers Sandgate sets itself, replacing the sandbox's: the rule's injected
  credentials (`inject: {headers}`, `basic`, SigV4 `sign`), `Accept-Encoding` (s70 asks for
  plain bytes), and the trace context unless the rule forwards it (s40).

The digest is over names in lower case, sorted by name (so distinct names may come in any
order) with the values of a repeated name in the order sent (that order is what the upstream
sees). Approvers see the same fields, values through the scrubber and placeholders named
(`shown`), and the names of the headers Sandgate injects, never their values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

from sandgate.audit.export import traceparent
from sandgate.policy.model import Rule
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.sigv4 import SIGNING_HEADERS
from sandgate.stages.forward import forwarded_fields

# Bound elsewhere: the judged origin is the URL's, the length is the body digest's.
FRAMING = frozenset({"host", "content-length"})
# Set by Sandgate on every forwarded request (s70_scrub.ask_plain): the sandbox's is replaced.
ALWAYS_SET = frozenset({"accept-encoding"})
PLACEHOLDER_TEMPLATE = "[PLACEHOLDER:{name}]"
MAX_SHOWN = 512  # characters of a value an approver sees (the digest binds all of it)
_VERSION = b"sandgate-approval-headers-v1\0"

Field = tuple[str, bytes]


def injected(rule: Rule) -> tuple[str, ...]:
    """The headers the rule's credentials go into (lower case, sorted): shown as names."""
    inj = rule.inject
    if inj is None:
        return ()
    names = {name for name, _ in inj.headers}
    if inj.basic is not None:
        names.add("authorization")
    if inj.sign is not None:
        names.update(SIGNING_HEADERS)
    return tuple(sorted(names))


def replaced(rule: Rule | None) -> frozenset[str]:
    """The names whose values the sandbox sends but the upstream never gets from it."""
    out = set(ALWAYS_SET)
    if rule is not None:
        out.update(injected(rule))
        if not rule.forward_trace_context:
            out.update(traceparent.HEADERS)
    return frozenset(out)


def bound_fields(fields: Iterable[tuple[bytes, bytes]],
                 dropped: frozenset[str] = frozenset()) -> tuple[Field, ...]:
    """The fields an approval binds, canonical: names in lower case, sorted by name, the values
    of one name in the order sent. `dropped`: lower-case names Sandgate replaces (`replaced`)."""
    out: list[Field] = []
    for name, value in forwarded_fields(fields):
        low = name.lower().decode("latin-1")  # ASCII case only, as HTTP compares names
        if low in FRAMING or low in dropped:
            continue
        out.append((low, bytes(value)))
    return tuple(sorted(out, key=lambda f: f[0]))  # stable: repeated names keep their order


def digest(fields: Iterable[Field], websocket: bool) -> str:
    """sha256 of the bound fields (`bound_fields`) and whether the request switches to a
    WebSocket; each name and value length-prefixed, so no two field lists hash alike."""
    h = hashlib.sha256(_VERSION)
    h.update(b"ws\0" if websocket else b"http\0")
    for name, value in fields:
        raw = name.encode("latin-1")
        h.update(len(raw).to_bytes(4, "big") + raw + len(value).to_bytes(4, "big") + value)
    return h.hexdigest()


def shown(fields: Iterable[Field], scrub: Callable[[str], str]
          ) -> tuple[tuple[str, str], ...]:
    """The bound fields as approvers see them: `scrub` applied to names and values (secret
    values, placeholders), values cut at MAX_SHOWN characters (the cut is said)."""
    out: list[tuple[str, str]] = []
    for name, raw in fields:
        value = scrub(raw.decode("utf-8", "replace"))
        if len(value) > MAX_SHOWN:
            value = value[:MAX_SHOWN] + f"... [{len(value) - MAX_SHOWN} more characters]"
        out.append((scrub(name), value))
    return tuple(out)


def scrubber(secrets: SecretSet, placeholders: Mapping[str, str]) -> Callable[[str], str]:
    """Text as approvers may see it: every secret value in any form `[REDACTED:NAME]` (the one
    scrubber), every placeholder (text -> secret name) `[PLACEHOLDER:NAME]`."""
    longest_first = sorted(placeholders.items(), key=lambda pn: len(pn[0]), reverse=True)

    def scrub(text: str) -> str:
        text = secrets.scrub_text(text)[0]
        for placeholder, name in longest_first:  # one placeholder may hold another
            if placeholder:
                text = text.replace(placeholder, PLACEHOLDER_TEMPLATE.format(name=name))
        return text

    return scrub
