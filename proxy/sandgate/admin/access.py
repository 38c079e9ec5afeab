"""Who is calling the admin API, and what their role lets them do.

Users come from `--admin-users FILE`::

    users:
      alice: {role: approver, token_sha256: <sha256 hex of alice's bearer token>}
      sam:   {role: viewer,   token_sha256: ...}

and the admin token (SANDGATE_ADMIN_TOKEN / --admin-token-file) is always the user `admin` with
role admin. Every request but the open paths needs `Authorization: Bearer <token>`; the token's
sha256 is compared in constant time with every user's (the file holds digests only, never a
token). The middleware sets `request[USER_KEY]` (the name) and `request[ROLE_KEY]` (typed
`web.RequestKey`s: aiohttp warns about plain string keys).

Roles: viewer may GET (and HEAD); approver may also decide approvals; admin may do everything.
A handler that an approver may call is marked with `@needs("approver")`; any other non-GET
handler needs admin. The name an approval is decided by is `request["sandgate_user"]`, never a
name from the request's body.

Behind `sandgate run --workers N`, the supervisor's front authenticates the user and forwards to
a worker over its control socket (authenticated with the worker token) with the user's name and
role in FORWARDED_USER / FORWARDED_ROLE: only a caller holding the worker token may set them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from aiohttp import web
from aiohttp.typedefs import Middleware

from sandgate.admin.login import Audit, FailureLimit, audit_login
from sandgate.console import is_console_path

Role = Literal["viewer", "approver", "admin"]
ROLES: tuple[Role, ...] = ("viewer", "approver", "admin")
RANK: dict[str, int] = {r: i for i, r in enumerate(ROLES)}
ADMIN_USER = "admin"  # the admin token's user
USER_KEY = web.RequestKey("sandgate_user", str)
ROLE_KEY = web.RequestKey("sandgate_role", str)
FORWARDED_USER = "X-Sandgate-User"
FORWARDED_ROLE = "X-Sandgate-Role"
OPENABLE = frozenset({"/readyz", "/metrics"})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HEX = re.compile(r"[0-9a-f]{64}")
_ROLE_ATTR = "_sandgate_role"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
H = TypeVar("H", bound=Handler)


@dataclass(frozen=True, slots=True)
class AdminUser:
    name: str
    role: Role
    token_sha256: bytes  # the digest of the user's bearer token (32 bytes)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def load_admin_users(path: Path) -> tuple[AdminUser, ...]:
    """Read `--admin-users FILE`; ValueError with the file, the user and what is wrong."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--admin-users {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"--admin-users {path}: not valid YAML ({type(e).__name__})") from None
    if not isinstance(doc, dict) or set(doc) != {"users"} or not isinstance(doc["users"], dict):
        raise ValueError(f"--admin-users {path}: write one key `users:` mapping each name to "
                         "{role: viewer|approver|admin, token_sha256: HEX}")
    users: list[AdminUser] = []
    seen: dict[bytes, str] = {}
    for name, spec in doc["users"].items():
        where = f"--admin-users {path}: user {name!r}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}: a name is letters, digits, '.', '_', '@', '-' (at most "
                             "64, starting with a letter or digit)")
        if name == ADMIN_USER:
            raise ValueError(f"{where}: `admin` is the admin token's user; pick another name")
        if not isinstance(spec, dict) or set(spec) - {"role", "token_sha256"}:
            raise ValueError(f"{where}: give exactly role and token_sha256")
        role = spec.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: role must be viewer, approver or admin, not {role!r}")
        digest = spec.get("token_sha256")
        if not isinstance(digest, str) or not _HEX.fullmatch(digest.lower()):
            raise ValueError(f"{where}: token_sha256 must be 64 hex digits (the sha256 of the "
                             "user's token: `printf %s TOKEN | sha256sum`)")
        raw = bytes.fromhex(digest)
        if raw in seen:
            raise ValueError(f"{where}: the same token as user {seen[raw]!r}; give each user "
                             "their own token")
        seen[raw] = name
        users.append(AdminUser(name, role, raw))
    return tuple(users)


def needs(role: Role) -> Callable[[H], H]:
    """Mark a handler as callable by `role` and above (default: viewer for GET/HEAD, admin
    for everything else)."""
    def mark(fn: H) -> H:
        setattr(fn, _ROLE_ATTR, role)
        return fn
    return mark


def required_role(request: web.Request) -> Role:
    handler = getattr(request.match_info, "handler", None)
    marked = getattr(handler, _ROLE_ATTR, None)
    if marked in ROLES:
        return marked  # type: ignore[no-any-return]
    return "viewer" if request.method in ("GET", "HEAD") else "admin"


def allowed(role: str, needed: Role) -> bool:
    return RANK.get(role, -1) >= RANK[needed]


class Authenticator:
    """Bearer token -> (user, role)."""

    def __init__(self, admin_token: str, users: tuple[AdminUser, ...] = ()) -> None:
        self._users = (AdminUser(ADMIN_USER, "admin", token_digest(admin_token)), *users)

    def user(self, authorization: str) -> AdminUser | None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        given = token_digest(token.strip())
        found: AdminUser | None = None
        for u in self._users:  # every digest compared: the time does not say which matched
            if hmac.compare_digest(given, u.token_sha256):
                found = u
        return found


def _error(status: int, code: str, reason: str) -> web.Response:
    import json

    return web.Response(status=status, text=json.dumps({"error": code, "reason": reason},
                                                       indent=2) + "\n",
                        content_type="application/json")


def too_many(wait: int) -> web.Response:
    response = _error(429, "too_many_failures", "too many wrong tokens from this address "
                      f"(sandgate.admin.login): try again in {wait} s")
    response.headers["Retry-After"] = str(wait)
    return response


def auth_middleware(admin_token: str, open_paths: frozenset[str],
                    users: tuple[AdminUser, ...] = (), trust_forwarded: bool = False,
                    audit: Audit | None = None, limit: FailureLimit | None = None
                    ) -> Middleware:
    """The admin check of every admin listener (this process's, the workers' front, a
    worker's control socket with `trust_forwarded`): `/healthz` always open, `--admin-open`
    paths from OPENABLE only, every other request authenticated and held to its role.
    A wrong Bearer token is audited (`admin_login`, never the token) and counted in `limit`
    (shared with the console's login form): past it, the source is answered 429."""
    limit = limit if limit is not None else FailureLimit()
    unexpected = open_paths - OPENABLE
    if unexpected:
        raise ValueError(f"admin paths that cannot be served without a token: "
                         f"{sorted(unexpected)} (only {sorted(OPENABLE)} can)")
    auth = Authenticator(admin_token, users)
    unauthenticated = open_paths | {"/healthz"}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in unauthenticated or is_console_path(request.path):
            return await handler(request)  # the web console has its own login (sessions)
        given = request.headers.get("Authorization")
        source = request.remote or "local"
        if given is not None:
            wait = limit.retry_after(source)
            if wait is not None:
                return too_many(wait)
        user = auth.user(given or "")
        if user is None:
            if given is not None:
                audit_login(audit, "failed", via="admin_api", source=source,
                            reason="a Bearer token of no user", failures=limit.failed(source))
            return _error(401, "unauthorized", "send Authorization: Bearer <admin token> "
                          "(SANDGATE_ADMIN_TOKEN or --admin-token-file, or a token of "
                          "--admin-users)")
        name, role = user.name, user.role
        if trust_forwarded and FORWARDED_USER in request.headers:
            fwd_role = request.headers.get(FORWARDED_ROLE, "")
            fwd_name = request.headers[FORWARDED_USER]
            if fwd_role not in ROLES or not _NAME.fullmatch(fwd_name):
                return _error(400, "bad_request", "bad forwarded user")
            name, role = fwd_name, fwd_role
        needed = required_role(request)
        if not allowed(role, needed):
            return _error(403, "forbidden", f"user {name!r} has role {role}; this needs "
                          f"{needed}")
        request[USER_KEY] = name
        request[ROLE_KEY] = role
        return await handler(request)

    return middleware


def forwarded_headers(request: web.Request) -> Mapping[str, str]:
    """The headers a front adds when it forwards an authenticated request to a worker."""
    user = request.get(USER_KEY)
    role = request.get(ROLE_KEY)
    if user is None or role is None:
        return {}
    return {FORWARDED_USER: user, FORWARDED_ROLE: role}
