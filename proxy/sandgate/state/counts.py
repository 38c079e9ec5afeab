"""What the stages ask of the counting, whoever does it (this process, or the fleet's Redis).

`GateState.counts` is one of these: `LocalCounts` (sandgate.state.local, the default) or
`RedisCounts` (sandgate.state.redis_counts, `--state`). Admission of raw connections (the total
and per-source limits, before identity is known) stays with each process's `Limiter`: those
protect the process itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sandgate.llm.spend import UNKNOWN_MODEL, Amounts, Reservation, WindowView
from sandgate.policy.model import Budget, IdentityLimits, SecretBudget


class Counts(Protocol):
    async def admit(self, identity: str, limits: IdentityLimits | None) -> None:
        """One request of `identity`: raises LimitExceeded(rate_limited) when over its rate."""

    async def identified(self, client_id: str, identity: str,
                         limits: IdentityLimits | None) -> None:
        """The connection counts for `identity` (once): LimitExceeded(too_many_connections)."""

    def disconnected(self, client_id: str) -> None:
        """The connection closed: whatever it held is given back."""

    async def spend(self, budgets: Sequence[tuple[str, SecretBudget | None]]) -> None:
        """One injection of each secret, all or none: LimitExceeded(budget_exhausted), or
        StateUnavailable when it cannot be counted."""

    async def reserve(self, budget: Budget, who: str, want: Amounts, identity: str = "",
                      model: str = UNKNOWN_MODEL) -> Reservation:
        """An LLM call's worst case, counted against `budget` for `who` (an identity or a
        sandbox) while the window has anything left (sandgate.llm.spend):
        LimitExceeded(spend_exhausted), or StateUnavailable when it cannot be counted.
        `identity` (the caller's) and `model` (the policy's name for the call's model) are
        what the spend view shows the window's spend under."""

    async def settle(self, res: Reservation, actual: Amounts) -> None:
        """The call ended: its reservation replaced by what it spent (best effort: a failed
        settlement leaves the worst case counted, never less)."""

    async def open_windows(self) -> list[WindowView]:
        """The LLM budget windows open now (the console's spend view): this process's, or the
        fleet's (StateUnavailable when the state cannot be read)."""

    async def sandbox_ended(self, sandbox: str) -> bool:
        """Has the fleet ended this sandbox (its tokens are refused)?"""
