"""OAuth 2.0 access tokens, obtained by Sandgate at request time (client-credentials and
refresh-token grants, RFC 6749 sections 4.4 and 6).

The client record (client_id, client_secret, refresh_token) lives in Vault (KV v2); the sandbox
holds only the secret's placeholder. A token is minted once and shared (single flight), cached
until shortly before `expires_in`, and minted again after that. A rotated refresh token is
written back to Vault with check-and-set on the version read, so replicas and restarts keep it;
a write that loses the race keeps the token it got and logs it (the record another replica
wrote wins). Any failure (Vault, the token endpoint down, slow, refusing, or answering
something that is not a token) is a `SecretError` (503 secret_unavailable) naming the
provider's `error` code, never a token; nothing is forwarded.

The token endpoint is dialled through a `Dial` the proxy gives (stages/s50_inject.py): the
calling identity's rules must allow POST to it and its address passes the same checks as any
upstream; TLS is verified against the proxy's upstream trust roots.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from sandgate.errors import SecretError
from sandgate.policy.model import OAuth2Ref, SecretRef
from sandgate.secrets.flight import Flights
from sandgate.secrets.tokenhttp import Dial, TokenFailure, call

log = logging.getLogger("sandgate.oauth2")

# An access token is used until this long before it expires (or a tenth of its lifetime).
REFRESH_MARGIN = 60.0
# RFC 6749 5.2: `error` is a short ASCII code; anything else is not echoed.
_ERROR_CODE = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]{1,64}")

ReadRecord = Callable[[SecretRef], Awaitable[tuple[Any, int | None]]]
WriteRecord = Callable[[SecretRef, dict[str, Any], int], Awaitable[None]]


@dataclass(frozen=True)
class Token:
    value: str = field(repr=False)
    expires_at: float  # on the broker's clock (monotonic)
    expires_wall: float  # time.time() of expiry, for the audit
    version: int | None  # the client record's KV version it was minted from
    note: str  # how it was obtained, for the audit (never a value)


async def request_token(ref: OAuth2Ref, record: Mapping[str, Any], dial: Dial,
                        ssl_ctx: ssl.SSLContext) -> dict[str, Any]:
    """One token request; the parsed JSON answer of a 200, or TokenFailure."""
    address = await dial(ref.token_url)
    client_id, client_secret = _text(record, "client_id"), _text(record, "client_secret")
    form: dict[str, str] = {"grant_type": ref.grant}
    if ref.grant == "refresh_token":
        form["refresh_token"] = _text(record, "refresh_token")
    if ref.scope:
        form["scope"] = ref.scope
    headers = {"accept": "application/json",
               "content-type": "application/x-www-form-urlencoded"}
    if ref.client_auth == "basic":  # RFC 6749 2.3.1: each part form-encoded first
        pair = f"{quote(client_id, safe='')}:{quote(client_secret, safe='')}"
        headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    else:
        form |= {"client_id": client_id, "client_secret": client_secret}
    status, body = await call("POST", ref.token_url, address, ssl_ctx, ref.timeout, headers,
                              urlencode(form).encode())
    return answer(status, body)


def answer(status: int, body: bytes) -> dict[str, Any]:
    """A token endpoint's answer: the JSON object of a 200, or TokenFailure naming the status
    and the provider's `error` code (only a well-formed code: the rest of an error body may
    quote what was sent)."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if status != 200:
        code = doc.get("error") if isinstance(doc, dict) else None
        said = (f" {code}" if isinstance(code, str) and _ERROR_CODE.fullmatch(code)
                else "")
        raise TokenFailure(f"the token endpoint answered {status}{said}")
    if not isinstance(doc, dict):
        raise TokenFailure("the token endpoint's answer is not a JSON object")
    return doc


def _text(record: Mapping[str, Any], key: str) -> str:
    v = record.get(key)
    if not isinstance(v, str) or not v:
        raise TokenFailure(f"the client record has no {key}")
    return v


class OAuth2Tokens:
    """The access tokens of the oauth2 secrets: cached, minted single-flight, rotated."""

    def __init__(self, read: ReadRecord, write: WriteRecord,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._write, self._clock = read, write, clock
        self._tokens: dict[str, Token] = {}
        self._flights: Flights[str, Token] = Flights()
        self.retired: list[tuple[str, str]] = []  # (name, value): still scrubbed
        self.records: dict[str, list[str]] = {}  # name -> client secret / refresh tokens seen
        self.generation = 0
        self.ssl_ctx: ssl.SSLContext = ssl.create_default_context()
        self.mints = 0  # token requests sent (tests)

    def values(self) -> list[tuple[str, str]]:
        """(name, value) of every token and client credential held, retired ones included."""
        out = [(n, t.value) for n, t in self._tokens.items()]
        out += self.retired
        out += [(n, v) for n, vs in self.records.items() for v in vs]
        return out

    def use_ca_file(self, path: str | None) -> None:
        """The proxy's upstream trust roots (system roots plus --upstream-ca)."""
        self.ssl_ctx = ssl.create_default_context(cafile=path)

    async def get(self, ref: SecretRef, dial: Dial) -> Token:
        tok = self._tokens.get(ref.name)
        if tok is not None and self._clock() < tok.expires_at:
            return tok
        return await self._flights.run(ref.name, lambda: self._mint(ref, dial),
                                       f"sandgate-oauth2-{ref.name}")

    async def _mint(self, ref: SecretRef, dial: Dial) -> Token:
        o = ref.oauth2
        assert o is not None
        name = ref.name
        data, version = await self._read(ref)  # raises SecretError
        if not isinstance(data, Mapping):
            raise SecretError(name, f"secret '{name}' unavailable: no client record")
        self._remember(name, data)
        try:
            self.mints += 1
            doc = await request_token(o, data, dial, self.ssl_ctx)
            value, expires_in = parse_token(doc)
        except TokenFailure as e:
            log.warning("secret '%s': token request to %s failed: %s", name, o.token_url, e)
            raise SecretError(name, f"secret '{name}' unavailable: {e}") from None
        rotated = doc.get("refresh_token")
        note = f"oauth2 {o.grant}, expires in {expires_in}s"
        if (o.grant == "refresh_token" and isinstance(rotated, str) and rotated
                and rotated != data.get("refresh_token")):
            self._remember(name, {"refresh_token": rotated})
            try:
                await self._write(ref, {**data, "refresh_token": rotated}, version or 0)
                note += ", refresh token rotated"
                version = (version or 0) + 1
            except SecretError as e:
                # Another replica rotated first (check-and-set lost) or Vault refused: this
                # token is still good; the record in Vault stays the one another writer left.
                log.warning("secret '%s': rotated refresh token not written back: %s", name, e)
                note += ", rotated refresh token NOT written back"
        margin = min(REFRESH_MARGIN, expires_in / 10)
        now = self._clock()
        tok = Token(value, now + expires_in - margin, time.time() + expires_in, version, note)
        old = self._tokens.get(name)
        if old is not None and old.value != value:
            self.retired.append((name, old.value))
            del self.retired[:-64]  # bounded; the newest retired tokens stay scrubbed
        self._tokens[name] = tok
        self.generation += 1
        log.info("secret '%s': %s", name, note)
        return tok

    def _remember(self, name: str, data: Mapping[str, Any]) -> None:
        held = self.records.setdefault(name, [])
        for key in ("client_secret", "refresh_token"):
            v = data.get(key)
            if isinstance(v, str) and len(v) >= 8 and v not in held:
                held.append(v)
                self.generation += 1
        del held[:-16]


def parse_token(doc: Mapping[str, Any]) -> tuple[str, int]:
    value = doc.get("access_token")
    if not isinstance(value, str) or not value or any(c in value for c in "\r\n\0 "):
        raise TokenFailure("the token endpoint's answer has no usable access_token")
    kind = doc.get("token_type")
    if not isinstance(kind, str) or kind.lower() != "bearer":
        raise TokenFailure("the token endpoint's answer is not a bearer token")
    expires_in = doc.get("expires_in")
    if isinstance(expires_in, str) and expires_in.isdigit():
        expires_in = int(expires_in)  # some providers send a string
    if not isinstance(expires_in, int) or isinstance(expires_in, bool) or expires_in <= 0:
        raise TokenFailure("the token endpoint's answer has no usable expires_in")
    return value, expires_in
