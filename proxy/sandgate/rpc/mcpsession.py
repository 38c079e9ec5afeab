"""MCP session ids bound to the identity and server they were opened for, without state.

An upstream hands out a session with `Mcp-Session-Id: SID`. Sandgate passes the client a wrapped
id instead, ``sgs1.<base64url(SID)>.<MAC>``, where MAC is the first 22 base64url characters
(132 bits) of ``HMAC-SHA256(session_key, identity \\0 host:port \\0 SID)``. A request on a call
rule (`mcp:` / `jsonrpc:`) that carries the header must carry such an id whose MAC verifies for
its own identity and its own host:port; it is unwrapped to SID before it goes on. Anything else
(another identity's id, another server's, an id the upstream's client got some other way, junk)
is refused and never forwarded.

Why not a map of SID -> identity: a map is per process, so with `--workers N`, replicas, a
restart or a flood that evicts entries, an id one process never saw would have to be let
through (fail open) or every such request refused. The MAC needs only the key, which every
worker and replica already shares (the token key in the confdir, sandgate.confdir.token_key);
the session key is derived from it under its own label, so a session MAC is never a valid
token signature or canary and the reverse.

The MCP protocol version negotiated for the session can be bound too (`wrap(..., version=V)`),
where Sandgate read it from the server's initialize answer: the MAC is then taken under a key
of its own (so a bound id is never a valid unbound one, or the reverse) over the version as
well, and `unwrap_bound` says which version an id was bound to. The id's form is the same.

The wrapped id is visible ASCII only (base64url and dots), as the MCP transport requires. Its
prefix is not the token's (`sg1.`) so the gateway never mistakes it for a Sandgate token. No
message here contains the id or the SID.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re

from sandgate.errors import NotVerified

PREFIX = "sgs1"
MAC_CHARS = 22  # 132 bits of the HMAC
MAX_WRAPPED = 4096  # far above any real session id; refused before any work
_LABEL = b"sandgate mcp-session-id v1"
_VERSION_LABEL = b"sandgate mcp-session-id protocol version v1"
_VERSION = re.compile(r"[0-9A-Za-z._-]{1,64}")  # MCP revisions are dates; never a NUL
_B64URL = re.compile(r"[A-Za-z0-9_-]+")


class SessionIdError(NotVerified):
    """A presented session id that does not verify. The message never echoes the id."""


def session_key(token_key: bytes) -> bytes:
    """The session MAC key: HMAC(token key, a label of its own) (an HKDF-Expand step with one
    block), so every process holding the confdir key derives the same one."""
    if len(token_key) < 16:
        raise ValueError("the token key must be at least 16 bytes")
    return hmac.new(bytes(token_key), _LABEL, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _mac(key: bytes, identity: str, host: str, port: int, sid: bytes) -> str:
    # identity and host never hold a NUL (policy names, a parsed host), and SID comes last:
    # the message is unambiguous. Checked anyway: a NUL would let two bindings share a MAC.
    if "\0" in identity or "\0" in host:
        raise ValueError("an identity or host with a NUL cannot be bound")
    msg = b"\0".join([identity.encode(), f"{host}:{port}".encode(), sid])
    return _b64(hmac.new(key, msg, hashlib.sha256).digest())[:MAC_CHARS]


def _version_mac(key: bytes, version: str, identity: str, host: str, port: int,
                 sid: bytes) -> str:
    if not _VERSION.fullmatch(version):
        raise ValueError("a protocol version to bind must be a short token")
    if "\0" in identity or "\0" in host:
        raise ValueError("an identity or host with a NUL cannot be bound")
    vkey = hmac.new(key, _VERSION_LABEL, hashlib.sha256).digest()
    msg = b"\0".join([version.encode(), identity.encode(), f"{host}:{port}".encode(), sid])
    return _b64(hmac.new(vkey, msg, hashlib.sha256).digest())[:MAC_CHARS]


def wrap(key: bytes, identity: str, host: str, port: int, sid: bytes,
         version: str | None = None) -> str:
    """The id the client is given for the upstream's `sid`, bound to identity and host:port
    (and to the session's protocol `version`, when given)."""
    if not sid:
        raise ValueError("an empty session id cannot be bound")
    mac = (_mac(key, identity, host, port, sid) if version is None
           else _version_mac(key, version, identity, host, port, sid))
    return f"{PREFIX}.{_b64(sid)}.{mac}"


def unwrap(key: bytes, identity: str, host: str, port: int, wrapped: str) -> bytes:
    """The upstream's session id inside `wrapped`, if Sandgate issued it to `identity` for
    host:port without a protocol version. Raises SessionIdError otherwise (the message says
    why, never the id)."""
    sid, _ = unwrap_bound(key, identity, host, port, wrapped, ())
    return sid


def unwrap_bound(key: bytes, identity: str, host: str, port: int, wrapped: str,
                 versions: tuple[str, ...]) -> tuple[bytes, str | None]:
    """The upstream's session id inside `wrapped` and the protocol version it was bound to
    (None: bound to none), if Sandgate issued it to `identity` for host:port, unbound or bound
    to one of `versions`. Raises SessionIdError otherwise (never quoting the id)."""
    if len(wrapped) > MAX_WRAPPED:
        raise SessionIdError("it is longer than any session id Sandgate issues")
    parts = wrapped.strip().split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise SessionIdError("it is not a session id Sandgate issued (those start with "
                             f"{PREFIX}.)")
    _, body, mac = parts
    if not _B64URL.fullmatch(body) or len(body) % 4 == 1 or len(mac) != MAC_CHARS \
            or not _B64URL.fullmatch(mac):
        raise SessionIdError("it is not a well-formed Sandgate session id")
    try:
        sid = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise SessionIdError("it is not a well-formed Sandgate session id") from None
    if _b64(sid) != body:  # one spelling per id: lenient decoding ignores unused low bits
        raise SessionIdError("it is not a well-formed Sandgate session id")
    candidates: list[tuple[str | None, str]] = [(None, _mac(key, identity, host, port, sid))]
    candidates += [(v, _version_mac(key, v, identity, host, port, sid)) for v in versions]
    for version, expected in candidates:
        if hmac.compare_digest(mac.encode("ascii"), expected.encode("ascii")):
            return sid, version
    raise SessionIdError(f"it was not issued through Sandgate to {identity} for "
                         f"{host}:{port} (another identity's session, or another server's)")
