"""The secret broker: reads secrets from Vault / OpenBao on first need and caches them briefly.

Rules this module keeps:

* hvac is synchronous, so every hvac call runs in a small dedicated thread pool, with a socket
  timeout (``VaultConfig.timeout``) and an outer asyncio deadline; a slow Vault gives a
  ``SecretError`` after about ``timeout`` seconds and never blocks the event loop.
* A secret is read when first needed, then cached for ``ttl`` seconds. Concurrent ``get()`` calls
  for the same uncached secret share one Vault read. Failures are not cached, and an expired
  value is never served, even when Vault is down.
* Secret values never reach a log line, an exception message or a repr. hvac exceptions may
  carry Vault's response body, so their text is never propagated: ``SecretError`` messages are
  built here from the secret name, the Vault path and the kind of failure only, and are raised
  ``from None``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import hvac
import hvac.exceptions
import requests

from sandgate.errors import SecretError, Unavailable
from sandgate.identity.base import Caller
from sandgate.policy.model import GitHubScope, SecretRef
from sandgate.secrets.github_app import GitHubApps
from sandgate.secrets.leases import LeaseManager
from sandgate.secrets.oauth2 import OAuth2Tokens
from sandgate.secrets.scope import GLOBAL, Scope, scope_of
from sandgate.secrets.scope import resolve as resolve_path
from sandgate.secrets.tokenhttp import Dial
from sandgate.secrets.values import check_value

log = logging.getLogger("sandgate.vault")

T = TypeVar("T")

@dataclass(frozen=True)
class SecretValue:
    name: str
    value: str = field(repr=False)
    version: int | None = None
    username: str | None = field(default=None, repr=False)  # a dynamic secret's user name
    lease_id: str | None = None  # a dynamic secret's lease (not a credential)
    note: str | None = None  # how a minted value was obtained, for the audit (never a value)
    # further parts of a multi-part credential (an aws secret's session_token)
    extra: tuple[tuple[str, str], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class VaultConfig:
    addr: str
    token: str | None = field(default=None, repr=False)
    role_id: str | None = None
    secret_id: str | None = field(default=None, repr=False)
    cacert: str | None = None
    namespace: str | None = None
    timeout: float = 5.0

    @property
    def approle(self) -> bool:
        return bool(self.role_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> VaultConfig:
        addr = env.get("VAULT_ADDR", "").strip()
        if not addr:
            raise ValueError("VAULT_ADDR is not set")

        def opt(key: str) -> str | None:
            v = env.get(key, "").strip()
            return v or None

        token, role_id, secret_id = opt("VAULT_TOKEN"), opt("VAULT_ROLE_ID"), opt("VAULT_SECRET_ID")
        if bool(role_id) != bool(secret_id):
            missing = "VAULT_SECRET_ID" if role_id else "VAULT_ROLE_ID"
            raise ValueError(f"VAULT_ADDR is set with AppRole auth, but {missing} is not set "
                             "(AppRole needs both VAULT_ROLE_ID and VAULT_SECRET_ID)")
        if not token and not role_id:
            raise ValueError("VAULT_ADDR is set but no Vault credentials are: set VAULT_TOKEN, "
                             "or VAULT_ROLE_ID and VAULT_SECRET_ID for AppRole")
        if token and role_id:
            log.info("both VAULT_TOKEN and AppRole credentials are set; using AppRole")
            token = None
        timeout = _parse_timeout(opt("VAULT_CLIENT_TIMEOUT"))
        return cls(addr=addr, token=token, role_id=role_id, secret_id=secret_id,
                   cacert=opt("VAULT_CACERT"), namespace=opt("VAULT_NAMESPACE"),
                   timeout=timeout)


def _parse_timeout(spec: str | None, default: float = 5.0) -> float:
    """VAULT_CLIENT_TIMEOUT as Vault's own CLI reads it: seconds, optionally with an `s`."""
    if spec is None:
        return default
    try:
        value = float(spec.removesuffix("s"))
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ValueError(f"VAULT_CLIENT_TIMEOUT must be a number of seconds (like 5 or 2.5s), "
                         f"between 0 and 3600; got {spec!r}")
    return value


_Loc = tuple[str, str, str, int]


@dataclass
class _Entry:
    key: _Loc  # the policy's location (unresolved): a reload that changes it drops the entry
    value: SecretValue
    expires: float  # monotonic
    scope: Scope = GLOBAL  # whose value it is (per-identity / per-sandbox paths)


def _ref_key(ref: SecretRef, path: str | None = None) -> _Loc:
    """What identifies the secret's location (`path`: resolved for one caller); a change of
    `placeholder` or `source` keeps cache."""
    return (ref.mount, ref.path if path is None else path, ref.field, ref.kv_version)


def _where(ref: SecretRef, path: str | None = None) -> str:
    return f"{ref.mount.strip('/')}/{(ref.path if path is None else path).strip('/')}"


class BrokerObserver(Protocol):
    """What the broker reports (metrics): names and outcomes only, never values."""

    def secret_cache(self, name: str, hit: bool) -> None: ...
    def secret_fetch(self, name: str, outcome: str) -> None: ...
    def vault_call(self, seconds: float) -> None: ...


class _VaultFailure(Unavailable):
    """Internal: a classified, message-safe failure of one Vault call."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # "unreachable" | "timeout" | "denied" | "notfound" | "server" | "other"
        self.detail = detail


def _classify(e: BaseException) -> _VaultFailure:
    """Map an exception from hvac/requests to a safe description. Never uses the exception text."""
    if isinstance(e, _VaultFailure):
        return e
    if isinstance(e, requests.exceptions.Timeout | TimeoutError):
        return _VaultFailure("timeout", "Vault timed out")
    if isinstance(e, requests.exceptions.SSLError):
        return _VaultFailure("unreachable", "TLS handshake with Vault failed")
    if isinstance(e, requests.exceptions.ConnectionError):
        text = repr(e).lower()  # inspected, not propagated
        if "refused" in text:
            return _VaultFailure("unreachable", "Vault is unreachable (connection refused)")
        return _VaultFailure("unreachable", "Vault is unreachable (connection failed)")
    if isinstance(e, hvac.exceptions.Forbidden):
        return _VaultFailure("denied", "Vault denied access (HTTP 403: permission denied; the "
                             "Vault token may be expired or revoked, or lacks a policy for "
                             "this path)")
    if isinstance(e, hvac.exceptions.Unauthorized):
        return _VaultFailure("denied", "Vault refused the credentials (HTTP 401)")
    if isinstance(e, hvac.exceptions.InvalidPath):
        return _VaultFailure("notfound", "not found in Vault (HTTP 404)")
    if isinstance(e, hvac.exceptions.VaultDown):
        return _VaultFailure("server", "Vault is sealed or unavailable (HTTP 503)")
    if isinstance(e, hvac.exceptions.VaultNotInitialized):
        return _VaultFailure("server", "Vault is not initialized (HTTP 501)")
    if isinstance(e, hvac.exceptions.InternalServerError | hvac.exceptions.BadGateway):
        return _VaultFailure("server", "Vault had a server error (HTTP 5xx)")
    if isinstance(e, hvac.exceptions.RateLimitExceeded):
        return _VaultFailure("server", "Vault rate-limited the request (HTTP 429)")
    if isinstance(e, hvac.exceptions.InvalidRequest):
        return _VaultFailure("other", "Vault rejected the request (HTTP 400)")
    if isinstance(e, hvac.exceptions.VaultError):
        return _VaultFailure("other", "Vault returned an unexpected error")
    if isinstance(e, requests.exceptions.RequestException):
        return _VaultFailure("other", f"request to Vault failed ({type(e).__name__})")
    return _VaultFailure("other", f"unexpected error talking to Vault ({type(e).__name__})")



class SecretBroker:
    """Reads, caches and hands out secret values. One per proxy process, used from one loop."""

    def __init__(
        self,
        config: VaultConfig,
        secrets: Mapping[str, SecretRef],
        *,
        ttl: float = 300.0,
        renew_interval: float = 60.0,
        max_workers: int = 8,
        observer: BrokerObserver | None = None,
        audit: Callable[..., None] | None = None,
    ) -> None:
        """`observer`: told of each Vault call, cache hit and fetch (the metrics); `audit`: the
        audit sink's emit, for lease events (mint, renew, revoke: never a value)."""
        self.config = config
        self.ttl = ttl
        self.renew_interval = renew_interval  # upper bound between token checks
        self.vault_reads = 0  # number of secret reads sent to Vault (for tests and benchmarks)
        self.logins = 0  # number of AppRole logins performed
        self._refs: dict[str, SecretRef] = dict(secrets)
        # (name, resolved location) -> entry: per-sandbox paths give one entry per sandbox
        self._cache: dict[tuple[str, _Loc], _Entry] = {}
        self._kv_generation = 0
        self._inflight: dict[tuple[str, _Loc], asyncio.Task[SecretValue]] = {}
        self.leases = LeaseManager(_HvacLeases(self), audit=audit)
        self.leases.on_sandbox_end = self._forget_sandbox
        # values that left the cache (rotated, forgotten, dropped by a reload) and leases that
        # ended: still scrubbed and detected for a window (sandgate.secrets.retired)
        self.retired = self.leases.retired
        self._lease_task: asyncio.Task[None] | None = None
        self.lease_tick = 0.5  # seconds between lease steps (renewals, expiries, retries)
        self._login_task: asyncio.Task[None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._clock: Callable[[], float] = time.monotonic
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="sandgate-vault")
        self._client = self._new_client(config.token or "")
        self._logged_in = not config.approle
        self._closed = False
        self.observer = observer
        self._health: tuple[float, str | None] | None = None  # (checked at, problem) for check()
        self._health_task: asyncio.Task[str | None] | None = None
        self.oauth2 = OAuth2Tokens(self._read_record, self._write_record, self._clock)
        self.github = GitHubApps(self._read_record, self._clock)

    @property
    def generation(self) -> int:
        """Bumped whenever a cached value (KV or lease) appears, changes or goes: consumers that
        compile the values (the scrubber's automaton) rebuild only then."""
        return (self._kv_generation + self.leases.generation + self.retired.generation
                + self.oauth2.generation + self.github.generation)

    # ----------------------------------------------------------------------------- plumbing

    def _new_client(self, token: str) -> hvac.Client:
        session = requests.Session()
        # Vault traffic goes direct: never through HTTP(S)_PROXY from the environment (which may
        # even point at this proxy), and TLS is verified against VAULT_CACERT or the system store.
        session.trust_env = False
        session.verify = self.config.cacert or True
        # token="" (never None): hvac would otherwise pick up VAULT_TOKEN or ~/.vault-token.
        return hvac.Client(url=self.config.addr, token=token, verify=self.config.cacert or True,
                           timeout=self.config.timeout, namespace=self.config.namespace,
                           session=session)

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run a blocking hvac call in the pool with an outer deadline; classify failures."""
        if self._closed:
            raise _VaultFailure("other", "the secret broker is closed")
        loop = asyncio.get_running_loop()
        # requests' timeout bounds connect and each socket read; the outer deadline bounds the
        # whole call (a server dribbling bytes, DNS, a saturated pool).
        deadline = self.config.timeout * 2 + 1.0
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that races
        # with the call finishing, which would keep the renewal task alive after aclose().
        started = time.monotonic()
        try:
            async with asyncio.timeout(deadline):
                return await loop.run_in_executor(self._pool, fn)
        except TimeoutError:
            raise _VaultFailure("timeout", "Vault timed out") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise _classify(e) from None
        finally:
            if self.observer is not None:
                self.observer.vault_call(time.monotonic() - started)

    # ----------------------------------------------------------------------------- readiness

    async def check(self, timeout: float = 2.0, max_age: float = 1.5) -> str | None:
        """Is Vault reachable and are we authenticated? None when yes, else why not (no secret
        text). One token lookup-self, at most every `max_age` seconds, shared by concurrent
        callers, bounded by `timeout`."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < max_age:
            return self._health[1]
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.create_task(self._check_once(timeout))
        return await asyncio.shield(self._health_task)

    async def _check_once(self, timeout: float) -> str | None:
        problem: str | None
        if self.config.approle and not self._logged_in:
            problem = "not logged in to Vault (AppRole login pending or failing)"
        else:
            loop = asyncio.get_running_loop()
            client = self._client
            try:
                async with asyncio.timeout(timeout):
                    await loop.run_in_executor(self._pool, client.auth.token.lookup_self)
                problem = None
            except TimeoutError:
                problem = f"Vault did not answer a token lookup within {timeout:g}s"
            except Exception as e:
                problem = _classify(e).detail
        self._health = (time.monotonic(), problem)
        return problem

    # ----------------------------------------------------------------------------- auth

    async def start(self) -> None:
        """Log in (AppRole) and start the token-renewal task.

        With token auth nothing blocks: the renewal task checks the token in the background.
        Raises SecretError if the AppRole login fails; the broker stays usable and retries the
        login on the next `get()`.
        """
        if self._renew_task is None:
            self._renew_task = asyncio.create_task(self._renew_loop(), name="sandgate-vault-renew")
        if self._lease_task is None:
            self._lease_task = asyncio.create_task(self._lease_loop(), name="sandgate-leases")
        if self.config.approle:
            try:
                await self._login()
            except _VaultFailure as f:
                raise SecretError("", f"cannot log in to Vault with AppRole: {f.detail}") from None

    async def _login(self) -> None:
        """AppRole login, single flight."""
        if self._login_task is None or self._login_task.done():
            self._login_task = asyncio.create_task(self._do_login())
        await asyncio.shield(self._login_task)

    async def _do_login(self) -> None:
        role_id, secret_id = self.config.role_id, self.config.secret_id
        fresh = self._new_client("")

        def login() -> Any:
            try:
                return fresh.auth.approle.login(role_id=role_id, secret_id=secret_id,
                                                use_token=False)
            finally:
                fresh.adapter.close()

        try:
            resp = await self._call(login)
        except _VaultFailure as f:
            if f.kind in ("denied", "other") and "HTTP 4" in f.detail:
                f = _VaultFailure("denied", "Vault rejected the AppRole login (invalid or "
                                  "expired role_id / secret_id)")
            log.warning("AppRole login to Vault at %s failed: %s", self.config.addr, f.detail)
            raise f from None
        auth = (resp or {}).get("auth") or {}
        token = auth.get("client_token")
        if not isinstance(token, str) or not token:
            raise _VaultFailure("other", "AppRole login returned no token")
        self._client.token = token
        self._logged_in = True
        self.logins += 1
        log.info("logged in to Vault at %s with AppRole (token ttl %ss, renewable %s)",
                 self.config.addr, auth.get("lease_duration"), auth.get("renewable"))

    async def _renew_loop(self) -> None:
        while not self._closed:
            try:
                delay = await self._renew_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the task die
                log.warning("Vault token check failed unexpectedly (%s)", type(e).__name__)
                delay = self.renew_interval
            if self._closed:
                return
            await asyncio.sleep(delay)

    async def _lease_loop(self) -> None:
        while not self._closed:
            try:
                await self.leases.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the task die
                log.exception("sandgate: lease step failed")
            await asyncio.sleep(self.lease_tick)

    async def end_sandbox(self, sandbox: str, why: str) -> dict[str, int]:
        """A sandbox ended: revoke its leases (retried when Vault is down) and forget its
        per-sandbox KV values."""
        return await self.leases.end_sandbox(sandbox, why)

    def _forget_sandbox(self, sandbox: str) -> None:
        """Its per-sandbox KV values leave the cache (and the scrubbing set): a fleet running
        for months must not keep every sandbox it ever served. Back, it reads them again."""
        self.github.end_sandbox(sandbox)  # revoked with GitHub, in the background
        gone = [k for k, e in self._cache.items() if e.scope.sandbox == sandbox]
        for k in gone:
            self._retire(self._cache.pop(k))
        if gone:
            self._kv_generation += 1

    async def _relogin(self) -> float:
        """AppRole login from the renewal task; returns the delay before the next check."""
        try:
            await self._login()
        except _VaultFailure:
            return min(self.renew_interval, 5.0)  # logged by _do_login; retry soon
        return 1.0  # check the new token soon

    async def _renew_once(self) -> float:
        """Check the token; renew or re-login when needed. Returns seconds until next check."""
        if not self._logged_in:
            if self.config.approle:
                try:
                    await self._login()
                except _VaultFailure:
                    return min(self.renew_interval, 5.0)
            else:
                return self.renew_interval
        try:
            info = await self._call(lambda: self._client.auth.token.lookup_self())
        except _VaultFailure as f:
            if f.kind == "denied":
                if self.config.approle:
                    log.warning("Vault token no longer valid; logging in again with AppRole")
                    return await self._relogin()
                log.warning("Vault token is expired or revoked (%s); requests needing secrets "
                            "will be refused until VAULT_TOKEN is replaced", f.detail)
            else:
                log.warning("cannot check the Vault token: %s", f.detail)
            return min(self.renew_interval, 5.0) if f.kind != "denied" else self.renew_interval
        data = (info or {}).get("data") or {}
        ttl = int(data.get("ttl") or 0)
        creation_ttl = int(data.get("creation_ttl") or ttl)
        renewable = bool(data.get("renewable"))
        if ttl <= 0:  # a token that does not expire (e.g. root)
            return self.renew_interval
        if renewable and ttl < creation_ttl / 2:
            try:
                resp = await self._call(lambda: self._client.auth.token.renew_self())
                new_ttl = int(((resp or {}).get("auth") or {}).get("lease_duration") or 0)
                log.info("renewed the Vault token (ttl now %ss)", new_ttl)
                ttl = new_ttl or ttl
                if self.config.approle and ttl < max(creation_ttl / 4, 2.0):
                    # capped by the token's max TTL: renewing no longer helps, log in afresh
                    log.info("Vault token near its max TTL; logging in again with AppRole")
                    return await self._relogin()
            except _VaultFailure as f:
                log.warning("renewing the Vault token failed: %s", f.detail)
                if self.config.approle:
                    return await self._relogin()
        elif not renewable and self.config.approle and ttl < max(creation_ttl / 4, 2.0):
            log.info("Vault token near expiry (%ss left); logging in again with AppRole", ttl)
            return await self._relogin()
        elif not renewable and ttl < self.renew_interval:
            log.warning("Vault token expires in %ss and cannot be renewed", ttl)
        return max(0.5, min(self.renew_interval, ttl / 3))

    # ----------------------------------------------------------------------------- secrets

    def trust_upstream_cas(self, ca_file: str | None) -> None:
        """The CAs the token endpoints (OAuth2, GitHub) are verified against: the system roots,
        or `ca_file` (--upstream-ca's bundle); one context for both."""
        self.oauth2.use_ca_file(ca_file)
        self.github.ssl_ctx = self.oauth2.ssl_ctx

    def update_secrets(self, secrets: Mapping[str, SecretRef]) -> None:
        """Adopt a reloaded policy's secrets; forget cached values whose location changed."""
        new = dict(secrets)
        for ck in list(self._cache):
            ref = new.get(ck[0])
            if ref is None or ref.dynamic is not None or _ref_key(ref) != self._cache[ck].key:
                self._retire(self._cache.pop(ck))
                self._kv_generation += 1
        self._refs = new

    def _retire(self, entry: _Entry) -> None:
        """A value leaves the cache: it stays scrubbed and detected for the retired window
        (a flow it was injected into keeps it anyway, see sandgate.scrub.flowsecrets)."""
        self.retired.add(entry.value.name, entry.value.value)
        for _, part in entry.value.extra:  # an aws secret's session token goes with its key
            self.retired.add(entry.value.name, part)

    def cached_values(self) -> dict[str, str]:
        """name -> value of every cached value shared by all callers (no per-identity or
        per-sandbox path), expired ones included (no I/O). `cached_pairs` has them all."""
        return {ck[0]: e.value.value for ck, e in self._cache.items() if e.scope == GLOBAL}

    def cached_pairs(self) -> list[tuple[str, str | bytes]]:
        """(name, value) of every value held, of every sandbox: KV entries (expired ones
        included: never served, but still real credentials until replaced or dropped), leases,
        and the retired values (rotated, forgotten, revoked: `sandgate.secrets.retired`), the
        parts of a multi-part credential (an aws secret's session token), minted tokens and
        the client records and private keys they are minted with. For response scrubbing and
        exfiltration checks."""
        pairs: list[tuple[str, str | bytes]] = [
            (ck[0], e.value.value) for ck, e in self._cache.items()]
        pairs += [(ck[0], v) for ck, e in self._cache.items() for _, v in e.value.extra]
        pairs += [(name, value) for _, name, value, _ in self.leases.values()]
        pairs += self.retired.pairs()
        pairs += self.oauth2.values()
        pairs += self.github.values()
        return pairs

    def value_views(self) -> list[dict[str, str]]:
        """The values one caller may be given together, per scope held: name -> value, plus
        "name.username" for dynamic secrets. Sandgate's own encodings (a Basic pair) are built
        from these (`sandgate.inject.own_forms`)."""
        held: list[tuple[Scope, str, str]] = [
            (e.scope, ck[0], e.value.value) for ck, e in self._cache.items()]
        for scope, name, value, username in self.leases.values():
            held.append((scope, name, value))
            if username is not None:
                held.append((scope, f"{name}.username", username))
        scopes = {GLOBAL} | {scope for scope, _, _ in held}
        views: list[dict[str, str]] = []
        for view_scope in sorted(scopes, key=lambda x: (x.identity or "", x.sandbox or "")):
            views.append({name: value for scope, name, value in held
                          if view_scope.covers(scope)})
        return views

    async def get(self, name: str, caller: Caller | None = None,
                  dial: Dial | None = None, narrow: GitHubScope | None = None) -> SecretValue:
        """The value of secret `name` for `caller` (None: a caller with neither identity nor
        sandbox, enough for shared secrets). Raises SecretError, or SandboxRequired when the
        secret is per sandbox and the caller has no (usable) sandbox id. An oauth2 secret needs
        `dial`: how this caller may reach the token endpoint; a github_app secret is minted
        with the allowing rule's restrictions, `narrow`."""
        ref = self._refs.get(name)
        if ref is None:
            raise SecretError(name, f"secret '{name}' is not defined in the policy")
        if ref.oauth2 is not None:
            if dial is None:
                raise SecretError(name, f"secret '{name}' unavailable: its token endpoint "
                                  "cannot be reached from here")
            tok = await self.oauth2.get(ref, dial)
            return SecretValue(name=name, value=tok.value, version=tok.version, note=tok.note)
        if ref.github_app is not None:
            if dial is None:
                raise SecretError(name, f"secret '{name}' unavailable: GitHub cannot be "
                                  "reached from here")
            sandbox = caller.sandbox if caller is not None else None
            if sandbox is not None and caller is not None and caller.source == "token":
                self.leases.note_token(sandbox, caller.expires)  # its tokens end with it
            m = await self.github.get(ref, sandbox, narrow, dial)
            return SecretValue(name=name, value=m.value, version=m.version, note=m.note)
        identity = caller.identity if caller is not None else None
        sandbox = caller.sandbox if caller is not None else None
        path = resolve_path(ref, identity, sandbox)
        scope = scope_of(ref, identity, sandbox)
        expires = caller.expires if caller is not None and caller.source == "token" else None
        if ref.dynamic is not None:
            lease = await self.leases.get(ref, path, scope, expires)
            return SecretValue(name=name, value=lease.value, username=lease.username,
                               lease_id=lease.lease_id)
        if scope.sandbox is not None:  # its values go when the sandbox ends (token expiry)
            self.leases.note_token(scope.sandbox, expires)
        key = _ref_key(ref, path)
        entry = self._cache.get((name, key))
        if entry is not None and entry.key == _ref_key(ref) and self._clock() < entry.expires:
            if self.observer is not None:
                self.observer.secret_cache(name, True)
            return entry.value
        if self.observer is not None:
            self.observer.secret_cache(name, False)
        flight_key = (name, key)
        task = self._inflight.get(flight_key)
        if task is None:
            task = asyncio.create_task(self._fetch(ref, path, scope),
                                       name=f"sandgate-vault-read-{name}")
            self._inflight[flight_key] = task

            def done(t: asyncio.Task[SecretValue], k: Any = flight_key) -> None:
                if self._inflight.get(k) is t:
                    del self._inflight[k]
                if not t.cancelled():
                    t.exception()  # mark retrieved even if every waiter was cancelled

            task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _fetch(self, ref: SecretRef, path: str, scope: Scope) -> SecretValue:
        name, where = ref.name, _where(ref, path)
        resolved = dataclasses.replace(ref, path=path)  # the location read for this caller
        try:
            if not self._logged_in:
                await self._login()
            try:
                raw = await self._read(resolved)
            except _VaultFailure as f:
                if f.kind != "denied" or not self.config.approle:
                    raise
                log.info("Vault denied reading secret '%s'; logging in again with AppRole", name)
                await self._login()
                raw = await self._read(resolved)
        except _VaultFailure as f:
            self._observe_fetch(name, f.kind)
            if f.kind == "notfound":
                msg = f"secret '{name}' unavailable: path {where} not found in Vault"
            elif f.kind == "denied":
                msg = f"secret '{name}' unavailable: {f.detail} (reading {where})"
            else:
                msg = f"secret '{name}' unavailable: {f.detail}"
            log.warning("%s [vault %s]", msg, self.config.addr)
            raise SecretError(name, msg) from None

        data, version = raw
        if not isinstance(data, Mapping) or ref.field not in data:
            msg = f"secret '{name}' unavailable: field '{ref.field}' missing in {where}"
            log.warning("%s", msg)
            self._observe_fetch(name, "notfound")
            raise SecretError(name, msg)
        try:
            value = check_value(name, data[ref.field])
        except SecretError as e:
            log.warning("%s (at %s, field '%s')", e, where, ref.field)
            self._observe_fetch(name, "invalid")
            raise
        self._observe_fetch(name, "ok")
        sv = SecretValue(name=name, value=value, version=version)
        if ref.aws is not None:  # the key id signs in the clear; the session token is secret
            akid, tok = data.get("access_key_id"), data.get("session_token")
            sv = dataclasses.replace(
                sv, username=check_value(name, akid) if akid is not None else None,
                extra=(("session_token", check_value(name, tok)),) if tok is not None else ())
        current = self._refs.get(name)
        if current is not None and _ref_key(current) == _ref_key(ref):
            ck = (name, _ref_key(ref, path))
            old = self._cache.get(ck)
            self._cache[ck] = _Entry(_ref_key(ref), sv, self._clock() + self.ttl, scope)
            if old is None or old.value.value != value:
                self._kv_generation += 1
            if old is not None and old.value.value != value:
                self._retire(old)  # rotated in Vault: the old value may still be in flight
        else:  # a reload moved the secret while it was read: handed out once, never cached
            self._retire(_Entry(_ref_key(ref), sv, 0.0, scope))
        log.debug("fetched secret '%s' from %s (version %s)", name, where, version)
        return sv

    def _observe_fetch(self, name: str, outcome: str) -> None:
        if self.observer is not None:
            try:
                self.observer.secret_fetch(name, outcome)
            except Exception:
                log.exception("secret broker observer failed")

    async def _read_record(self, ref: SecretRef) -> tuple[Any, int | None]:
        """An oauth2 secret's client record (KV v2), errors as SecretError."""
        try:
            if not self._logged_in:
                await self._login()
            return await self._read(ref)
        except _VaultFailure as f:
            self._observe_fetch(ref.name, f.kind)
            msg = f"secret '{ref.name}' unavailable: {f.detail} (reading {_where(ref)})"
            log.warning("%s [vault %s]", msg, self.config.addr)
            raise SecretError(ref.name, msg) from None

    async def _write_record(self, ref: SecretRef, data: dict[str, Any], version: int) -> None:
        """Write an oauth2 client record back, only over `version` (KV v2 check-and-set)."""
        client = self._client
        try:
            await self._call(lambda: client.secrets.kv.v2.create_or_update_secret(
                path=ref.path, secret=data, cas=version, mount_point=ref.mount))
        except _VaultFailure as f:
            raise SecretError(ref.name, f"writing {_where(ref)} failed: {f.kind}") from None

    async def _read(self, ref: SecretRef) -> tuple[Any, int | None]:
        """One read at `ref`'s (resolved) location."""
        path = ref.path
        client = self._client
        self.vault_reads += 1
        if ref.kv_version == 2:
            resp = await self._call(lambda: client.secrets.kv.v2.read_secret_version(
                path=path, mount_point=ref.mount, raise_on_deleted_version=True))
            body = (resp or {}).get("data") or {}
            meta = body.get("metadata") or {}
            version = meta.get("version")
            return body.get("data"), version if isinstance(version, int) else None
        resp = await self._call(lambda: client.secrets.kv.v1.read_secret(
            path=path, mount_point=ref.mount))
        return (resp or {}).get("data"), None

    # ----------------------------------------------------------------------------- shutdown

    async def aclose(self, revoke_timeout: float = 10.0) -> None:
        """Revoke every lease still held (once each, within `revoke_timeout`: what cannot be
        revoked is logged and audited and runs out on its own), then stop."""
        if self._closed:
            return
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
        try:
            await self.leases.shutdown(revoke_timeout)
        except Exception:
            log.exception("sandgate: revoking leases at shutdown failed")
        try:
            await asyncio.wait_for(self.github.aclose(), revoke_timeout)
        except Exception:
            log.exception("sandgate: revoking installation tokens at shutdown failed")
        self._closed = True
        tasks = [t for t in (self._renew_task, self._login_task, self._health_task,
                             *self._inflight.values())
                 if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.adapter.close()
        self._cache.clear()
        self._kv_generation += 1


class _HvacLeases:
    """The broker's hvac client as a LeaseBackend: generic read (any engine answering with a
    lease), `sys.renew_lease`, `sys.revoke_lease`; each through the pool, with the deadline and
    the message-safe failures of `SecretBroker._call`."""

    def __init__(self, broker: SecretBroker) -> None:
        self.broker = broker

    async def _ready(self) -> hvac.Client:
        if not self.broker._logged_in:
            await self.broker._login()
        return self.broker._client

    async def mint(self, path: str) -> Mapping[str, Any]:
        client = await self._ready()
        self.broker.vault_reads += 1
        resp = await self.broker._call(lambda: client.read(path))
        if not isinstance(resp, Mapping):
            raise _VaultFailure("notfound", f"nothing at {path} (HTTP 404 or empty answer)")
        return resp

    async def renew(self, lease_id: str, increment: int) -> Mapping[str, Any]:
        client = await self._ready()
        resp = await self.broker._call(
            lambda: client.sys.renew_lease(lease_id=lease_id, increment=increment))
        return resp if isinstance(resp, Mapping) else {}

    async def revoke(self, lease_id: str) -> None:
        client = await self._ready()
        await self.broker._call(lambda: client.sys.revoke_lease(lease_id=lease_id))
