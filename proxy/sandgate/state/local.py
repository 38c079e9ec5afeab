"""The embedded default: this process counts for itself (sandgate.limits.Limiter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sandgate.limits import Limiter
from sandgate.policy.model import IdentityLimits, SecretBudget


class LocalCounts:
    """`Counts` over the process's Limiter (read through `limiter()`, so a replaced Limiter is
    the one used)."""

    def __init__(self, limiter: Callable[[], Limiter]) -> None:
        self._limiter = limiter

    async def admit(self, identity: str, limits: IdentityLimits | None) -> None:
        self._limiter().admit(identity, limits)

    async def identified(self, client_id: str, identity: str,
                         limits: IdentityLimits | None) -> None:
        self._limiter().identified(client_id, identity, limits)

    def disconnected(self, client_id: str) -> None:
        self._limiter().disconnected(client_id)

    async def spend(self, budgets: Sequence[tuple[str, SecretBudget | None]]) -> None:
        self._limiter().spend(budgets)

    async def sandbox_ended(self, sandbox: str) -> bool:
        # one process: DELETE /v1/sandboxes revokes its leases; its tokens end by their TTL
        return False
