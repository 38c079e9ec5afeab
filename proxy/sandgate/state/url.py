"""`--state URL`: the Redis address of the fleet's shared state, parsed and checked up front.

    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]       plain TCP
    rediss://[[USER]:PASSWORD@]HOST[:PORT][/DB]      TLS (the server's certificate is verified
                                                     against the system roots, or --state-ca)

A pure parser: every bad URL gets a ValueError saying what is wrong; the password never appears
in an error, a log line or `redacted()` (docs recommend `--state-password-file` so it is not on
a command line either). Query strings are refused rather than passed through: an option the
argument depends on (TLS verification) must not be switched off by one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class StateURL:
    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def redacted(self) -> str:
        """The URL for logs and /readyz: the password (if any) shown as ***."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{auth}{host}:{self.port}/{self.db}"


def parse_state_url(url: str) -> StateURL:
    """Parse `--state`; ValueError (without the password) when it is not a usable Redis URL."""
    shown = _redact_raw(url)
    if not url or any(c.isspace() for c in url):
        raise ValueError(f"--state {shown!r}: expected redis://HOST[:PORT][/DB] or "
                         "rediss://HOST[:PORT][/DB] (no spaces)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--state {shown!r}: {_why(e)}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--state {shown!r}: the scheme must be redis:// or rediss:// (TLS), "
                         f"not {parts.scheme + '://' if parts.scheme else 'none'}")
    if parts.query or parts.fragment:
        raise ValueError(f"--state {shown!r}: no ?query or #fragment is taken (TLS and AUTH "
                         "come from the scheme, the user:password and --state-* options)")
    host = parts.hostname or ""
    if not host:
        raise ValueError(f"--state {shown!r}: no host, e.g. redis://redis.internal:6379/0")
    if not _valid_host(host):
        raise ValueError(f"--state {shown!r}: {host!r} is not a host name or IP address")
    if port is None:
        port = DEFAULT_PORT
    elif not 0 < port < 65536:
        raise ValueError(f"--state {shown!r}: port {port} is outside 1-65535")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"--state {shown!r}: the path is the database number (/0 to /15 "
                         f"on a default server), not {path!r}")
    db = int(path) if path else 0
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return StateURL(host=host, port=port, db=db, tls=parts.scheme == "rediss",
                    username=username, password=password or None)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST.match(host)) and ".." not in host


def _why(e: ValueError) -> str:
    text = str(e)
    if "Port" in text or "port" in text:
        return "the port must be a number between 1 and 65535"
    return "not a URL (" + text.replace("'", "") + ")"


def _redact_raw(url: str) -> str:
    """The URL as given, its password (between ':' and '@' of the authority) replaced."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url if "@" not in url else "***@" + url.rpartition("@")[2]
    authority, slash, tail = rest.partition("/")
    if "@" in authority:
        userinfo, _, hostport = authority.rpartition("@")
        user = userinfo.partition(":")[0]
        authority = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    return f"{scheme}://{authority}{slash}{tail}"


def lease_kv(spec: str) -> tuple[str, str]:
    """`--state-lease-kv MOUNT/PREFIX` -> (mount, prefix); ValueError says what is wrong."""
    mount, _, prefix = spec.strip("/").partition("/")
    if not mount or not prefix or any(c.isspace() for c in spec) or ".." in spec:
        raise ValueError(f"--state-lease-kv {spec!r}: expected MOUNT/PREFIX of a KV v2 engine, "
                         "e.g. secret/sandgate-leases")
    return mount, prefix.strip("/")
