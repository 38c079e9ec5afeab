"""Who is looking at the console: login with a token, a session cookie, CSRF tokens, roles.

A browser cannot send `Authorization: Bearer`, so the login form takes the admin token (or,
with users, a user's token) once and the console answers with a session cookie:

- the cookie holds a random session id and its MAC (HMAC-SHA256 under a random key of this
  process), HttpOnly, SameSite=Strict, Path=/console/, Secure when the request came over TLS;
- sessions live in this process (the one admin listener, also with --workers N), expire
  after SESSION_TTL, at most MAX_SESSIONS at once (the oldest go first); logout forgets one;
- every state-changing form carries the session's CSRF token (checked in constant time), and a
  POST whose Origin (or Sec-Fetch-Site) says another site is refused before that;
- the login form itself carries a MAC of a pre-session nonce cookie (no login CSRF).

Users and roles are the admin listener's (sandgate.admin.access: the admin token is user `admin`,
`--admin-users` adds viewers, approvers and admins): viewer reads everything, approver also
decides approvals, admin is both here. `who()` is the one place that says which user and role
a request has.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from sandgate.admin.access import ROLE_KEY, ROLES, USER_KEY, Authenticator, allowed

COOKIE = "sandgate_console"
LOGIN_COOKIE = "sandgate_console_login"
COOKIE_PATH = "/console/"
SESSION_TTL = 8 * 3600
LOGIN_TTL = 600
MAX_SESSIONS = 256


def who(request: web.Request) -> tuple[str, str]:
    """(user, role) of a request: its console session's, else what the admin listener's user
    check set (sandgate.admin.access). Neither: ("", ""), a role that may do nothing."""
    session = request.get(SESSION_KEY)
    if isinstance(session, Session):
        return session.user, session.role
    return str(request.get(USER_KEY) or ""), str(request.get(ROLE_KEY) or "")


def can_decide(role: str) -> bool:
    return allowed(role, "approver")


def identify(token: str, check: Authenticator) -> tuple[str, str] | None:
    """The (user, role) a login token stands for, or None: the admin listener's own check
    (the admin token is user `admin`, role admin; --admin-users adds users with roles)."""
    user = check.user(f"Bearer {token}") if token else None
    return (user.name, user.role) if user is not None else None


@dataclass(slots=True)
class Session:
    user: str
    role: str
    csrf: str
    expires: float


SESSION_KEY = web.RequestKey("sandgate_console_session", Session)


@dataclass
class Sessions:
    """The console's sessions, in this process. `clock` for tests."""

    ttl: float = SESSION_TTL
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    clock: Callable[[], float] = time.monotonic
    _live: OrderedDict[str, Session] = field(default_factory=OrderedDict, repr=False)

    def _now(self) -> float:
        return self.clock()

    def mac(self, value: str, purpose: str) -> str:
        return hmac.new(self.key, f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def create(self, user: str, role: str) -> tuple[str, Session]:
        """A new session and its cookie value."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        self._expire()
        while len(self._live) >= MAX_SESSIONS:
            self._live.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        s = Session(user, role, secrets.token_urlsafe(32), self._now() + self.ttl)
        self._live[sid] = s
        return f"{sid}.{self.mac(sid, 'session')}", s

    def find(self, cookie: str | None) -> Session | None:
        return self.lookup(cookie)[0]

    def lookup(self, cookie: str | None) -> tuple[Session | None, Session | None]:
        """(the live session of a cookie, or None; the session it named if that just
        expired, to be audited once: it is forgotten now)."""
        if not cookie:
            return None, None
        sid, _, tag = cookie.partition(".")
        if not sid or not hmac.compare_digest(tag.encode(), self.mac(sid, "session").encode()):
            return None, None
        s = self._live.get(sid)
        if s is not None and s.expires <= self._now():
            del self._live[sid]
            return None, s
        return s, None

    def drop(self, cookie: str | None) -> Session | None:
        return self._live.pop(cookie.partition(".")[0], None) if cookie else None

    def _expire(self) -> None:
        now = self._now()
        for sid in [sid for sid, s in self._live.items() if s.expires <= now]:
            del self._live[sid]

    # the login form: a nonce in a short-lived cookie, its MAC in the form
    def login_nonce(self) -> tuple[str, str]:
        nonce = f"{int(self._now()) + LOGIN_TTL}.{secrets.token_urlsafe(16)}"
        return nonce, self.mac(nonce, "login")

    def login_ok(self, nonce: str | None, form_token: str) -> bool:
        if not nonce:
            return False
        good = hmac.compare_digest(form_token.encode("utf-8", "replace"),
                                   self.mac(nonce, "login").encode())
        deadline = nonce.partition(".")[0]
        return good and deadline.isdigit() and int(deadline) > self._now()


def csrf_ok(session: Session, form_token: str) -> bool:
    return hmac.compare_digest(form_token.encode("utf-8", "replace"), session.csrf.encode())


def same_origin(request: web.Request) -> bool:
    """False when the browser says the request comes from another site. Browsers send
    Sec-Fetch-Site with every request and Origin with every POST, but under the console's
    `Referrer-Policy: no-referrer` a same-origin form POST carries `Origin: null`: then only
    Sec-Fetch-Site can vouch for it. A client that sends neither header is judged by the CSRF
    token alone."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    if origin == "null":
        return site == "same-origin"
    return origin == f"{request.scheme}://{request.host}"


def set_cookie(response: web.StreamResponse, request: web.Request, name: str, value: str,
               max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path=COOKIE_PATH, httponly=True,
                        samesite="Strict", secure=request.secure)


def clear_cookie(response: web.StreamResponse, request: web.Request, name: str) -> None:
    response.del_cookie(name, path=COOKIE_PATH, httponly=True, samesite="Strict",
                        secure=request.secure)
