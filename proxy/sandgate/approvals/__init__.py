"""`action: ask`: requests held for people to approve (docs/approvals.md).

    votes.py        Approval, Vote, Scope, Grant and the pure rules of a vote
    bound_headers.py  the forwarded headers an approval binds (digest) and shows (scrubbed)
    store.py        the ApprovalStore protocol and the in-process store
    redis_approvals.py  the same over Redis (hashes with a TTL, pub/sub), shared by replicas
    service.py      Approvals: ask (the proxy's s38_ask stage), decide (admin API), remember
    webhook.py      announces new approval requests (Slack or JSON, HMAC-signed)
    api.py          the admin API's approvals handlers: GET/POST /v1/approvals...
    fanout.py       the same on the workers' front, asking every worker

`approval_store_for(redis)` picks the store: the in-process one without a Redis client (one
`sandgate run`), the Redis one with it (`--state redis://...`: every replica sees and decides
every approval).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandgate.approvals.store import ApprovalStore, MemoryStore

if TYPE_CHECKING:
    from redis.asyncio import Redis


def approval_store_for(redis: Redis | None, prefix: str = "sandgate",
                       owned: bool = False) -> ApprovalStore:
    """The approval store for this process: shared through `redis` when given (a client the
    caller keeps and closes, unless `owned`: then the store closes it)."""
    if redis is None:
        return MemoryStore()
    from sandgate.approvals.redis_approvals import RedisStore

    return RedisStore(redis, prefix=prefix, owned=owned)
