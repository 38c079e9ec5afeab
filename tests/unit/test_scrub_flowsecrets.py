"""The flow owns its secrets; retired values stay scrubbed and detected (no Vault: a table).

A property test drives the real SecretBroker (its cache, leases and retired set), a fake Vault
table and a fake dynamic engine through random interleavings of injection, refresh, rotation in
Vault, token expiry, DELETE of a sandbox and reload, and checks after every step that each value
ever injected into a flow is scrubbed from that flow's response (raw, base64, hex, and the Basic
pair Sandgate built), and still detected as exfiltration by the shared set.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandgate.errors import SecretError
from sandgate.identity.base import Caller
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import Policy
from sandgate.scrub.flowsecrets import Owned, ScrubSets, owned
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.retired import Retired
from sandgate.secrets.scope import parse_path
from sandgate.secrets.vault import SecretBroker, VaultConfig
from tests.unit.fuzz import examples
from tests.unit.test_fleet_secrets import FakeClock

POLICY = """
version: v1
secrets:
  api:
    vault: secret/data/llm/api
    field: token
  gh:
    vault: "secret/data/sandboxes/{{ sandbox }}/github"
    field: token
  db:
    dynamic: {path: "database/creds/ro", username_field: username}
identities:
  agent:
    rules:
      - name: api
        hosts: [api.test]
        inject: {headers: {x-api-key: "{{ secrets.api }}"}}
      - name: gh
        hosts: [gh.test]
        inject: {headers: {authorization: "Bearer {{ secrets.gh }}"}}
      - name: db
        hosts: [db.test]
        inject:
          basic: {username: "{{ secrets.db.username }}", password: "{{ secrets.db }}"}
"""


class Engine:
    """A dynamic secrets engine: a fresh pair per mint, every call succeeds."""

    def __init__(self) -> None:
        self.n = 0

    async def mint(self, path: str) -> dict[str, Any]:
        await asyncio.sleep(0)  # a Vault call: other steps may run meanwhile
        self.n += 1
        return {"lease_id": f"{path}/lease{self.n}", "lease_duration": 10, "renewable": True,
                "data": {"username": f"v-user-{self.n}", "password": f"fake-dyn-pw-{self.n}-q"}}

    async def renew(self, lease_id: str, increment: int) -> dict[str, Any]:
        return {"lease_duration": increment}

    async def revoke(self, lease_id: str) -> None:
        return None


class TableBroker(SecretBroker):
    """The real broker over a dict of Vault paths, with a fake clock and a fake engine."""

    def __init__(self, policy: Policy, clock: FakeClock) -> None:
        super().__init__(VaultConfig(addr="http://127.0.0.1:9", token="t"), policy.secrets,
                         ttl=1)
        self.table: dict[str, str] = {}
        self.versions = 0
        self._clock = lambda: clock.now
        self.leases.clock = lambda: clock.now
        self.leases.wall = lambda: clock.wall
        self.leases.backend = Engine()

    def rotate(self, path: str) -> None:
        self.versions += 1
        self.table[path] = f"fake-kv-{path.replace('/', '-')}-v{self.versions}-z"

    async def _read(self, ref: Any) -> tuple[Any, int | None]:
        await asyncio.sleep(0)  # a Vault call: other steps may run meanwhile
        self.vault_reads += 1
        if ref.path not in self.table:
            self.rotate(ref.path)
        return {"token": self.table[ref.path]}, 1


def _policy(tmp: Path) -> Policy:
    (tmp / "p.yaml").write_text(textwrap.dedent(POLICY).lstrip())
    return load_policy_dir(tmp)


def _forms(value: str) -> list[bytes]:
    raw = value.encode()
    return [raw, base64.b64encode(raw), raw.hex().encode(), raw.hex().upper().encode()]


def _assert_scrubbed(s: SecretSet, forms: list[bytes], what: str) -> None:
    for form in forms:
        out, _ = s.scrub(b"echo<" + form + b">")
        assert form not in out, f"{what}: a form came back in clear"


@dataclasses.dataclass
class Flow:
    mine: Owned
    values: dict[str, str]


class World:
    def __init__(self, tmp: Path) -> None:
        self.clock = FakeClock()
        self.policy = _policy(tmp)
        self.broker = TableBroker(self.policy, self.clock)
        self.sets = ScrubSets()
        self.flows: list[Flow] = []
        self.moved = False
        self.pending: list[asyncio.Task[None]] = []

    def caller(self, sandbox: str) -> Caller:
        return Caller("agent", sandbox, "token", expires=self.clock.wall + 5)

    async def inject(self, sandbox: str, name: str, record: bool = True) -> None:
        try:
            sv = await self.broker.get(name, self.caller(sandbox))
        except SecretError:  # e.g. joined a mint for a sandbox that ended: refused, not sent
            return
        values = {name: sv.value}
        if sv.username is not None:
            values[f"{name}.username"] = sv.username
        if record:
            self.flows.append(Flow(owned(self.policy, values, frozenset({name})), values))

    def path_of(self, name: str, sandbox: str) -> str:
        if name == "api":
            return "llm/moved" if self.moved else "llm/api"
        return f"sandboxes/{sandbox}/github"

    async def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "inject":
            await self.inject(op[1], op[2])
        elif kind == "start":  # an injection whose Vault read is still under way
            self.pending.append(asyncio.create_task(self.inject(op[1], op[2])))
            await asyncio.sleep(0)
        elif kind == "settle":
            await self.settle()
        elif kind == "refresh":
            await self.inject(op[1], op[2], record=False)
        elif kind == "rotate":
            self.broker.rotate(self.path_of(op[2], op[1]))
        elif kind == "advance":
            self.clock.advance(op[1])
            await self.broker.leases.step()  # renewals, expiries, token ends
        elif kind == "delete":
            await self.broker.end_sandbox(op[1], "admin_api")
        elif kind == "token_end":
            self.clock.advance(6)  # every token issued so far has expired
            await self.broker.leases.step()
        elif kind == "reload":
            self.moved = not self.moved
            refs = dict(self.policy.secrets)
            refs["api"] = dataclasses.replace(refs["api"], path=parse_path(
                "llm/moved" if self.moved else "llm/api"))
            self.broker.update_secrets(refs)
            self.sets.invalidate()

    async def settle(self) -> None:
        """Let every injection under way finish (one refused because its sandbox ended meanwhile
        injected nothing)."""
        pending, self.pending = self.pending, []
        await asyncio.gather(*pending, return_exceptions=True)

    def check(self) -> None:
        shared = self.sets.current(self.broker, {}, self.policy)
        for i, flow in enumerate(self.flows):
            mine = self.sets.for_flow(self.broker, {}, self.policy, flow.mine)
            for name, value in flow.values.items():
                if name.endswith(".username"):
                    continue  # a user name alone is not a credential
                _assert_scrubbed(mine, _forms(value), f"flow {i} ({name})")
                # retired, not forgotten: another flow's response and the sandbox's requests
                assert {h.name for h in shared.find(b"x" + value.upper().encode())} == {name}
            _assert_scrubbed(mine, [f for _, f in flow.mine.forms], f"flow {i} (own forms)")


SANDBOXES = st.sampled_from(["s1", "s2"])
NAMES = st.sampled_from(["api", "gh", "db"])
OPS = st.one_of(
    st.tuples(st.just("inject"), SANDBOXES, NAMES),
    st.tuples(st.just("start"), SANDBOXES, NAMES),
    st.tuples(st.just("settle")),
    st.tuples(st.just("refresh"), SANDBOXES, NAMES),
    st.tuples(st.just("rotate"), SANDBOXES, st.sampled_from(["api", "gh"])),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 11.0])),
    st.tuples(st.just("delete"), SANDBOXES),
    st.tuples(st.just("token_end")),
    st.tuples(st.just("reload")),
)


@settings(max_examples=examples(80), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=25))
def test_no_interleaving_lets_an_injected_value_through(tmp_path: Path,
                                                        ops: list[tuple[Any, ...]]) -> None:
    world = World(tmp_path)

    async def run() -> None:
        try:
            for op in ops:
                await world.step(op)
                world.check()
            await world.settle()
            world.check()
        finally:
            await world.broker.aclose()

    asyncio.run(run())


async def test_rotation_and_refresh_while_in_flight(tmp_path: Path) -> None:
    """The reproduction of the issue, without Vault: --secret-ttl 1, the request is given the
    old value, Vault rotates, another request refreshes the cache, the response arrives."""
    world = World(tmp_path)
    try:
        await world.step(("inject", "s1", "api"))
        old = world.flows[0]
        world.clock.advance(2)
        await world.step(("rotate", "s1", "api"))
        await world.step(("refresh", "s1", "api"))
        assert old.values["api"] not in [e.value.value for e in world.broker._cache.values()]
        world.check()
        # past the retired window only the flow still has it: the other flows do not
        world.clock.advance(Retired(lambda: 0).window + 1)
        shared = world.sets.current(world.broker, {}, world.policy)
        assert not shared.find(old.values["api"].encode())
        mine = world.sets.for_flow(world.broker, {}, world.policy, old.mine)
        _assert_scrubbed(mine, _forms(old.values["api"]), "the flow after the window")
    finally:
        await world.broker.aclose()


def test_retired_window_lease_end_and_bound() -> None:
    now = [0.0]
    r = Retired(lambda: now[0], window=10, limit=3)
    r.add("a", "va")
    r.add("b", "vb", until=50)  # a lease that ends later than the window
    gen = r.generation
    now[0] = 11
    assert r.pairs() == [("b", "vb")] and r.generation > gen
    now[0] = 51
    assert r.pairs() == []
    for i in range(5):
        r.add("c", f"vc{i}")
    assert len(r) == 3 and ("c", "vc0") not in r and ("c", "vc4") in r


def test_union_is_compiled_once_per_flow_and_shared_when_nothing_is_missing(
        tmp_path: Path) -> None:
    world = World(tmp_path)

    async def run() -> None:
        try:
            await world.inject("s1", "api")
            flow = world.flows[0]
            shared = world.sets.current(world.broker, {}, world.policy)
            assert world.sets.for_flow(world.broker, {}, world.policy, flow.mine) is shared
            stranger = owned(world.policy, {"api": "fake-never-cached-value-k"},
                             frozenset({"api"}))
            a = world.sets.for_flow(world.broker, {}, world.policy, stranger)
            assert a is not shared
            assert world.sets.for_flow(world.broker, {}, world.policy, stranger) is a
        finally:
            await world.broker.aclose()

    asyncio.run(run())


def test_owned_values_are_never_printed() -> None:
    mine = Owned((("api", "fake-secret-value-for-repr"),), (("api", b"fake-form"),))
    assert "fake" not in repr(mine)


@pytest.mark.parametrize("name", ["api", "gh"])
async def test_sandbox_end_and_reload_while_in_flight(tmp_path: Path, name: str) -> None:
    world = World(tmp_path)
    try:
        await world.step(("inject", "s1", name))
        await world.step(("delete", "s1"))
        await world.step(("reload",))
        await world.step(("token_end",))
        world.check()
    finally:
        await world.broker.aclose()
