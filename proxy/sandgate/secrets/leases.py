"""Dynamic secrets: credentials minted per sandbox with a lease, renewed, and revoked at its end.

A `dynamic:` secret (database/creds/ROLE, or any engine answering with a lease) is minted the
first time a sandbox needs it, cached for that sandbox for the lease's duration, renewed while
the sandbox lives (Vault caps renewals at the role's max_ttl; once capped the lease is left to
run out and the next request mints a fresh one), and revoked when the sandbox ends:

* `end_sandbox(id, why)`: the Docker event stream saw its container die, or a fleet controller
  called `DELETE /v1/sandboxes/{id}` on the admin API;
* token expiry: a sandbox known only by proxy tokens ends when the last token seen for it
  expires (`step` notices);
* shutdown: everything still held is revoked once; what could not be is logged and audited.

A revocation that fails (Vault down) is audited and retried with backoff until it succeeds or
until the lease has run out anyway (Vault then revokes it itself): a credential is never
forgotten while it may still be valid. Every event is audited with the secret's name, the
sandbox and the lease id, never the value.

Everything here runs on one event loop; the Vault calls go through a `LeaseBackend` (the
broker's hvac client in production, a fake in unit tests). Time comes from `clock` (monotonic,
for lease durations) and `wall` (epoch seconds, for token expiry), both injectable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandgate.errors import SecretError
from sandgate.policy.model import SecretRef
from sandgate.secrets.retired import Retired
from sandgate.secrets.scope import Scope
from sandgate.secrets.values import check_value

log = logging.getLogger("sandgate.leases")

# Backoff between attempts to revoke a lease (seconds); the last one repeats.
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)


class LeaseBackend(Protocol):
    """The Vault calls a lease needs. Failures raise an exception whose `detail` attribute (if
    any) is a message safe to log: never a response body."""

    async def mint(self, path: str) -> Mapping[str, Any]: ...
    async def renew(self, lease_id: str, increment: int) -> Mapping[str, Any]: ...
    async def revoke(self, lease_id: str) -> None: ...


def _detail(e: BaseException) -> str:
    detail = getattr(e, "detail", None)
    return detail if isinstance(detail, str) else type(e).__name__


@dataclass
class Lease:
    name: str  # the policy's secret name
    path: str  # the resolved engine path it was minted from
    scope: Scope
    lease_id: str
    value: str = field(repr=False)
    username: str | None = field(repr=False)
    ttl: float  # the grant asked for on renewal: the first lease duration
    renewable: bool
    expires: float  # clock() when the current grant ends
    capped: bool = False  # Vault granted less than asked: max_ttl reached, renew no more
    next_renew: float = 0.0  # clock() of the next renewal attempt after a failure

    @property
    def sandbox(self) -> str:
        assert self.scope.sandbox is not None
        return self.scope.sandbox


@dataclass
class _Revocation:
    lease: Lease
    why: str
    attempts: int = 0
    next_at: float = 0.0


_Key = tuple[str, str, Scope]  # (secret name, resolved path, whose)


class LeaseManager:
    def __init__(
        self,
        backend: LeaseBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        audit: Callable[..., None] | None = None,
        retry_delays: tuple[float, ...] = RETRY_DELAYS,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.wall = wall
        self.audit = audit
        self.retry_delays = retry_delays
        self.leases: dict[_Key, Lease] = {}  # (name, path, scope) -> lease
        self.pending: list[_Revocation] = []  # revocations that failed, to retry
        # replaced, revoked and run-out values: still scrubbed and detected for a window
        self.retired = Retired(lambda: self.clock())
        self.generation = 0  # bumps when the set of leases changes (retired: its own)
        self._inflight: dict[_Key, asyncio.Task[Lease]] = {}
        self._token_deadline: dict[str, float] = {}  # sandbox -> latest token expiry (wall)
        # sandbox -> how often it ended while a mint for it was in flight (such a mint is
        # revoked, not cached); entries go when its last mint finishes
        self._ended: dict[str, int] = {}
        # called with a sandbox id when it ends (the broker drops its per-sandbox KV values)
        self.on_sandbox_end: Callable[[str], None] | None = None
        # --state-lease-kv: one lease per (secret, identity, sandbox) for the fleet
        # (sandgate.state.fleet_leases.SharedLeases); None: this process's own leases
        self.shared: Any = None

    # ------------------------------------------------------------------------- audit

    def _emit(self, action: str, outcome: str, lease: Lease | None = None, **fields: Any) -> None:
        if lease is not None:
            fields = {"secret": lease.name, "identity": lease.scope.identity,
                      "sandbox": lease.scope.sandbox, "lease_id": lease.lease_id, **fields}
        if self.audit is not None:
            try:
                self.audit("lease", action=action, outcome=outcome, **fields)
            except Exception:
                log.exception("sandgate: audit of a lease event failed")

    # ------------------------------------------------------------------------- get

    def note_token(self, sandbox: str, token_expires: float | None) -> None:
        """A caller of `sandbox` presented a token expiring at `token_expires` (epoch): the
        sandbox ends when the last token seen for it expires."""
        if token_expires is not None:
            self._token_deadline[sandbox] = max(token_expires,
                                                self._token_deadline.get(sandbox, 0.0))

    def usable(self, lease: Lease) -> bool:
        """Still valid long enough to be sent: not within the last tenth (at most 5 s)."""
        return self.clock() < lease.expires - min(5.0, lease.ttl / 10)

    async def get(self, ref: SecretRef, path: str, scope: Scope,
                  token_expires: float | None = None) -> Lease:
        """The sandbox's lease for `ref` at `path`, minting one when there is none usable.
        `token_expires`: the caller's proxy token expiry (epoch), when it is known by token."""
        sandbox = scope.sandbox
        assert sandbox is not None and ref.dynamic is not None
        self.note_token(sandbox, token_expires)
        key = (ref.name, path, scope)
        lease = self.leases.get(key)
        if lease is not None and self.usable(lease):
            return lease
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._mint(ref, path, scope, key),
                                       name=f"sandgate-lease-{ref.name}")
            self._inflight[key] = task

            def done(t: asyncio.Task[Lease], k: _Key = key) -> None:
                if self._inflight.get(k) is t:
                    del self._inflight[k]
                if not t.cancelled():
                    t.exception()

            task.add_done_callback(done)
        return await asyncio.shield(task)

    async def _mint(self, ref: SecretRef, path: str, scope: Scope, key: _Key) -> Lease:
        sandbox = scope.sandbox
        assert sandbox is not None
        epoch = self._ended.get(sandbox, 0)
        try:
            return await self._mint_once(ref, path, scope, key, epoch)
        finally:
            if not any(k != key and k[2].sandbox == sandbox for k in self._inflight):
                self._ended.pop(sandbox, None)

    async def _mint_once(self, ref: SecretRef, path: str, scope: Scope, key: _Key,
                         epoch: int) -> Lease:
        assert ref.dynamic is not None and scope.sandbox is not None
        name, sandbox = ref.name, scope.sandbox
        try:
            resp = await (self.backend.mint(path) if self.shared is None else
                          self.shared.mint(name, path, scope, self.backend.mint))
        except Exception as e:
            detail = _detail(e)
            self._emit("mint", "failed", secret=name, identity=scope.identity,
                       sandbox=sandbox, error=detail)
            raise SecretError(name, f"secret '{name}' unavailable: {detail} (minting at "
                              f"{path})") from None
        try:
            lease = self._lease_from(ref, path, scope, resp)
        except SecretError:
            lease_id = resp.get("lease_id") if isinstance(resp, Mapping) else None
            if isinstance(lease_id, str) and lease_id:  # minted but unusable: do not leave it
                try:
                    await self.backend.revoke(lease_id)
                except Exception as e:
                    log.warning("sandgate: revoking unusable lease %s failed: %s", lease_id,
                                _detail(e))
            raise
        if self._ended.get(sandbox, 0) != epoch:
            # the sandbox ended while this was being minted: it must not outlive it
            await self._revoke(lease, "sandbox ended while minting")
            raise SecretError(name, f"secret '{name}' unavailable: the sandbox has ended")
        old = self.leases.get(key)
        self.leases[key] = lease
        self.generation += 1
        fleet = resp.get("fleet") if self.shared is not None else None  # minted or shared
        self._emit("mint", "ok", lease, ttl=int(lease.ttl), renewable=lease.renewable,
                   **({"fleet": fleet} if isinstance(fleet, str) else {}))
        if old is not None:  # run out or about to: revoke it rather than leave it valid
            self.leases_retire(old)
            await self._revoke(old, "replaced by a fresh lease")
        return lease

    def _lease_from(self, ref: SecretRef, path: str, scope: Scope,
                    resp: Mapping[str, Any]) -> Lease:
        assert ref.dynamic is not None
        name = ref.name
        data = resp.get("data") if isinstance(resp, Mapping) else None
        lease_id = resp.get("lease_id") if isinstance(resp, Mapping) else None
        if not isinstance(data, Mapping) or ref.dynamic.field not in data:
            raise SecretError(name, f"secret '{name}' unavailable: field "
                              f"'{ref.dynamic.field}' missing in the answer from {path}")
        if not isinstance(lease_id, str) or not lease_id:
            raise SecretError(name, f"secret '{name}' unavailable: {path} answered without a "
                              "lease (not a dynamic secrets engine?)")

        value = check_value(name, data[ref.dynamic.field])
        username = None
        if ref.dynamic.username_field is not None:
            if ref.dynamic.username_field not in data:
                raise SecretError(name, f"secret '{name}' unavailable: field "
                                  f"'{ref.dynamic.username_field}' missing in the answer "
                                  f"from {path}")
            username = check_value(f"{name}.username", data[ref.dynamic.username_field])
        ttl = float(resp.get("lease_duration") or 0)
        if ttl <= 0:
            raise SecretError(name, f"secret '{name}' unavailable: {path} answered with a "
                              "lease of no duration")
        return Lease(name=name, path=path, scope=scope, lease_id=lease_id, value=value,
                     username=username, ttl=ttl, renewable=bool(resp.get("renewable")),
                     expires=self.clock() + ttl)

    def leases_retire(self, lease: Lease) -> None:
        """Kept scrubbed for the retired window, or until the lease's end if later (a failed
        revocation leaves it valid that long)."""
        self.retired.add(lease.name, lease.value, lease.expires)

    # ------------------------------------------------------------------------- values

    def values(self) -> list[tuple[Scope, str, str, str | None]]:
        """(scope, name, value, username) of every lease held."""
        return [(x.scope, x.name, x.value, x.username) for x in self.leases.values()]

    # ------------------------------------------------------------------------- the tick

    async def step(self) -> None:
        """Everything that is due: renewals, sandboxes whose tokens expired, revocation
        retries, leases that ran out. Called about every half second by the broker."""
        now_wall = self.wall()
        for sandbox, deadline in list(self._token_deadline.items()):
            if now_wall >= deadline:
                del self._token_deadline[sandbox]
                await self.end_sandbox(sandbox, "token_expired")
        for key, lease in list(self.leases.items()):
            now = self.clock()
            if now >= lease.expires:  # ran out: Vault has revoked it
                del self.leases[key]
                self.generation += 1
                self.leases_retire(lease)
                self._emit("expire", "ok", lease)
            elif (lease.renewable and not lease.capped and now >= lease.next_renew
                  and lease.expires - now < lease.ttl / 2):
                await self._renew(lease)
        await self._retry()

    async def _renew(self, lease: Lease) -> None:
        increment = max(1, int(lease.ttl))
        try:
            resp = await self.backend.renew(lease.lease_id, increment)
        except Exception as e:
            lease.next_renew = self.clock() + 1.0
            self._emit("renew", "failed", lease, error=_detail(e))
            return
        granted = float(resp.get("lease_duration") or 0) if isinstance(resp, Mapping) else 0.0
        if granted <= 0:
            lease.capped = True
            self._emit("renew", "failed", lease, error="no duration granted")
            return
        lease.expires = self.clock() + granted
        lease.capped = granted < increment  # max_ttl: renewing again gains nothing
        if self.shared is not None:
            try:
                await self.shared.renewed(lease.name, lease.path, lease.scope, lease.lease_id,
                                          granted)
            except Exception as e:  # the others see the old expiry: they mint afresh later
                log.warning("sandgate: recording a lease renewal for the fleet failed: %s",
                            _detail(e))
        self._emit("renew", "ok", lease, ttl=int(granted), capped=lease.capped)

    # ------------------------------------------------------------------------- revocation

    async def end_sandbox(self, sandbox: str, why: str) -> dict[str, int]:
        """Revoke every lease of `sandbox` now; failed ones are retried. Returns counts."""
        if any(k[2].sandbox == sandbox for k in self._inflight):
            self._ended[sandbox] = self._ended.get(sandbox, 0) + 1
        self._token_deadline.pop(sandbox, None)
        if self.on_sandbox_end is not None:
            try:
                self.on_sandbox_end(sandbox)
            except Exception:
                log.exception("sandgate: sandbox end callback failed")
        mine = [(k, x) for k, x in self.leases.items() if k[2].sandbox == sandbox]
        for k, _ in mine:
            del self.leases[k]
        if mine:
            self.generation += 1
        revoked = failed = 0
        for _, lease in mine:
            self.leases_retire(lease)
            if await self._revoke(lease, why):
                revoked += 1
            else:
                failed += 1
        self._emit("sandbox_end", "ok" if not failed else "pending", sandbox=sandbox,
                   reason=why, revoked=revoked, pending=failed)
        return {"revoked": revoked, "pending": failed}

    async def _revoke(self, lease: Lease, why: str, item: _Revocation | None = None) -> bool:
        """One attempt; on failure the lease is (re)queued for a retry. True when revoked."""
        attempt = (item.attempts if item is not None else 0) + 1
        here = True
        try:
            if self.shared is None:
                await self.backend.revoke(lease.lease_id)
            else:  # once for the fleet: another holder may have revoked it already
                here = await self.shared.revoke(lease.name, lease.path, lease.scope,
                                                lease.lease_id, self.backend.revoke)
        except Exception as e:
            if item is None:
                item = _Revocation(lease, why)
                self.pending.append(item)
            item.attempts = attempt
            delay = self.retry_delays[min(attempt - 1, len(self.retry_delays) - 1)]
            item.next_at = self.clock() + delay
            self._emit("revoke", "failed", lease, reason=why, attempt=attempt,
                       retry_in=delay, error=_detail(e))
            log.warning("sandgate: revoking lease %s of secret '%s' (sandbox %s) failed: %s; "
                        "retrying in %gs", lease.lease_id, lease.name, lease.sandbox,
                        _detail(e), delay)
            return False
        if item is not None and item in self.pending:
            self.pending.remove(item)
        self._emit("revoke", "ok", lease, reason=why, attempt=attempt,
                   **({} if self.shared is None else {"fleet": "here" if here else "elsewhere"}))
        return True

    async def _retry(self) -> None:
        now = self.clock()
        for item in list(self.pending):
            if now >= item.lease.expires:
                # Vault revoked it itself when it ran out: nothing left to do
                self.pending.remove(item)
                self._emit("revoke", "expired", item.lease, reason=item.why,
                           attempt=item.attempts)
            elif now >= item.next_at:
                await self._revoke(item.lease, item.why, item)

    async def shutdown(self, timeout: float = 10.0) -> list[Lease]:
        """Revoke everything held or pending, once each, within `timeout`. Returns (and logs,
        and audits) the leases that could not be revoked: they run out on their own."""
        todo = [(x, "shutdown") for x in self.leases.values()]
        if self.shared is not None:  # the fleet's leases outlive this process (docs)
            for x, _ in todo:
                self._emit("revoke", "left_to_fleet", x, reason="shutdown")
            todo = []
        todo += [(item.lease, item.why) for item in self.pending]
        self.leases.clear()
        self.pending.clear()
        self._token_deadline.clear()
        revoked: set[str] = set()
        failed: set[str] = set()

        async def one(lease: Lease, why: str) -> None:
            try:
                await self.backend.revoke(lease.lease_id)
            except Exception as e:
                failed.add(lease.lease_id)
                self._emit("revoke", "abandoned", lease, reason=why, error=_detail(e))
                return
            revoked.add(lease.lease_id)
            self._emit("revoke", "ok", lease, reason=why)

        if todo:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.gather(*(one(x, why) for x, why in todo))
            except TimeoutError:
                log.error("sandgate: revoking leases at shutdown took over %gs", timeout)
        left = [x for x, _ in todo if x.lease_id not in revoked]
        for lease in left:
            if lease.lease_id not in failed:
                self._emit("revoke", "abandoned", lease, reason="shutdown",
                           error="no answer before the shutdown deadline")
            log.error("sandgate: at shutdown, lease %s of secret '%s' (sandbox %s) could not be "
                      "revoked; it stays valid until it runs out (revoke it with "
                      "`bao lease revoke %s`)", lease.lease_id, lease.name, lease.sandbox,
                      lease.lease_id)
        return left
