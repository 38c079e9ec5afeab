"""One dynamic-secret lease per (secret, identity, sandbox) for the whole fleet.

Without it every replica (and worker) that serves a sandbox mints its own lease. With
`--state` and `--state-lease-kv MOUNT/PREFIX`, the first process to need the lease takes a lock
in Redis (`SET NX`, expiring), mints it in Vault, and relays it to the others **through Vault**:
the value goes to a KV v2 entry under MOUNT/PREFIX (Vault's own access control and audit), and
Redis keeps only the lease id, its expiry and that entry's path. Another process that needs it
waits for the record (it polls while the lock is held, up to `WAIT` seconds), reads the value
from the KV entry and uses the same lease. Renewals (by any holder) move the expiry in Redis.

Revocation happens once for the fleet: the first process to revoke a lease id takes
`revoked:<lease id>` (`SET NX`) and revokes it in Vault, deletes the KV entry and the record;
every other holder drops its copy without calling Vault. A process that shuts down (a rolling
update) leaves shared leases to the fleet: they end with their sandbox (any replica), with the
last token (any replica) or at their TTL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from redis.exceptions import RedisError

from sandgate.errors import StateUnavailable
from sandgate.state import StateConfig

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from sandgate.secrets.scope import Scope

WAIT = 15.0  # seconds a process waits for another one's mint
LOCK_MS = 30_000  # a minting process that dies frees the lock after this


class KV(Protocol):
    """The Vault KV v2 calls the relay needs (the broker's client)."""

    async def put(self, path: str, data: Mapping[str, Any]) -> None: ...
    async def get(self, path: str) -> Mapping[str, Any] | None: ...
    async def delete(self, path: str) -> None: ...


class SharedLeases:
    def __init__(self, r: aioredis.Redis, cfg: StateConfig, kv: KV, prefix: str) -> None:
        self.r = r
        self.cfg = cfg
        self.kv = kv
        self.prefix = prefix.strip("/")  # KV path prefix under the mount

    def _id(self, name: str, path: str, scope: Scope) -> str:
        raw = json.dumps([name, path, scope.identity, scope.sandbox])
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    async def _redis(self, aw: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(aw, self.cfg.timeout)
        except (TimeoutError, RedisError, OSError):
            raise StateUnavailable(f"Sandgate's shared state ({self.cfg.url.redacted()}) did "
                                   "not answer: the fleet's lease cannot be had") from None

    async def mint(self, name: str, path: str, scope: Scope,
                   mint: Callable[[str], Awaitable[Mapping[str, Any]]]) -> Mapping[str, Any]:
        """The fleet's lease for (name, path, scope) as a Vault answer (lease_id,
        lease_duration: what is left, renewable, data): minted here, or the one another
        process minted. Raises StateUnavailable, or what `mint` raises."""
        lid = self._id(name, path, scope)
        record, lock = self.cfg.key("lease", lid), self.cfg.key("lease-lock", lid)
        deadline = time.monotonic() + WAIT
        while True:
            held = await self._shared(record)
            if held is not None:
                return {**held, "fleet": "shared"}
            if await self._redis(self.r.set(lock, "1", nx=True, px=LOCK_MS)):
                try:
                    return {**await self._mint_here(record, lid, path, mint), "fleet": "minted"}
                finally:
                    await self._redis(self.r.delete(lock))
            if time.monotonic() > deadline:
                raise StateUnavailable("another Sandgate process is minting this lease and "
                                       f"has not finished within {WAIT:g}s")
            await asyncio.sleep(0.1)

    async def _shared(self, record: str) -> Mapping[str, Any] | None:
        raw = await self._redis(self.r.get(record))
        if not raw:
            return None
        meta = json.loads(raw)
        left = float(meta["expires"]) - time.time()
        if left <= min(5.0, float(meta["ttl"]) / 10):
            return None  # about to run out: a fresh one is minted (the old one is revoked)
        data = await self.kv.get(meta["kv"])
        if data is None:
            return None
        return {"lease_id": meta["lease_id"], "lease_duration": left,
                "renewable": meta["renewable"], "data": dict(data)}

    async def _mint_here(self, record: str, lid: str, path: str,
                         mint: Callable[[str], Awaitable[Mapping[str, Any]]]
                         ) -> Mapping[str, Any]:
        resp = await mint(path)
        lease_id, ttl = resp.get("lease_id"), float(resp.get("lease_duration") or 0)
        data = resp.get("data")
        if not isinstance(lease_id, str) or ttl <= 0 or not isinstance(data, Mapping):
            return resp  # not a lease: the lease manager refuses it (and revokes it)
        kv_path = f"{self.prefix}/{lid}"
        await self.kv.put(kv_path, {k: v for k, v in data.items() if isinstance(v, str)})
        meta = {"lease_id": lease_id, "expires": time.time() + ttl, "ttl": ttl,
                "renewable": bool(resp.get("renewable")), "kv": kv_path}
        await self._redis(self.r.set(record, json.dumps(meta), px=int(ttl * 1000)))
        return resp

    async def renewed(self, name: str, path: str, scope: Scope, lease_id: str,
                      granted: float) -> None:
        """A holder renewed the lease: the record lives as long as the grant."""
        record = self.cfg.key("lease", self._id(name, path, scope))
        raw = await self._redis(self.r.get(record))
        if not raw:
            return
        meta = json.loads(raw)
        if meta.get("lease_id") != lease_id:
            return
        meta["expires"] = time.time() + granted
        await self._redis(self.r.set(record, json.dumps(meta), px=int(granted * 1000)))

    async def revoke(self, name: str, path: str, scope: Scope, lease_id: str,
                     revoke: Callable[[str], Awaitable[None]]) -> bool:
        """Revoke once for the fleet: True when this process revoked it in Vault, False when
        another one has (or is doing it). Raises what `revoke` raises (then retried)."""
        mark = self.cfg.key("revoked", lease_id)
        if not await self._redis(self.r.set(mark, "1", nx=True, ex=24 * 3600)):
            return False
        try:
            await revoke(lease_id)
        except BaseException:
            await self._redis(self.r.delete(mark))  # another attempt, here or elsewhere
            raise
        lid = self._id(name, path, scope)
        record = self.cfg.key("lease", lid)
        raw = await self._redis(self.r.get(record))
        if raw and json.loads(raw).get("lease_id") == lease_id:
            await self._redis(self.r.delete(record))
        await self.kv.delete(f"{self.prefix}/{lid}")
        return True


class BrokerKV:
    """`KV` on the secret broker's Vault client (its login, pool, deadline and safe errors):
    entries of the KV v2 engine mounted at `mount`."""

    def __init__(self, broker: Any, mount: str) -> None:
        self.broker = broker
        self.mount = mount

    async def _client(self) -> Any:
        if not self.broker._logged_in:
            await self.broker._login()
        return self.broker._client

    async def put(self, path: str, data: Mapping[str, Any]) -> None:
        c = await self._client()
        await self.broker._call(lambda: c.secrets.kv.v2.create_or_update_secret(
            path=path, secret=dict(data), mount_point=self.mount))

    async def get(self, path: str) -> Mapping[str, Any] | None:
        c = await self._client()

        def read() -> Any:
            import hvac.exceptions

            try:
                return c.secrets.kv.v2.read_secret_version(
                    path=path, mount_point=self.mount, raise_on_deleted_version=True)
            except hvac.exceptions.InvalidPath:
                return None

        resp = await self.broker._call(read)
        data = ((resp or {}).get("data") or {}).get("data")
        return data if isinstance(data, Mapping) else None

    async def delete(self, path: str) -> None:
        c = await self._client()
        await self.broker._call(lambda: c.secrets.kv.v2.delete_metadata_and_all_versions(
            path=path, mount_point=self.mount))
