"""The fleet's state: what every worker and replica must count or know together.

Without `--state`, each process counts for itself (`LocalCounts` over `sandgate.limits.Limiter`,
the embedded default for one machine). With `--state redis://HOST:PORT/DB` (or `rediss://` for
TLS; Redis 7, Valkey or a managed Redis), rates, connections per identity and secret budgets are
counted once for the whole fleet by atomic Lua scripts on the server (`scripts.py`), ended
sandboxes and reloads reach every replica (`fleet.py`), and each replica reports the policy
version it serves. See docs/fleet-state.md.

The stages see only `Counts` (`counts.py`): `GateState.counts`.

For other parts of Sandgate that keep fleet-wide state in the same Redis (held approvals...),
the API is two names::

    from sandgate.state import StateConfig, open_state

    cfg = StateConfig.from_url("redis://redis:6379/0", prefix="sandgate:", timeout=0.25)
    r = open_state(cfg)          # a redis.asyncio.Redis (decode_responses=True)
    await r.set(cfg.key("approvals", "abc"), "...", px=60_000)   # -> "sandgate:approvals:abc"

`open_state` connects lazily (the first command) with the configured TLS, AUTH and timeouts;
every key goes under `cfg.prefix` (`cfg.key(...)` joins the parts with ':'); a command that does
not answer within `cfg.timeout` raises (redis.exceptions.TimeoutError / ConnectionError): treat
it as "state unavailable" and fail closed. In `sandgate run` the one `StateConfig` is
`RunConfig.state` (None without --state).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sandgate.state.url import StateURL, parse_state_url
from sandgate.state.url import lease_kv as parse_lease_kv

if TYPE_CHECKING:
    import redis.asyncio as aioredis

DEFAULT_PREFIX = "sandgate:"
DEFAULT_TIMEOUT = 0.25
FailMode = Literal["open", "closed"]

__all__ = ["DEFAULT_PREFIX", "DEFAULT_TIMEOUT", "StateConfig", "StateURL", "open_state",
           "parse_state_url"]


@dataclass(frozen=True)
class StateConfig:
    """`--state`, `--state-prefix`, `--state-timeout`, `--state-fail`, `--state-password-file`,
    `--state-ca`."""

    url: StateURL
    prefix: str = DEFAULT_PREFIX
    timeout: float = DEFAULT_TIMEOUT  # seconds: the longest a request waits for the state
    # rates and connection counts while the state is down: per-process ("open") or refused
    fail: FailMode = "open"
    ca_file: Path | None = None  # rediss://: trust this CA (default: the system roots)
    # one dynamic lease per sandbox for the fleet, relayed through this KV v2 MOUNT/PREFIX
    # (sandgate.state.fleet_leases); None: each process mints its own
    lease_kv: str | None = None

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX,
                 timeout: float = DEFAULT_TIMEOUT, fail: FailMode = "open",
                 password_file: Path | None = None, ca_file: Path | None = None,
                 lease_kv: str | None = None) -> StateConfig:
        """Checked: ValueError says which option is wrong (never showing a password)."""
        parsed = parse_state_url(url)
        if not prefix or any(c.isspace() for c in prefix) or len(prefix) > 64:
            raise ValueError(f"--state-prefix {prefix!r}: 1-64 characters, no spaces")
        if not 0 < timeout <= 30:
            raise ValueError(f"--state-timeout {timeout:g}: between 0 and 30 seconds")
        if fail not in ("open", "closed"):
            raise ValueError(f"--state-fail {fail!r}: open or closed")
        if password_file is not None:
            if parsed.password is not None:
                raise ValueError("--state-password-file given, but the --state URL has a "
                                 "password too: give one of them")
            try:
                password = password_file.read_text().strip()
            except OSError as e:
                raise ValueError(f"--state-password-file {password_file}: {e.strerror}") \
                    from None
            if not password:
                raise ValueError(f"--state-password-file {password_file} is empty")
            parsed = StateURL(parsed.host, parsed.port, parsed.db, parsed.tls, parsed.username,
                              password)
        if ca_file is not None:
            if not parsed.tls:
                raise ValueError("--state-ca is for TLS: use a rediss:// URL")
            if not ca_file.is_file():
                raise ValueError(f"--state-ca {ca_file}: no such file")
        if lease_kv is not None:
            parse_lease_kv(lease_kv)
        return cls(parsed, prefix, timeout, fail, ca_file, lease_kv)

    def key(self, *parts: str) -> str:
        """A key of this fleet: the prefix, then the parts joined by ':'."""
        return self.prefix + ":".join(parts)


def open_state(cfg: StateConfig, *, blocking: bool = False) -> aioredis.Redis:
    """A client for the fleet's Redis (lazy: nothing is dialled until the first command).
    Every command waits at most `cfg.timeout`; `blocking=True` (pub/sub) lets reads wait."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    u = cfg.url
    tls: dict[str, object] = {}
    if u.tls:  # verified: the system roots, or --state-ca; the host name checked
        tls = {"ssl": True, "ssl_cert_reqs": "required", "ssl_check_hostname": True,
               "ssl_ca_certs": str(cfg.ca_file) if cfg.ca_file else None}
    return aioredis.Redis(
        host=u.host, port=u.port, db=u.db, username=u.username, password=u.password,
        socket_timeout=None if blocking else cfg.timeout, socket_connect_timeout=cfg.timeout,
        decode_responses=True,
        # no retries inside the client: the wait stays bounded by cfg.timeout, and a failure
        # is seen at once (the heartbeat reconnects)
        retry=Retry(NoBackoff(), 0), **tls)  # type: ignore[arg-type]
