"""Body placeholders: a secret's placeholder inside a JSON or form body, swapped for its value.

Some APIs take the key in the body (`{"api_key": "..."}`, `api_key=...`), so a rule may say
`substitute_body: true`: the placeholders of its `substitute` secrets are then swapped inside the
request body too. The body is PARSED, never string-replaced across its structure:

- JSON (`application/json`, `*/*+json`): a placeholder is swapped inside a string VALUE
  (the whole value or a part of it, e.g. "Bearer <placeholder>"); the document must parse, with
  no key given twice (parsers differ on which one wins). Only that string's bytes change; the
  rest of the document is forwarded byte for byte.
- Form (`application/x-www-form-urlencoded`): inside a field VALUE, decoded (%XX and '+')
  before the search and encoded again after.

A placeholder anywhere else (an object key, a field name, a body of another type, a body that
does not parse, a compressed body, a body over `MAX_BODY` bytes) is UNRESOLVED: the request is
refused (exfiltration, 403) and nothing is forwarded; an upstream must never receive a
placeholder where the rule promised a credential, nor a credential where nobody judged it.

Pure functions: `plan` (before any Vault read, from the judging stage) finds the places and
refuses an unresolved placeholder; `render` (the inject stage) writes the values in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote_plus, unquote_to_bytes

from sandgate.errors import Code, Refused

# Bodies up to this size are parsed for placeholders (1 MiB: request bodies that carry a key are
# small API calls; the bound keeps the parse and the copy cheap whatever a sandbox sends).
MAX_BODY = 1 << 20

Kind = Literal["json", "form"]

# A JSON string token. Applied only to a document that json.loads accepted, where a '"' outside
# a string cannot occur, so the matches are exactly the document's strings (keys and values).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_WS = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class Slot:
    """One string value holding placeholders: bytes [start, end) of the body, decoded text."""

    start: int
    end: int
    text: str


@dataclass(frozen=True, slots=True)
class BodyPlan:
    kind: Kind
    slots: tuple[Slot, ...]
    secrets: frozenset[str]  # the secrets whose placeholders the slots hold

    def describe(self) -> str:
        """For the audit: how many values of which body type, never a value."""
        return f"body {self.kind}: {len(self.slots)} value(s)"


class Unresolved(Refused):
    codes = frozenset({Code.EXFILTRATION, Code.TOO_LARGE})

    def __init__(self, code: Code, names: frozenset[str], why: str, hint: str) -> None:
        super().__init__(code, f"placeholder of secret(s) {', '.join(sorted(names))} {why}; "
                         "an unresolved placeholder is not forwarded", hint=hint)
        self.names = names


def body_kind(content_type: str | None) -> Kind | None:
    """JSON, form, or None (not a type whose values can be substituted)."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return "json"
    if mime == "application/x-www-form-urlencoded":
        return "form"
    return None


def plan(body: bytes, content_type: str | None, encoded: bool,
         placeholders: Mapping[str, str]) -> BodyPlan | None:
    """Where the body's placeholders are; None when it holds none. Raises `Unresolved` for a
    placeholder that cannot be swapped. `placeholders`: placeholder text -> secret name, of the
    secrets the rule substitutes in the body; `encoded`: the body has a content-encoding."""
    raw_hits = _names_in(body, placeholders)
    kind = body_kind(content_type)
    if len(body) > MAX_BODY:
        if raw_hits:
            raise Unresolved(Code.TOO_LARGE, raw_hits, f"is in a body over {MAX_BODY} bytes",
                             "send the key in a smaller request, or in a header")
        return None
    if kind is None:
        names = raw_hits | _names_in(_unquote(body), placeholders)
        if names:
            raise Unresolved(Code.EXFILTRATION, names,
                             "is in a body that is neither JSON nor a form",
                             "send Content-Type: application/json or "
                             "application/x-www-form-urlencoded")
        return None
    slots = _json_slots(body, placeholders) if kind == "json" else _form_slots(body, placeholders)
    # Whatever is left once the slots are emptied must hold no placeholder in any form the
    # upstream could read one from (an object key, a field name, an escape).
    left = _decoded_view(render_with(body, kind, slots, {p: "" for p in placeholders}), kind)
    rest = _names_in(left, placeholders)
    if rest:
        raise Unresolved(Code.EXFILTRATION, rest, f"is in the {kind} body outside a string "
                         "value (an object key or a field name)",
                         "put the placeholder in a value: {\"api_key\": \"<placeholder>\"}")
    if not slots:
        return None
    if encoded:
        raise Unresolved(Code.EXFILTRATION, _slot_names(slots, placeholders),
                         "is in a compressed body", "send the body without content-encoding")
    return BodyPlan(kind, tuple(slots), _slot_names(slots, placeholders))


def render(body: bytes, p: BodyPlan, values: Mapping[str, str],
           placeholders: Mapping[str, str]) -> bytes:
    """The body with every slot's placeholders swapped for the values (`values`: secret name
    -> value; `placeholders`: placeholder text -> secret name)."""
    return render_with(body, p.kind, p.slots,
                       {ph: values[name] for ph, name in placeholders.items() if name in values})


def render_with(body: bytes, kind: Kind, slots: tuple[Slot, ...] | list[Slot],
                swaps: Mapping[str, str]) -> bytes:
    out: list[bytes] = []
    pos = 0
    for s in slots:
        text = s.text
        # longest first: one placeholder may contain another ("...-openai-admin", "...-openai")
        for ph in sorted(swaps, key=len, reverse=True):
            text = text.replace(ph, swaps[ph])
        out += [body[pos:s.start], _encode(text, kind)]
        pos = s.end
    out.append(body[pos:])
    return b"".join(out)


def _encode(text: str, kind: Kind) -> bytes:
    if kind == "json":
        return json.dumps(text, ensure_ascii=True).encode("ascii")
    return quote_plus(text, safe="").encode("ascii")


def _names_in(blob: bytes, placeholders: Mapping[str, str]) -> frozenset[str]:
    return frozenset(n for ph, n in placeholders.items() if ph.encode() in blob)


def _slot_names(slots: list[Slot] | tuple[Slot, ...],
                placeholders: Mapping[str, str]) -> frozenset[str]:
    return frozenset(n for ph, n in placeholders.items() if any(ph in s.text for s in slots))


def _unquote(blob: bytes) -> bytes:
    return unquote_to_bytes(blob.replace(b"+", b" "))


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("an object key is given twice")
    return dict(pairs)


def _json_slots(body: bytes, placeholders: Mapping[str, str]) -> list[Slot]:
    try:
        json.loads(body, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:
        names = _names_in(body, placeholders)
        if names:
            raise Unresolved(Code.EXFILTRATION, names, f"is in a JSON body that does not parse "
                             f"({type(e).__name__})", "send one valid JSON document, every key "
                             "once") from None
        return []
    slots: list[Slot] = []
    for m in _JSON_STRING.finditer(body):
        after = body[m.end():].lstrip(_JSON_WS)[:1]
        if after == b":":
            continue  # an object key: never substituted (the residual check refuses it)
        text = json.loads(m.group())
        if any(ph in text for ph in placeholders):
            slots.append(Slot(m.start(), m.end(), text))
    return slots


def _form_slots(body: bytes, placeholders: Mapping[str, str]) -> list[Slot]:
    slots: list[Slot] = []
    pos = 0
    for field in body.split(b"&"):
        start, pos = pos, pos + len(field) + 1
        name, eq, value = field.partition(b"=")
        if not eq:
            continue
        try:
            text = _unquote(value).decode("utf-8")
        except UnicodeDecodeError:
            continue  # left as it is; the residual check refuses a placeholder in it
        if any(ph in text for ph in placeholders):
            vstart = start + len(name) + 1
            slots.append(Slot(vstart, vstart + len(value), text))
    return slots


def _decoded_view(body: bytes, kind: Kind) -> bytes:
    """Every form in which the upstream may read text out of the body, joined: the raw bytes,
    and the decoded strings (JSON) or decoded names and values (form)."""
    if kind == "form":
        return body + b"\n" + _unquote(body)
    decoded = [body]
    for m in _JSON_STRING.finditer(body):
        try:
            decoded.append(json.loads(m.group()).encode("utf-8", "surrogatepass"))
        except ValueError:
            pass
    return b"\n".join(decoded)
