"""The `ApprovalStore` over Redis, shared by every replica (and worker) that points at it.

Keys (under `PREFIX`, default "sandgate"):

    {p}:approval:{id}       hash: doc (the approval as JSON), state; expires a day after the
                            approval does
    {p}:approvals:pending   sorted set of pending ids by creation time (the listing)
    {p}:approval-fp:{fp}    the newest approval id of an identical request (mode async)
    {p}:grant:{key}         hash: doc (a remembered grant); expires with the grant; the key
                            is identity|rule|sandbox (or *)|headers sha256
    {p}:approvals:changes   pub/sub channel: each created or changed approval, as JSON

A change is read-modify-write under WATCH (optimistic, retried), so two approvers deciding at
once on different replicas cannot lose a vote; then it is published, so the replica holding the
request wakes at once.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.asyncio import Redis
from redis.exceptions import WatchError

from sandgate.approvals.store import KEEP_DECIDED, Change, Subscription
from sandgate.approvals.votes import Approval, Grant, grant_key

MAX_RETRIES = 50


class RedisStore:
    def __init__(self, redis: Redis, prefix: str = "sandgate",
                 clock: Callable[[], float] | None = None, owned: bool = False) -> None:
        import time

        self.r = redis
        self.p = prefix
        self.owned = owned  # close the client with the store (else it is shared: left open)
        self._clock = clock or time.time

    def _a(self, approval_id: str) -> str:
        return f"{self.p}:approval:{approval_id}"

    @property
    def _pending(self) -> str:
        return f"{self.p}:approvals:pending"

    @property
    def channel(self) -> str:
        return f"{self.p}:approvals:changes"

    def _fp(self, fp: str) -> str:
        return f"{self.p}:approval-fp:{fp}"

    def _g(self, key: str) -> str:
        return f"{self.p}:grant:{key}"

    @staticmethod
    def _doc(a: Approval) -> str:
        return json.dumps(a.as_dict(), separators=(",", ":"))

    async def create(self, a: Approval) -> None:
        doc = self._doc(a)
        keep_until = int(a.expires + KEEP_DECIDED)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(self._a(a.id), mapping={"doc": doc, "state": a.state})
            pipe.expireat(self._a(a.id), keep_until)
            pipe.zadd(self._pending, {a.id: a.created})
            pipe.set(self._fp(a.fingerprint), a.id, exat=keep_until)
            pipe.publish(self.channel, doc)
            await pipe.execute()

    async def get(self, approval_id: str) -> Approval | None:
        raw = await cast(Awaitable[Any], self.r.hget(self._a(approval_id), "doc"))
        return Approval.from_dict(json.loads(raw)) if raw else None

    async def pending(self) -> list[Approval]:
        now = self._clock()
        ids = [i.decode() if isinstance(i, bytes) else str(i)
               for i in await self.r.zrange(self._pending, 0, -1)]
        out: list[Approval] = []
        stale: list[str] = []
        async with self.r.pipeline(transaction=False) as pipe:  # one round trip for all
            for i in ids:
                pipe.hget(self._a(i), "doc")
            docs = await pipe.execute()
        for i, raw in zip(ids, docs, strict=True):
            a = Approval.from_dict(json.loads(raw)) if raw else None
            if a is None or a.state != "pending":
                stale.append(i)
            elif a.expires > now:
                out.append(a)
        if stale:
            await self.r.zrem(self._pending, *stale)
        return out

    async def update(self, approval_id: str, change: Change) -> Approval | None:
        key = self._a(approval_id)
        for _ in range(MAX_RETRIES):
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await cast(Awaitable[Any], pipe.hget(key, "doc"))
                    if not raw:
                        return None
                    a = Approval.from_dict(json.loads(raw))
                    new = change(a)  # may raise: the transaction is dropped
                    if new == a:
                        return a
                    doc = self._doc(new)
                    pipe.multi()
                    pipe.hset(key, mapping={"doc": doc, "state": new.state})
                    if new.state != "pending":
                        pipe.zrem(self._pending, approval_id)
                    pipe.publish(self.channel, doc)
                    await pipe.execute()
                    return new
                except WatchError:
                    continue
        raise RuntimeError(f"approval {approval_id}: too many concurrent changes")

    async def find(self, fingerprint: str) -> Approval | None:
        raw = await self.r.get(self._fp(fingerprint))
        if not raw:
            return None
        return await self.get(raw.decode() if isinstance(raw, bytes) else str(raw))

    async def add_grant(self, g: Grant) -> None:
        key = self._g(g.key)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"doc": json.dumps(g.as_dict())})
            pipe.pexpireat(key, int(g.expires * 1000))
            await pipe.execute()

    async def grant(self, rule: str, identity: str, sandbox: str | None,
                    headers_sha256: str, now: float) -> Grant | None:
        for sb in ((sandbox, None) if sandbox is not None else (None,)):
            key = self._g(grant_key(rule, identity, sb, headers_sha256))
            raw = await cast(Awaitable[Any], self.r.hget(key, "doc"))
            if raw:
                g = Grant.from_dict(json.loads(raw))
                if g.expires > now:
                    return g
        return None

    async def subscribe(self) -> Subscription:
        ps = self.r.pubsub()
        await ps.subscribe(self.channel)

        async def get() -> Approval:
            while True:
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=None)
                if msg is not None and msg.get("type") == "message":
                    return Approval.from_dict(json.loads(msg["data"]))

        async def close() -> None:
            await ps.unsubscribe(self.channel)
            await ps.aclose()

        return Subscription(get, close)

    async def aclose(self) -> None:
        if self.owned:
            await self.r.aclose()
