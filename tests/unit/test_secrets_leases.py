"""The lease manager's side of one lease per sandbox for the fleet (`--state-lease-kv`):
minting through the shared store, revoking once, shutdown leaving the fleet's leases alone.
The store is faked here (one dict for the fleet); its Redis and Vault sides are shown by
tests/integration/test_fleet_leases.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest

from sandgate.secrets.leases import LeaseManager
from sandgate.secrets.scope import Scope
from tests.unit.test_fleet_secrets import FakeClock, FakeEngine, dyn_ref

pytestmark = pytest.mark.unit

S1 = Scope("agent", "s1")


class FakeShared:
    """SharedLeases' contract over one dict: the first mint of a key is real, later ones get
    the same answer; the first revoke of a lease id is real."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str, Scope], Mapping[str, Any]] = {}
        self.revoked: set[str] = set()
        self.renewals: list[tuple[str, float]] = []

    async def mint(self, name: str, path: str, scope: Scope,
                   mint: Callable[[str], Awaitable[Mapping[str, Any]]]) -> Mapping[str, Any]:
        key = (name, path, scope)
        if key in self.held:
            return {**self.held[key], "fleet": "shared"}
        self.held[key] = await mint(path)
        return {**self.held[key], "fleet": "minted"}

    async def renewed(self, name: str, path: str, scope: Scope, lease_id: str,
                      granted: float) -> None:
        self.renewals.append((lease_id, granted))

    async def revoke(self, name: str, path: str, scope: Scope, lease_id: str,
                     revoke: Callable[[str], Awaitable[None]]) -> bool:
        if lease_id in self.revoked:
            return False
        self.revoked.add(lease_id)
        await revoke(lease_id)
        return True


def manager(engine: FakeEngine, clock: FakeClock, shared: FakeShared,
            events: list[dict[str, Any]]) -> LeaseManager:
    m = LeaseManager(engine, clock=lambda: clock.now, wall=lambda: clock.wall,
                     audit=lambda event, **f: events.append({"event": event, **f}))
    m.shared = shared
    return m


async def test_two_processes_share_one_lease_and_revoke_it_once() -> None:
    clock, shared = FakeClock(), FakeShared()
    engine = FakeEngine(clock)
    ev_a: list[dict[str, Any]] = []
    ev_b: list[dict[str, Any]] = []
    a, b = manager(engine, clock, shared, ev_a), manager(engine, clock, shared, ev_b)
    la = await a.get(dyn_ref(), "database/creds/ro", S1)
    lb = await b.get(dyn_ref(), "database/creds/ro", S1)
    assert engine.n == 1 and la.lease_id == lb.lease_id and la.value == lb.value
    assert [e["fleet"] for e in ev_a if e["action"] == "mint"] == ["minted"]
    assert [e["fleet"] for e in ev_b if e["action"] == "mint"] == ["shared"]
    clock.advance(6)  # renewed by a holder: the fleet's record moves with it
    await a.step()
    assert shared.renewals and shared.renewals[0][0] == la.lease_id
    assert await b.end_sandbox("s1", "admin_api") == {"revoked": 1, "pending": 0}
    assert await a.end_sandbox("s1", "fleet: admin_api") == {"revoked": 1, "pending": 0}
    assert engine.revoked == [la.lease_id]  # once in Vault
    fleet = [e["fleet"] for e in ev_a + ev_b if e["action"] == "revoke"]
    assert sorted(fleet) == ["elsewhere", "here"]


async def test_a_failed_revocation_is_retried_by_the_same_rules() -> None:
    clock, shared = FakeClock(), FakeShared()
    engine = FakeEngine(clock)
    events: list[dict[str, Any]] = []
    m = manager(engine, clock, shared, events)
    lease = await m.get(dyn_ref(), "database/creds/ro", S1)
    engine.down = True
    shared.revoked.discard(lease.lease_id)

    async def failing(name: str, path: str, scope: Scope, lease_id: str,
                      revoke: Callable[[str], Awaitable[None]]) -> bool:
        await revoke(lease_id)  # raises: Vault down
        return True

    shared.revoke = failing  # type: ignore[method-assign]
    assert await m.end_sandbox("s1", "admin_api") == {"revoked": 0, "pending": 1}
    engine.down = False
    clock.advance(1.5)
    await m.step()
    assert engine.revoked == [lease.lease_id] and not m.pending


async def test_shutdown_leaves_the_fleets_leases_to_the_fleet() -> None:
    clock, shared = FakeClock(), FakeShared()
    engine = FakeEngine(clock)
    events: list[dict[str, Any]] = []
    m = manager(engine, clock, shared, events)
    await m.get(dyn_ref(), "database/creds/ro", S1)
    assert await m.shutdown() == []
    assert engine.revoked == []
    assert [e["outcome"] for e in events if e["action"] == "revoke"] == ["left_to_fleet"]
