"""Stateless proxy tokens: an identity (and optional sandbox id) signed with the confdir key.

Format: ``sg1.<base64url(payload JSON)>.<base64url(HMAC-SHA256(key, "sg1." + payload_b64))>``,
base64url without padding. Payload: ``{"id": identity, "sbx": sandbox | null, "iat": int,
"exp": int}``. Any process holding the key verifies a token; nothing is stored.

A sandbox presents its token as the password of ``Proxy-Authorization: Basic``; the user part
must name the token's identity or its sandbox id. No message here ever contains a token or a
password.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sandgate.errors import Code, IdentityError, NotVerified
from sandgate.identity.base import Caller

VERSION = "sg1"
DEFAULT_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 365 * 86400
MAX_TOKEN_LENGTH = 4096  # far above any real token; refuse before doing any work on junk

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TTL_RE = re.compile(r"([0-9]+)([smhd])")
_B64URL_RE = re.compile(r"[A-Za-z0-9_-]*")
_SAFE_USER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,63}")


class TokenError(NotVerified):
    """A token was refused. The message is safe to show the caller and never echoes the token."""


@dataclass(frozen=True, slots=True)
class TokenClaims:
    identity: str
    sandbox: str | None
    expires_at: int  # Unix seconds


def _b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    if not _B64URL_RE.fullmatch(text) or len(text) % 4 == 1:
        raise TokenError("malformed proxy token")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TokenError("malformed proxy token") from None


def _sign(key: bytes, payload_b64: str) -> bytes:
    return hmac.new(key, f"{VERSION}.{payload_b64}".encode("ascii"), hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) < 16:
        raise ValueError("the token key must be at least 16 bytes")


def _now(now: float | None) -> int:
    return int(time.time() if now is None else now)


def parse_ttl(text: str) -> int:
    """'30s', '15m', '1h', '7d' -> seconds. Positive whole numbers only, at most 365d."""
    m = _TTL_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"invalid TTL {text!r}: expected a positive whole number followed by s, m, h or d "
            "(e.g. 30s, 15m, 1h, 7d)"
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"invalid TTL {text!r}: must be greater than zero")
    if seconds > MAX_TTL_SECONDS:
        raise ValueError(f"invalid TTL {text!r}: at most 365d")
    return seconds


def issue_token(
    key: bytes,
    identity: str,
    sandbox: str | None = None,
    ttl_seconds: int = DEFAULT_TTL_SECONDS,
    now: float | None = None,
) -> str:
    """A token for `identity` (and `sandbox`, if given) valid for `ttl_seconds` from `now`."""
    _check_key(key)
    if not isinstance(identity, str) or not identity:
        raise ValueError("a token needs a non-empty identity")
    if sandbox is not None and (not isinstance(sandbox, str) or not sandbox):
        raise ValueError("the sandbox id must be a non-empty string or None")
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds <= 0:
        raise ValueError("ttl_seconds must be a positive whole number")
    if ttl_seconds > MAX_TTL_SECONDS:
        raise ValueError("ttl_seconds must be at most 365 days")
    iat = _now(now)
    payload = {"id": identity, "sbx": sandbox, "iat": iat, "exp": iat + ttl_seconds}
    payload_b64 = _b64url_encode(
        json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("utf-8")
    )
    return f"{VERSION}.{payload_b64}.{_b64url_encode(_sign(bytes(key), payload_b64))}"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def verify_token(key: bytes, token: str, now: float | None = None) -> TokenClaims:
    """The claims of a valid, unexpired token. Raises TokenError otherwise."""
    _check_key(key)
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LENGTH:
        raise TokenError("malformed proxy token")
    parts = token.split(".")
    if len(parts) != 3:
        raise TokenError("malformed proxy token")
    version, payload_b64, sig_b64 = parts
    if version != VERSION:
        raise TokenError("unknown proxy token version")
    _b64url_decode(sig_b64)
    # Compare the text, not the decoded bytes: lenient base64 decoding ignores the unused low
    # bits of the last character, which would let other spellings of a token verify.
    expected = _b64url_encode(_sign(bytes(key), payload_b64))
    if not hmac.compare_digest(sig_b64.encode("ascii"), expected.encode("ascii")):
        raise TokenError("proxy token signature is invalid")
    # Signed by us: the payload is trusted from here on, but still checked defensively.
    try:
        payload = json.loads(_b64url_decode(payload_b64).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TokenError("malformed proxy token") from None
    if not isinstance(payload, dict):
        raise TokenError("malformed proxy token")
    for field in ("id", "sbx", "iat", "exp"):
        if field not in payload:
            raise TokenError(f"proxy token is missing field {field!r}")
    identity, sandbox, exp = payload["id"], payload["sbx"], payload["exp"]
    if not isinstance(identity, str) or not identity:
        raise TokenError("proxy token has an invalid identity")
    if sandbox is not None and (not isinstance(sandbox, str) or not sandbox):
        raise TokenError("proxy token has an invalid sandbox id")
    if not _is_int(exp) or not _is_int(payload["iat"]):
        raise TokenError("proxy token has invalid timestamps")
    if _now(now) >= exp:
        try:
            when = datetime.fromtimestamp(exp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        except (OverflowError, ValueError, OSError):
            when = str(exp)
        raise TokenError(f"proxy token expired at {when}")
    return TokenClaims(identity=identity, sandbox=sandbox, expires_at=exp)


def authenticate_basic(header_value: str | None, key: bytes, now: float | None = None) -> Caller:
    """The caller a ``Proxy-Authorization: Basic base64(user:token)`` value proves.

    Raises IdentityError("auth_required") when there is no header, and
    IdentityError(Code.AUTH_INVALID) for anything else wrong. Messages never include the token.
    """
    if header_value is None or not header_value.strip():
        raise IdentityError(
            Code.AUTH_REQUIRED,
            "proxy authentication required: send Proxy-Authorization: Basic with a proxy token "
            "as the password",
        )
    scheme, _, credentials = header_value.strip().partition(" ")
    if scheme.lower() != "basic":
        raise IdentityError(
            Code.AUTH_INVALID, "unsupported proxy authorization scheme: only Basic is accepted"
        )
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise IdentityError(
            Code.AUTH_INVALID, "malformed Basic proxy credentials: not base64 of user:password"
        ) from None
    user, colon, password = decoded.partition(":")
    if not colon:
        raise IdentityError(
            Code.AUTH_INVALID, "malformed Basic proxy credentials: no ':' between user and password"
        )
    try:
        claims = verify_token(key, password, now=now)
    except TokenError as e:
        raise IdentityError(Code.AUTH_INVALID, str(e)) from None
    if user not in (claims.identity, claims.sandbox):
        looks_like_token = user.startswith(VERSION + ".") or (len(user) >= 12 and user in password)
        if _SAFE_USER_RE.fullmatch(user) and not looks_like_token:
            raise IdentityError(Code.AUTH_INVALID, f"user '{user}' does not match the token")
        # Never echo something that may be (part of) a token pasted into the user field.
        raise IdentityError(Code.AUTH_INVALID, "the Basic user does not match the token")
    return Caller(identity=claims.identity, sandbox=claims.sandbox, source="token",
                  expires=float(claims.expires_at))


def authenticate_bare(token: str | None, key: bytes, now: float | None = None) -> Caller:
    """The caller a bare token proves (the gateway's token header: no Basic user to match).
    Raises IdentityError like `authenticate_basic`; messages never include the token."""
    if token is None or not token.strip():
        raise IdentityError(Code.AUTH_REQUIRED, "authentication required: send a Sandgate "
                            "token")
    try:
        claims = verify_token(key, token.strip(), now=now)
    except TokenError as e:
        raise IdentityError(Code.AUTH_INVALID, str(e)) from None
    return Caller(identity=claims.identity, sandbox=claims.sandbox, source="token")


CANARY_PREFIX = "sandgate-canary-"


def canary(key: bytes, identity: str) -> str:
    """The decoy credential for `identity`: derived from the token key, so every replica and
    `sandgate canary` agree without state. Plant it where a real key would be; with
    `sandgate run --canary` any request carrying it (in any encoding) is refused and audited as
    an exfiltration attempt, and any response carrying it is scrubbed."""
    _check_key(key)
    mac = hmac.new(key, f"canary:{identity}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"{CANARY_PREFIX}{mac}"
