"""GitHub App installation tokens, minted by Sandgate at request time.

The app's private key lives in Vault; Sandgate signs the app's JWT (RS256, PyJWT: issued a
minute in the past against clock skew, valid nine minutes, GitHub's maximum being ten) and asks
GitHub for an installation token restricted to the repositories and permissions the allowing
rule names (`GitHubScope`). A token is minted per (secret, sandbox, restrictions), so one
identity's narrow token is never handed to another and each sandbox's tokens can be revoked
(DELETE /installation/token) when it ends; at shutdown the rest are revoked too. A token is
used until five minutes (`MARGIN`) before its `expires_at` and never after (GitHub's are valid
an hour; one minted with less left is refused: a clock that far off is wrong). Failures are
`SecretError` (503 secret_unavailable) naming GitHub's status, never a token or the key.

GitHub is dialled through the `Dial` the proxy gives: the calling identity's rules must allow
POST to the access-token URL, and the address passes the usual checks (secrets/tokenhttp.py).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jwt

from sandgate.errors import SecretError
from sandgate.policy.model import GitHubAppRef, GitHubScope, SecretRef
from sandgate.secrets.flight import Flights
from sandgate.secrets.keyforms import pem_values
from sandgate.secrets.tokenhttp import Dial, TokenFailure, call

log = logging.getLogger("sandgate.github_app")

MARGIN = 300.0  # seconds before expires_at a token is no longer handed out
JWT_BACKDATE = 60  # GitHub's advice against clock skew
JWT_LIFETIME = 540  # under GitHub's ten-minute maximum

ReadRecord = Callable[[SecretRef], Awaitable[tuple[Any, int | None]]]
Key = tuple[str, str | None, GitHubScope | None]  # (secret, sandbox, restrictions)


@dataclass(frozen=True)
class Minted:
    value: str = field(repr=False)
    expires_at: float  # on the clock given (monotonic)
    version: int | None  # the private key's KV version
    note: str  # for the audit: installation, restrictions, expiry (never a value)
    address: tuple[str, int]  # the checked address it was minted at (revocation goes there)
    ref: GitHubAppRef


def app_jwt(app_id: int, private_key: str, now: float) -> str:
    """The app's JWT (RS256), as GitHub expects it."""
    claims = {"iat": int(now) - JWT_BACKDATE, "exp": int(now) + JWT_LIFETIME, "iss": str(app_id)}
    return jwt.encode(claims, private_key, algorithm="RS256")


def request_body(scope: GitHubScope | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if scope is not None and scope.repositories is not None:
        body["repositories"] = list(scope.repositories)
    if scope is not None and scope.permissions is not None:
        body["permissions"] = dict(scope.permissions)
    return body


def parse_answer(status: int, data: bytes, now_wall: float) -> tuple[str, float]:
    """(token, seconds it is valid) from GitHub's answer, or TokenFailure."""
    if status != 201:
        raise TokenFailure(f"GitHub answered {status} to the installation token request")
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise TokenFailure("GitHub's answer is not a JSON object")
    token, expires = doc.get("token"), doc.get("expires_at")
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n\0 "):
        raise TokenFailure("GitHub's answer has no usable token")
    try:
        when = dt.datetime.fromisoformat(str(expires).replace("Z", "+00:00"))
    except ValueError:
        raise TokenFailure("GitHub's answer has no usable expires_at") from None
    if when.tzinfo is None:
        raise TokenFailure("GitHub's answer has no usable expires_at")
    left = when.timestamp() - now_wall
    if left <= 0:
        raise TokenFailure("GitHub's answer is a token that has already expired")
    return token, left


class GitHubApps:
    """Installation tokens: minted single-flight per key, cached, revoked per sandbox."""

    def __init__(self, read: ReadRecord, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self._read, self._clock, self._wall = read, clock, wall
        self._tokens: dict[Key, Minted] = {}
        self._flights: Flights[Key, Minted] = Flights()
        self.retired: list[tuple[str, str]] = []  # (name, value): still scrubbed
        # name -> (PEM, its values): the app's private key is a credential Sandgate holds too
        self.keys: dict[str, list[tuple[str, list[str | bytes]]]] = {}
        self.generation = 0
        self.ssl_ctx: ssl.SSLContext = ssl.create_default_context()
        self.mints = 0
        self.revoked = 0
        self._revocations: set[asyncio.Task[None]] = set()

    def values(self) -> list[tuple[str, str | bytes]]:
        """(name, value) of every token held or retired, and of every private key read with
        the pieces of it a client could reassemble (`sandgate.secrets.keyforms`)."""
        out: list[tuple[str, str | bytes]] = [(k[0], m.value) for k, m in self._tokens.items()]
        out += self.retired
        out += [(name, v) for name, held in self.keys.items() for _, vs in held for v in vs]
        return out

    def _remember(self, name: str, pem: str) -> None:
        """Hold the key's values for scrubbing; a rotated key's stay (the newest few)."""
        held = self.keys.setdefault(name, [])
        if any(p == pem for p, _ in held):
            return
        held.append((pem, pem_values(pem)))
        del held[:-4]
        self.generation += 1

    async def get(self, ref: SecretRef, sandbox: str | None, scope: GitHubScope | None,
                  dial: Dial) -> Minted:
        key: Key = (ref.name, sandbox, scope)
        m = self._tokens.get(key)
        if m is not None and self._clock() < m.expires_at:
            return m
        return await self._flights.run(key, lambda: self._mint(ref, key, dial),
                                       f"sandgate-gh-{ref.name}")

    async def _mint(self, ref: SecretRef, key: Key, dial: Dial) -> Minted:
        g = ref.github_app
        assert g is not None
        name, scope = ref.name, key[2]
        data, version = await self._read(ref)  # raises SecretError
        pem = data.get(ref.field) if isinstance(data, Mapping) else None
        if not isinstance(pem, str) or "PRIVATE KEY" not in pem:
            raise SecretError(name, f"secret '{name}' unavailable: no private key (PEM) in "
                              f"field '{ref.field}'")
        self._remember(name, pem)
        try:
            signed = app_jwt(g.app_id, pem, self._wall())
        except (ValueError, TypeError, jwt.PyJWTError):
            raise SecretError(name, f"secret '{name}' unavailable: the private key in field "
                              f"'{ref.field}' cannot sign an RS256 JWT") from None
        url = f"{g.api_url}/app/installations/{g.installation_id}/access_tokens"
        headers = {"accept": "application/vnd.github+json", "authorization": f"Bearer {signed}",
                   "content-type": "application/json", "user-agent": "sandgate",
                   "x-github-api-version": "2022-11-28"}
        try:
            address = await dial(url)
            self.mints += 1
            status, answer = await call("POST", url, address, self.ssl_ctx, g.timeout, headers,
                                        json.dumps(request_body(scope)).encode(), "GitHub")
            token, left = parse_answer(status, answer, self._wall())
        except TokenFailure as e:
            log.warning("secret '%s': installation token not minted: %s", name, e)
            raise SecretError(name, f"secret '{name}' unavailable: {e}") from None
        expires = dt.datetime.fromtimestamp(self._wall() + left, dt.UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        what = scope.describe() if scope is not None else "the installation's grants"
        note = (f"github-app installation {g.installation_id} ({what}), expires {expires}")
        if left <= MARGIN:  # never used within the margin: not even once, freshly minted
            log.warning("secret '%s': GitHub minted a token that expires in %.0fs", name, left)
            raise SecretError(name, f"secret '{name}' unavailable: GitHub's installation token "
                              f"expires in {left:.0f}s, within the {MARGIN:.0f}s margin before "
                              "expiry in which Sandgate no longer uses a token (is this host's "
                              "clock right?)")
        m = Minted(token, self._clock() + left - MARGIN, version, note, address, g)
        old = self._tokens.get(key)
        if old is not None:
            self._retire(key[0], old)
        self._tokens[key] = m
        self.generation += 1
        log.info("secret '%s': minted %s", name, note)
        return m

    def _retire(self, name: str, m: Minted) -> None:
        self.retired.append((name, m.value))
        del self.retired[:-256]  # bounded; the newest retired tokens stay scrubbed
        self.generation += 1

    def end_sandbox(self, sandbox: str) -> None:
        """Revoke the sandbox's tokens (in the background: a sandbox end does not wait on
        GitHub); they stay scrubbed."""
        for key in [k for k in self._tokens if k[1] == sandbox]:
            m = self._tokens.pop(key)
            self._retire(key[0], m)
            t = asyncio.get_running_loop().create_task(self._revoke(key[0], m))
            self._revocations.add(t)
            t.add_done_callback(self._revocations.discard)

    async def aclose(self) -> None:
        """Revoke every token still held (at shutdown), within each one's timeout."""
        held, self._tokens = list(self._tokens.items()), {}
        await asyncio.gather(*(self._revoke(k[0], m) for k, m in held), *self._revocations,
                             return_exceptions=True)

    async def _revoke(self, name: str, m: Minted) -> None:
        url = f"{m.ref.api_url}/installation/token"
        headers = {"accept": "application/vnd.github+json", "authorization": f"token {m.value}",
                   "user-agent": "sandgate", "x-github-api-version": "2022-11-28"}
        try:
            status, _ = await call("DELETE", url, m.address, self.ssl_ctx, m.ref.timeout,
                                   headers, None, "GitHub")
        except TokenFailure as e:
            log.warning("secret '%s': installation token not revoked: %s (it expires on its "
                        "own)", name, e)
            return
        if status == 204:
            self.revoked += 1
            log.info("secret '%s': installation token revoked", name)
        else:
            log.warning("secret '%s': revoking an installation token: GitHub answered %s",
                        name, status)
