"""Per-sandbox secret paths and dynamic secrets with leases, without Vault.

Templates and path variables, the policy checks (located errors), cache keying by resolved path,
and the lease bookkeeping (mint, renew, max_ttl, token expiry, sandbox end, revocation retries,
shutdown) with a fake clock and a fake engine. The real engine (OpenBao's database engine against
PostgreSQL) is in tests/integration/test_fleet_secrets.py.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sandgate.errors import Code, SandboxRequired, SecretError
from sandgate.identity.base import Caller
from sandgate.inject import own_forms
from sandgate.policy.compiler import parse_template
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import DynamicRef, SecretRef, SecretSlot, Source
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.forms import basic_auth_form
from sandgate.secrets.leases import LeaseManager
from sandgate.secrets.scope import GLOBAL, Scope, parse_path, resolve, scope_of
from sandgate.secrets.vault import SecretBroker, VaultConfig
from tests.support.bao import fingerprint

VALUE_A = "unit-fleet-value-a-5c1e"
VALUE_B = "unit-fleet-value-b-93fd"


def same(a: str, b: str) -> bool:
    return fingerprint(a) == fingerprint(b)


def kv_ref(name: str, path: str) -> SecretRef:
    return SecretRef(name=name, mount="secret", path=parse_path(path), field="token",
                     kv_version=2, placeholder=f"sandgate-placeholder-{name}",
                     source=Source("test", 1))


def dyn_ref(name: str = "db", path: str = "database/creds/ro",
            username_field: str | None = "username") -> SecretRef:
    return SecretRef(name=name, mount="", path="", field="password", kv_version=2,
                     placeholder=f"sandgate-placeholder-{name}", source=Source("test", 1),
                     dynamic=DynamicRef(parse_path(path), "password", username_field))


# ---------------------------------------------------------------------------- templates


def test_username_slot_parses_and_renders():
    t = parse_template("{{ secrets.db.username }}:{{secrets.db}}")
    assert t.parts == (SecretSlot("db", "username"), ":", SecretSlot("db"))
    assert t.secrets == frozenset({"db"})
    assert t.keys == frozenset({"db", "db.username"})
    assert t.render({"db": "pw", "db.username": "u"}) == "u:pw"


@pytest.mark.parametrize("text", ["{{ secrets.db.password }}", "{{ secrets.db.username.x }}"])
def test_other_slot_parts_are_errors(text):
    with pytest.raises(ValueError, match="template-looking"):
        parse_template(text)


def test_own_forms_of_a_dynamic_basic_pair(tmp_path):
    policy = _load(tmp_path, DYN_POLICY)
    view = {"db": "pw-1", "db.username": "v-user-1"}
    forms = own_forms(policy, view)
    assert forms["db"] == [basic_auth_form("v-user-1", "pw-1")]
    assert own_forms(policy, {"db": "pw-1"}) == {}  # no user name: no Basic pair to build


# ---------------------------------------------------------------------------- path variables


@pytest.mark.parametrize(("raw", "stored"), [
    ("sandboxes/{{sandbox}}/github", "sandboxes/{{ sandbox }}/github"),
    ("teams/{{  identity }}/{{ sandbox  }}", "teams/{{ identity }}/{{ sandbox }}"),
    ("plain/path", "plain/path"),
])
def test_parse_path_canonical(raw, stored):
    assert parse_path(raw) == stored


@pytest.mark.parametrize(("raw", "fragment"), [
    ("sandboxes/{{ sbx }}/x", "unknown variable {{ sbx }}"),
    ("sandboxes/{{ secrets.x }}/x", "unknown variable"),
    ("sandboxes/{{ sandbox }/x", "template-looking"),
    ("sandboxes/${sandbox}/x", "template-looking"),
    ("sandboxes/}}", "template-looking"),
])
def test_parse_path_errors(raw, fragment):
    with pytest.raises(ValueError, match=fragment.replace("{", r"\{").replace("}", r"\}")):
        parse_path(raw)


def test_resolve_fills_caller():
    ref = kv_ref("gh", "teams/{{ identity }}/sandboxes/{{ sandbox }}/github")
    assert resolve(ref, "agent", "sbx-1") == "teams/agent/sandboxes/sbx-1/github"
    assert scope_of(ref, "agent", "sbx-1") == Scope("agent", "sbx-1")
    shared = kv_ref("s", "llm/key")
    assert resolve(shared, "agent", "sbx-1") == "llm/key"
    assert scope_of(shared, "agent", "sbx-1") == GLOBAL
    by_identity = kv_ref("i", "teams/{{ identity }}/key")
    assert scope_of(by_identity, "agent", "sbx-1") == Scope("agent", None)
    assert not by_identity.per_sandbox and by_identity.per_identity


@pytest.mark.parametrize("sandbox", [None, "../admin", "a/b", "..", "a..b", "", "x" * 200])
def test_resolve_refuses_missing_or_unsafe_sandbox(sandbox):
    ref = kv_ref("gh", "sandboxes/{{ sandbox }}/github")
    with pytest.raises(SandboxRequired) as ei:
        resolve(ref, "agent", sandbox)
    assert ei.value.code is Code.SANDBOX_REQUIRED and ei.value.status == 403
    assert "'gh'" in ei.value.reason and ei.value.hint


def test_dynamic_secret_is_always_per_sandbox():
    ref = dyn_ref()
    assert ref.per_sandbox
    with pytest.raises(SandboxRequired):
        resolve(ref, "agent", None)
    assert resolve(ref, "agent", "s1") == "database/creds/ro"


def test_scope_covers():
    mine = Scope("agent", "s1")
    assert mine.covers(GLOBAL) and mine.covers(Scope("agent", None)) and mine.covers(mine)
    assert not mine.covers(Scope("agent", "s2")) and not mine.covers(Scope("other", None))


# ---------------------------------------------------------------------------- policy checks

DYN_POLICY = """
version: v1
secrets:
  db:
    dynamic: {path: "database/creds/{{ identity }}", username_field: username}
  gh:
    vault: "secret/data/sandboxes/{{ sandbox }}/github"
    field: token
identities:
  agent:
    rules:
      - name: db
        hosts: [db.test]
        inject:
          basic: {username: "{{ secrets.db.username }}", password: "{{ secrets.db }}"}
      - name: gh
        hosts: [api.github.com]
        inject:
          headers: {authorization: "Bearer {{ secrets.gh }}"}
"""


def _load(tmp_path: Path, text: str) -> Any:
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text).lstrip())
    return load_policy_dir(tmp_path)


def test_good_policy_compiles(tmp_path):
    p = _load(tmp_path, DYN_POLICY)
    db, gh = p.secrets["db"], p.secrets["gh"]
    assert db.dynamic == DynamicRef("database/creds/{{ identity }}", "password", "username")
    assert db.per_sandbox and db.per_identity
    assert (gh.mount, gh.path, gh.per_sandbox) == ("secret", "sandboxes/{{ sandbox }}/github",
                                                   True)


# (secrets block, line, field, message fragment): each alone in a file
BROKEN = [
    ('db: {dynamic: {path: "database/creds/{{ sbx }}"}}', 3, "secrets.db.dynamic.path",
     "unknown variable"),
    ('db: {dynamic: {path: "/"}}', 3, "secrets.db.dynamic.path", "empty dynamic path"),
    ('db: {dynamic: {path: database/creds/ro}, field: password}', 3, "secrets.db.field",
     "`field` is for KV secrets"),
    ('db: {dynamic: {path: database/creds/ro}, vault: secret/data/x}', 3, "secrets.db.vault",
     "`vault` is for KV secrets"),
    ('db: {dynamic: {path: database/creds/ro, username_field: ""}}', 3,
     "secrets.db.dynamic.username_field", "empty username_field"),
    ('db: {dynamic: {path: database/creds/ro, pth: x}}', 3, "secrets.db.dynamic.pth",
     "unknown key"),
    ('db: {vault: "secret/data/sandboxes/{{ sandbox }/x", field: t}', 3, "secrets.db.vault",
     "template-looking"),
    ('db: {vault: "secret/data/{{ host }}/x", field: t}', 3, "secrets.db.vault",
     "unknown variable"),
    ('db: {mount: "kv-{{ sandbox }}", path: x, field: t}', 3, "secrets.db.mount",
     "cannot use variables"),
    ('db: {mount: kv, path: "a/{{ tenant }}", field: t}', 3, "secrets.db.path",
     "unknown variable"),
    ('db: {vault: secret/data/x}', 3, "secrets.db.field", "required key `field`"),
]


@pytest.mark.parametrize(("block", "line", "field", "fragment"), BROKEN,
                         ids=[b[2] + ":" + b[3] for b in BROKEN])
def test_broken_secret_is_located(tmp_path, block, line, field, fragment):
    text = f"version: v1\nsecrets:\n  {block}\n"
    with pytest.raises(PolicyError) as ei:
        _load(tmp_path, text)
    problems = ei.value.problems
    assert len(problems) == 1, problems
    p = problems[0]
    assert (p.line, p.field) == (line, field), p
    assert fragment in p.message, p
    assert p.fix


def test_username_slot_needs_dynamic_with_username_field(tmp_path):
    text = DYN_POLICY.replace("username_field: username", "field: password")
    with pytest.raises(PolicyError) as ei:
        _load(tmp_path, text)
    (p,) = ei.value.problems
    assert p.field == "identities.agent.rules[0].inject.basic.username"
    assert "needs a dynamic secret with a username_field" in p.message
    assert "username_field: username" in p.fix


# ---------------------------------------------------------------------------- KV cache keying


class TableBroker(SecretBroker):
    """The one Vault read replaced by a table of resolved paths."""

    def __init__(self, refs: dict[str, SecretRef], table: dict[str, str]) -> None:
        super().__init__(VaultConfig(addr="http://127.0.0.1:9", token="t"), refs, ttl=10)
        self.table = table
        self.now = 1000.0
        self._clock = lambda: self.now
        self.paths: list[str] = []

    async def _read(self, ref):  # type: ignore[override]
        self.vault_reads += 1
        self.paths.append(ref.path)
        return {"token": self.table[ref.path]}, 1


async def test_cache_is_keyed_by_resolved_path():
    b = TableBroker({"gh": kv_ref("gh", "sandboxes/{{ sandbox }}/github")},
                    {"sandboxes/s1/github": VALUE_A, "sandboxes/s2/github": VALUE_B})
    try:
        a = await b.get("gh", Caller("agent", "s1", "token"))
        c = await b.get("gh", Caller("agent", "s2", "token"))
        assert same(a.value, VALUE_A) and same(c.value, VALUE_B)
        assert same((await b.get("gh", Caller("agent", "s1", "token"))).value, VALUE_A)
        assert b.paths == ["sandboxes/s1/github", "sandboxes/s2/github"]  # one read each
        # every sandbox's value is scrubbed; a shared-only view never holds them
        assert sorted(v for _, v in b.cached_pairs()) == sorted([VALUE_A, VALUE_B])
        assert b.cached_values() == {}
        views = b.value_views()
        assert {} in views and {"gh": VALUE_A} in views and {"gh": VALUE_B} in views
        with pytest.raises(SandboxRequired):
            await b.get("gh", Caller("agent", None, "token"))
        assert b.vault_reads == 2
        gen = b.generation
        await b.end_sandbox("s1", "test")
        # forgotten by the cache, still scrubbed and detected for the retired window
        assert [e.value.value for e in b._cache.values()] == [VALUE_B] and b.generation > gen
        assert ("gh", VALUE_A) in b.retired
        assert sorted(v for _, v in b.cached_pairs()) == sorted([VALUE_A, VALUE_B])
    finally:
        await b.aclose()


def test_secret_set_takes_pairs_with_one_name():
    s = SecretSet([("gh", VALUE_A), ("gh", VALUE_B)])
    out, n = s.scrub(f"{VALUE_A} {VALUE_B}".encode())
    assert n == 2 and b"REDACTED:gh" in out
    assert {h.name for h in s.find(VALUE_B.upper().encode())} == {"gh"}


# ---------------------------------------------------------------------------- leases


class FakeEngine:
    """A dynamic secrets engine: numbered credentials, leases with ttl and max_ttl; `down`
    makes every call fail like an unreachable Vault."""

    def __init__(self, clock: FakeClock, ttl: int = 10, max_ttl: int = 30) -> None:
        self.clock = clock
        self.ttl, self.max_ttl = ttl, max_ttl
        self.n = 0
        self.live: dict[str, float] = {}  # lease id -> minted at
        self.revoked: list[str] = []
        self.renewals: list[tuple[str, int]] = []
        self.down = False

    def _check(self) -> None:
        if self.down:
            e = ConnectionError("down")
            e.detail = "Vault is unreachable (connection refused)"  # type: ignore[attr-defined]
            raise e

    async def mint(self, path: str) -> dict[str, Any]:
        self._check()
        self.n += 1
        lease_id = f"{path}/lease{self.n}"
        self.live[lease_id] = self.clock.now
        return {"lease_id": lease_id, "lease_duration": self.ttl, "renewable": True,
                "data": {"username": f"v-user-{self.n}", "password": f"fake-pw-{self.n}-x9"}}

    async def renew(self, lease_id: str, increment: int) -> dict[str, Any]:
        self._check()
        self.renewals.append((lease_id, increment))
        left = self.live[lease_id] + self.max_ttl - self.clock.now
        return {"lease_id": lease_id, "lease_duration": int(min(increment, left))}

    async def revoke(self, lease_id: str) -> None:
        self._check()
        self.live.pop(lease_id, None)
        self.revoked.append(lease_id)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.wall = 1_700_000_000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


@pytest.fixture
def lm() -> tuple[LeaseManager, FakeEngine, FakeClock, list[dict[str, Any]]]:
    clock = FakeClock()
    engine = FakeEngine(clock)
    events: list[dict[str, Any]] = []
    m = LeaseManager(engine, clock=lambda: clock.now, wall=lambda: clock.wall,
                     audit=lambda event, **f: events.append({"event": event, **f}),
                     retry_delays=(1.0, 2.0))
    return m, engine, clock, events


S1, S2 = Scope("agent", "s1"), Scope("agent", "s2")


async def test_mint_once_per_sandbox_single_flight(lm):
    m, engine, _, events = lm
    ref = dyn_ref()
    got = await asyncio.gather(*(m.get(ref, "database/creds/ro", S1) for _ in range(5)))
    assert engine.n == 1 and len({x.lease_id for x in got}) == 1
    other = await m.get(ref, "database/creds/ro", S2)
    assert engine.n == 2 and other.username == "v-user-2" and got[0].username == "v-user-1"
    mints = [e for e in events if e["action"] == "mint"]
    assert [(e["sandbox"], e["outcome"]) for e in mints] == [("s1", "ok"), ("s2", "ok")]
    assert all("fake-pw" not in repr(e) for e in events)  # never a value in the audit


async def test_renewal_before_expiry_until_max_ttl_then_fresh_mint(lm):
    m, engine, clock, events = lm
    ref = dyn_ref()
    first = await m.get(ref, "database/creds/ro", S1)
    clock.advance(4)
    await m.step()
    assert engine.renewals == []  # more than half the grant left
    clock.advance(2)  # 4 s of 10 left
    await m.step()
    assert engine.renewals == [(first.lease_id, 10)]
    assert first.expires == clock.now + 10 and not first.capped
    for _ in range(3):
        clock.advance(6)
        await m.step()
    # max_ttl 30: the last renewal got less than asked and the lease stops renewing
    assert first.capped and first.expires == 1030.0
    assert len(engine.renewals) == 4
    assert [e["capped"] for e in events if e["action"] == "renew"][-1] is True
    clock.advance(3)
    await m.step()
    assert len(engine.renewals) == 4
    assert (await m.get(ref, "database/creds/ro", S1)) is first  # 6 s of its last grant left
    clock.now = first.expires - 0.5  # inside the last tenth: not handed out any more
    fresh = await m.get(ref, "database/creds/ro", S1)
    assert fresh.lease_id != first.lease_id and first.lease_id in engine.revoked


async def test_unrenewed_lease_expires_and_is_forgotten_but_still_scrubbed(lm):
    m, engine, clock, events = lm
    lease = await m.get(dyn_ref(), "database/creds/ro", S1)
    engine.down = True
    clock.advance(6)
    await m.step()
    assert events[-1]["action"] == "renew" and events[-1]["outcome"] == "failed"
    clock.advance(5)
    await m.step()
    assert m.leases == {} and ("db", lease.value) in m.retired
    assert events[-1]["action"] == "expire"


async def test_end_sandbox_revokes_only_its_leases(lm):
    m, engine, _, events = lm
    ref = dyn_ref()
    a = await m.get(ref, "database/creds/ro", S1)
    b = await m.get(ref, "database/creds/ro", S2)
    counts = await m.end_sandbox("s1", "admin_api")
    assert counts == {"revoked": 1, "pending": 0}
    assert engine.revoked == [a.lease_id] and b.lease_id in engine.live
    assert [x.scope for x in m.leases.values()] == [S2]
    end = events[-1]
    assert end["action"] == "sandbox_end" and end["sandbox"] == "s1" and end["revoked"] == 1


async def test_revocation_retried_while_vault_is_down_and_audited(lm):
    m, engine, clock, events = lm
    a = await m.get(dyn_ref(), "database/creds/ro", S1)
    engine.down = True
    counts = await m.end_sandbox("s1", "container_die")
    assert counts == {"revoked": 0, "pending": 1} and len(m.pending) == 1
    clock.advance(0.5)
    await m.step()  # not due yet
    clock.advance(1)
    await m.step()  # second attempt, still down
    failed = [e for e in events if e["action"] == "revoke" and e["outcome"] == "failed"]
    assert [e["attempt"] for e in failed] == [1, 2]
    assert failed[0]["error"] == "Vault is unreachable (connection refused)"
    engine.down = False
    clock.advance(2)
    await m.step()
    assert engine.revoked == [a.lease_id] and m.pending == []
    ok = events[-1]
    assert (ok["action"], ok["outcome"], ok["attempt"], ok["reason"]) == (
        "revoke", "ok", 3, "container_die")


async def test_pending_revocation_dropped_once_the_lease_ran_out(lm):
    m, engine, clock, events = lm
    await m.get(dyn_ref(), "database/creds/ro", S1)
    engine.down = True
    await m.end_sandbox("s1", "admin_api")
    clock.advance(11)
    await m.step()
    assert m.pending == [] and events[-1]["outcome"] == "expired"


async def test_token_expiry_ends_the_sandbox(lm):
    m, engine, clock, _ = lm
    ref = dyn_ref()
    a = await m.get(ref, "database/creds/ro", S1, token_expires=clock.wall + 3)
    await m.get(ref, "database/creds/ro", S2, token_expires=clock.wall + 3)
    # s2 got a newer token: it lives on
    await m.get(ref, "database/creds/ro", S2, token_expires=clock.wall + 100)
    clock.advance(3)
    await m.step()
    assert engine.revoked == [a.lease_id]
    assert [x.scope for x in m.leases.values()] == [S2]


async def test_mint_racing_sandbox_end_is_revoked(lm):
    m, engine, _, _ = lm
    gate = asyncio.Event()
    real = engine.mint

    async def slow(path: str) -> dict[str, Any]:
        await gate.wait()
        return await real(path)

    engine.mint = slow  # type: ignore[method-assign]
    task = asyncio.create_task(m.get(dyn_ref(), "database/creds/ro", S1))
    for _ in range(5):  # the mint is under way
        await asyncio.sleep(0)
    await m.end_sandbox("s1", "admin_api")
    gate.set()
    with pytest.raises(SecretError, match="sandbox has ended"):
        await task
    assert m.leases == {} and engine.revoked == ["database/creds/ro/lease1"]
    assert m._ended == {}


async def test_mint_failure_is_a_secret_error_without_caching(lm):
    m, engine, _, events = lm
    engine.down = True
    with pytest.raises(SecretError) as ei:
        await m.get(dyn_ref(), "database/creds/ro", S1)
    assert "connection refused" in str(ei.value) and ei.value.code is Code.SECRET_UNAVAILABLE
    assert events[-1]["action"] == "mint" and events[-1]["outcome"] == "failed"
    engine.down = False
    assert (await m.get(dyn_ref(), "database/creds/ro", S1)).username == "v-user-1"


async def test_answer_without_lease_or_field_refused(lm):
    m, engine, _, _ = lm

    async def kv_like(path: str) -> dict[str, Any]:
        return {"data": {"password": "x" * 12, "username": "u"}}

    engine.mint = kv_like  # type: ignore[method-assign]
    with pytest.raises(SecretError, match="without a lease"):
        await m.get(dyn_ref(), "database/creds/ro", S1)
    engine.mint = FakeEngine.mint.__get__(engine)  # type: ignore[method-assign]
    with pytest.raises(SecretError, match="'nouser' missing"):
        await m.get(dyn_ref(username_field="nouser"), "database/creds/ro", S1)
    assert engine.revoked == ["database/creds/ro/lease1"]  # minted but unusable: revoked


async def test_shutdown_revokes_what_it_can_and_reports_the_rest(lm):
    m, engine, _, events = lm
    ref = dyn_ref()
    a = await m.get(ref, "database/creds/ro", S1)
    b = await m.get(ref, "database/creds/ro", S2)
    real = engine.revoke

    async def flaky(lease_id: str) -> None:
        if lease_id == b.lease_id:
            raise ConnectionError("down")
        await real(lease_id)

    engine.revoke = flaky  # type: ignore[method-assign]
    left = await m.shutdown(timeout=5)
    assert [x.lease_id for x in left] == [b.lease_id] and engine.revoked == [a.lease_id]
    outcomes = {(e["lease_id"], e["outcome"]) for e in events if e["action"] == "revoke"}
    assert outcomes == {(a.lease_id, "ok"), (b.lease_id, "abandoned")}


async def test_two_identities_with_one_sandbox_id_do_not_share_a_lease(lm):
    m, engine, _, _ = lm
    a = await m.get(dyn_ref(), "database/creds/ro", Scope("agent", "s1"))
    b = await m.get(dyn_ref(), "database/creds/ro", Scope("other", "s1"))
    assert a.lease_id != b.lease_id and engine.n == 2
    assert (await m.end_sandbox("s1", "admin_api")) == {"revoked": 2, "pending": 0}


async def test_ended_bookkeeping_does_not_grow(lm):
    m, _, _, _ = lm
    for i in range(50):
        await m.get(dyn_ref(), "database/creds/ro", Scope("agent", f"s{i}"))
        await m.end_sandbox(f"s{i}", "admin_api")
    assert m._ended == {} and m.leases == {} and m._token_deadline == {}


async def test_token_expiry_drops_per_sandbox_kv_values():
    b = TableBroker({"gh": kv_ref("gh", "sandboxes/{{ sandbox }}/github")},
                    {"sandboxes/s1/github": VALUE_A, "sandboxes/s2/github": VALUE_B})
    wall = [1_700_000_000.0]
    b.leases.wall = lambda: wall[0]
    try:
        await b.get("gh", Caller("agent", "s1", "token", expires=wall[0] + 5))
        await b.get("gh", Caller("agent", "s2", "token", expires=wall[0] + 500))
        wall[0] += 6
        await b.leases.step()
        assert [e.value.value for e in b._cache.values()] == [VALUE_B]
        assert ("gh", VALUE_A) in b.retired  # retired, not forgotten
    finally:
        await b.aclose()
