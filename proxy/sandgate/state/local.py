"""The embedded default: this process counts for itself (sandgate.limits.Limiter)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sandgate.limits import Limiter
from sandgate.llm.spend import (
    UNKNOWN_MODEL,
    Amounts,
    Reservation,
    SpendWindows,
    WindowView,
    budget_key,
)
from sandgate.policy.model import Budget, IdentityLimits, SecretBudget


class LocalCounts:
    """`Counts` over the process's Limiter (read through `limiter()`, so a replaced Limiter is
    the one used)."""

    def __init__(self, limiter: Callable[[], Limiter]) -> None:
        self._limiter = limiter
        self.spend_windows = SpendWindows()

    async def admit(self, identity: str, limits: IdentityLimits | None) -> None:
        self._limiter().admit(identity, limits)

    async def identified(self, client_id: str, identity: str,
                         limits: IdentityLimits | None) -> None:
        self._limiter().identified(client_id, identity, limits)

    def disconnected(self, client_id: str) -> None:
        self._limiter().disconnected(client_id)

    async def spend(self, budgets: Sequence[tuple[str, SecretBudget | None]]) -> None:
        self._limiter().spend(budgets)

    async def reserve(self, budget: Budget, who: str, want: Amounts, identity: str = "",
                      model: str = UNKNOWN_MODEL) -> Reservation:
        return self.spend_windows.reserve(budget_key(budget, who), budget, who, want,
                                          identity=identity, model=model)

    async def settle(self, res: Reservation, actual: Amounts) -> None:
        self.spend_windows.settle(res, actual)

    def settle_now(self, res: Reservation, actual: Amounts) -> None:
        """`settle` without a coroutine (sandgate.llm.spend.settle calls it in place: a count of
        this process never waits, so no task is started per call)."""
        self.spend_windows.settle(res, actual)

    async def open_windows(self) -> list[WindowView]:
        return self.spend_windows.views()

    async def sandbox_ended(self, sandbox: str) -> bool:
        # one process: DELETE /v1/sandboxes revokes its leases; its tokens end by their TTL
        return False
