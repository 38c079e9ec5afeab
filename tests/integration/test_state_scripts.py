"""The Lua scripts of the fleet state (sandgate.state.scripts) on a real redis-server.

They are the logic: every verdict on rates, budgets and connections is taken inside Redis.
The server listens on a unix socket in a temp dir (no TCP port). Hypothesis drives the budget
and connection scripts with random interleavings against a model that says what must hold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sandgate.errors import Code, LimitExceeded, StateUnavailable
from sandgate.limits import Limiter, LimitsConfig
from sandgate.llm.spend import Amounts, SpendWindows, budget_key
from sandgate.policy.model import Budget, IdentityLimits, SecretBudget, Source
from sandgate.state import StateConfig, scripts
from sandgate.state.fleet import Fleet
from sandgate.state.health import StateHealth
from sandgate.state.redis_counts import RedisCounts
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


def client(server: RedisServer) -> aioredis.Redis:
    return aioredis.Redis(unix_socket_path=str(server.socket), decode_responses=True)


@pytest.fixture
async def r(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = client(server)
    await c.flushall()
    yield c
    await c.aclose()


def config(prefix: str = "t:") -> StateConfig:
    return StateConfig.from_url("redis://unused:6379/0", prefix=prefix, timeout=1.0)


def counts(c: aioredis.Redis, process: str = "p1", fail: str = "open") -> RedisCounts:
    cfg = StateConfig.from_url("redis://unused:6379/0", prefix="t:", timeout=1.0,
                               fail=fail)  # type: ignore[arg-type]
    return RedisCounts(c, cfg, Limiter(LimitsConfig(rps=None)), StateHealth("test"), process)


# ------------------------------------------------------------------------------ rates


async def test_rate_grants_the_burst_then_refuses_with_the_wait(r: aioredis.Redis) -> None:
    rate = r.register_script(scripts.RATE)
    got = [float(await rate(keys=["b"], args=[1, 3])) for _ in range(4)]
    assert got[:3] == [0, 0, 0]
    assert 0 < got[3] <= 1.0  # a token comes back within 1/rate
    assert 0 < await r.pttl("b") <= 4000  # expires once it would be full again


async def test_rate_refills_on_the_servers_clock(r: aioredis.Redis) -> None:
    rate = r.register_script(scripts.RATE)
    assert float(await rate(keys=["b"], args=[20, 1])) == 0
    assert float(await rate(keys=["b"], args=[20, 1])) > 0
    await asyncio.sleep(0.06)  # 20/s: one token per 50 ms
    assert float(await rate(keys=["b"], args=[20, 1])) == 0


async def test_a_refused_take_spends_nothing(r: aioredis.Redis) -> None:
    rate = r.register_script(scripts.RATE)
    await rate(keys=["b"], args=[1, 1])
    for _ in range(5):
        assert float(await rate(keys=["b"], args=[1, 1])) > 0
    tokens = float(await r.hget("b", "tokens") or 0)
    assert 0 <= tokens < 1  # refusals did not drive the bucket negative


# ------------------------------------------------------------------------------ budgets


async def test_budget_allows_exactly_calls_per_window(r: aioredis.Redis) -> None:
    budget = r.register_script(scripts.BUDGET)
    out = [await budget(keys=["a"], args=[3, 60_000]) for _ in range(5)]
    assert out[:3] == [[0, 0]] * 3
    assert [o[0] for o in out[3:]] == [1, 1] and 0 < out[3][1] <= 60_000
    assert await r.get("a") == "3"


async def test_budget_window_ends_and_starts_again(r: aioredis.Redis) -> None:
    budget = r.register_script(scripts.BUDGET)
    assert await budget(keys=["a"], args=[1, 100]) == [0, 0]
    assert (await budget(keys=["a"], args=[1, 100]))[0] == 1
    await asyncio.sleep(0.15)
    assert await budget(keys=["a"], args=[1, 100]) == [0, 0]


async def test_several_budgets_are_all_or_none(r: aioredis.Redis) -> None:
    budget = r.register_script(scripts.BUDGET)
    assert await budget(keys=["a", "b"], args=[5, 60_000, 1, 60_000]) == [0, 0]
    refused = await budget(keys=["a", "b"], args=[5, 60_000, 1, 60_000])
    assert refused[0] == 2  # the second secret is spent...
    assert await r.get("a") == "1"  # ...and the first was not counted for the refused call


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
                      min_size=1, max_size=25),
       limits=st.lists(st.integers(1, 6), min_size=3, max_size=3))
def test_budget_matches_the_all_or_none_model(server: RedisServer, calls: list[list[int]],
                                              limits: list[int]) -> None:
    """Any sequence of multi-secret calls: granted exactly when every secret has room, and
    then every one (and only then) is counted."""

    async def run() -> None:
        c = client(server)
        await c.delete("s0", "s1", "s2")
        budget = c.register_script(scripts.BUDGET)
        used = [0, 0, 0]
        for names in calls:
            args: list[int] = []
            for i in names:
                args += [limits[i], 60_000]
            out = await budget(keys=[f"s{i}" for i in names], args=args)
            fits = all(used[i] < limits[i] for i in names)
            assert (out[0] == 0) == fits
            if fits:
                for i in names:
                    used[i] += 1
            else:
                first = next(k for k, i in enumerate(names) if used[i] >= limits[i])
                assert out[0] == first + 1
        for i in range(3):
            assert int(await c.get(f"s{i}") or 0) == used[i]
        await c.aclose()

    asyncio.run(run())


async def test_concurrent_spends_never_exceed_the_budget(server: RedisServer,
                                                         r: aioredis.Redis) -> None:
    clients = [client(server) for _ in range(8)]
    scripts_ = [c.register_script(scripts.BUDGET) for c in clients]
    out = await asyncio.gather(*(scripts_[i % 8](keys=["k"], args=[25, 60_000])
                                 for i in range(200)))
    assert sum(1 for o in out if o[0] == 0) == 25
    for c in clients:
        await c.aclose()


# ------------------------------------------------------------------------------ LLM spend

def spend_budget(output: int | None = None, cost: float | None = None, per: int = 60) -> Budget:
    return Budget(name="b", per=per, scope="identity", source=Source("f", 1),
                  output_tokens=output, cost_usd=cost)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 40)),
                    min_size=1, max_size=30),
       limit=st.integers(1, 120))
def test_spend_scripts_match_the_process_windows(server: RedisServer,
                                                 ops: list[tuple[bool, int, int]],
                                                 limit: int) -> None:
    """Any sequence of reservations and settlements: Redis admits and counts exactly as one
    process's SpendWindows does (the per-process and fleet counts are one semantics)."""

    async def run() -> None:
        c = client(server)
        await c.flushall()
        fleet, local = counts(c), SpendWindows()
        b = spend_budget(output=limit, cost=limit / 1_000_000)
        open_r: list = []
        open_l: list = []
        for settle_first, worst, spent in ops:
            if settle_first and open_r:
                actual = Amounts(0, min(spent, open_r[0].reserved.output_tokens), spent)
                await fleet.settle(open_r.pop(0), actual)
                local.settle(open_l.pop(0), actual)
            want = Amounts(3, worst, worst)
            try:
                open_l.append(local.reserve(budget_key(b, "a"), b, "a", want, now=0))
                granted_l = True
            except LimitExceeded:
                granted_l = False
            try:
                open_r.append(await fleet.reserve(b, "a", want))
                granted_r = True
            except LimitExceeded as e:
                assert e.code == Code.SPEND_EXHAUSTED and e.retry_after
                granted_r = False
            assert granted_r == granted_l
        key = fleet.cfg.key("spend", budget_key(b, "a"))
        got = await c.hmget(key, "i", "o", "c")
        assert Amounts(*(int(v) for v in got)) == local.used(budget_key(b, "a"))
        await c.aclose()

    asyncio.run(run())


async def test_concurrent_reservations_never_pass_the_limit_by_more_than_one_call(
        server: RedisServer, r: aioredis.Redis) -> None:
    """200 reservations of 20 at once from 8 connections on a limit of 100: exactly 5 (0, 20,
    40, 60 and 80 counted when each was admitted); the last one ends at the limit."""
    fleets = [counts(client(server), f"p{i}") for i in range(8)]
    b = spend_budget(output=100)

    async def one(i: int) -> bool:
        try:
            await fleets[i % 8].reserve(b, "a", Amounts(0, 20, 0))
            return True
        except LimitExceeded:
            return False

    out = await asyncio.gather(*(one(i) for i in range(200)))
    assert sum(out) == 5
    for f in fleets:
        await f.r.aclose()


async def test_a_settlement_after_its_window_ended_changes_nothing(r: aioredis.Redis) -> None:
    fleet = counts(r)
    b = spend_budget(output=100, per=1)
    res = await fleet.reserve(b, "a", Amounts(0, 50, 0))
    await asyncio.sleep(1.2)  # the window expired on the server's clock
    await fleet.reserve(b, "a", Amounts(0, 30, 0))  # a new window
    await fleet.settle(res, Amounts(0, 0, 0))  # of the old one: no debt to the new
    key = fleet.cfg.key("spend", budget_key(b, "a"))
    assert await r.hget(key, "o") == "30"


async def test_open_windows_show_the_fleets_spend_in_flight_and_per_model(
        r: aioredis.Redis) -> None:
    """What the console's spend view reads from the fleet: each window once (whichever
    replica counted into it), what is in flight, the settled spend per model."""
    a, b = counts(r, "p1"), counts(r, "p2")
    day = spend_budget(output=1000)
    box = Budget("box", 60, "sandbox", Source("t", 1), input_tokens=5000)
    r1 = await a.reserve(day, "agent", Amounts(300, 400, 7000), identity="agent",
                         model="claude-sonnet-*")
    await b.reserve(day, "agent", Amounts(200, 100, 2000), identity="agent",
                    model="claude-sonnet-*")  # in flight, on another replica
    await b.settle(r1, Amounts(120, 80, 1500))
    r3 = await a.reserve(box, "sb:1", Amounts(900, 10, 0), identity="agent", model="gpt-*")
    await a.settle(r3, Amounts(700, 5, 0))
    views = {(v.budget, v.who): v for v in await b.open_windows()}
    d = views[("b", "agent")]
    assert d.shared and d.identity == "agent" and 0 < d.ends_in <= 60
    assert (d.used, d.reserved) == (Amounts(320, 180, 3500), Amounts(200, 100, 2000))
    assert d.models == {"claude-sonnet-*": Amounts(120, 80, 1500)}
    assert d.limits.output_tokens == 1000
    s = views[("box", "sb:1")]
    assert (s.scope, s.identity, s.used, s.reserved) == ("sandbox", "agent",
                                                         Amounts(700, 5, 0), Amounts(0, 0, 0))
    assert s.models == {"gpt-*": Amounts(700, 5, 0)}
    assert len(views) == 2
    other = counts(r, "p3")
    other.cfg = config("other:")  # another fleet's prefix on the same server: its own keys
    assert await other.open_windows() == []


async def test_state_down_llm_budget_fails_closed(tmp_path: Path) -> None:
    dead = aioredis.Redis(unix_socket_path=str(tmp_path / "none.sock"), decode_responses=True,
                          socket_connect_timeout=0.2, socket_timeout=0.2,
                          retry=Retry(NoBackoff(), 0))
    with pytest.raises(StateUnavailable) as e:
        await counts(dead).reserve(spend_budget(output=10), "a", Amounts(0, 1, 0))
    assert e.value.code == Code.STATE_UNAVAILABLE and "LLM budget" in e.value.reason
    await dead.aclose()


# ------------------------------------------------------------------------------ connections


async def test_connections_count_per_live_process(r: aioredis.Redis) -> None:
    acquire = r.register_script(scripts.CONN_ACQUIRE)
    release = r.register_script(scripts.CONN_RELEASE)
    await r.set("t:proc:A", "v", px=60_000)
    await r.set("t:proc:B", "v", px=60_000)
    assert await acquire(keys=["c"], args=["A", 2, "t:proc:"]) == 1
    assert await acquire(keys=["c"], args=["B", 2, "t:proc:"]) == 1
    assert await acquire(keys=["c"], args=["A", 2, "t:proc:"]) == 0  # 2 across the fleet
    await release(keys=["c"], args=["B"])
    assert await r.hget("c", "B") is None  # removed at 0
    assert await acquire(keys=["c"], args=["A", 2, "t:proc:"]) == 1


async def test_a_dead_processs_connections_stop_counting(r: aioredis.Redis) -> None:
    acquire = r.register_script(scripts.CONN_ACQUIRE)
    await r.set("t:proc:dead", "v", px=50)
    await r.set("t:proc:live", "v", px=60_000)
    assert await acquire(keys=["c"], args=["dead", 1, "t:proc:"]) == 1
    assert await acquire(keys=["c"], args=["live", 1, "t:proc:"]) == 0
    await asyncio.sleep(0.1)  # its lease expired: it crashed without giving back
    assert await acquire(keys=["c"], args=["live", 1, "t:proc:"]) == 1
    assert await r.hgetall("c") == {"live": "1"}


async def test_beat_reports_live_versions_and_forgets_dead_ones(r: aioredis.Redis) -> None:
    beat = r.register_script(scripts.BEAT)
    assert await beat(keys=["t:proc:A", "t:policy"], args=["A", "v1", 50]) == ["A", "v1"]
    got = await beat(keys=["t:proc:B", "t:policy"], args=["B", "v2", 60_000])
    assert dict(zip(got[::2], got[1::2], strict=True)) == {"A": "v1", "B": "v2"}
    await asyncio.sleep(0.1)
    assert await beat(keys=["t:proc:B", "t:policy"], args=["B", "v2", 60_000]) == ["B", "v2"]
    assert await r.exists("t:proc:A") == 0


async def test_scripts_are_loaded_again_after_script_flush(r: aioredis.Redis) -> None:
    """EVALSHA, and on NOSCRIPT (a restarted or flushed server) the script's text again."""
    budget = r.register_script(scripts.BUDGET)
    assert await budget(keys=["a"], args=[2, 60_000]) == [0, 0]
    await r.script_flush()
    assert await budget(keys=["a"], args=[2, 60_000]) == [0, 0]


# ------------------------------------------------------------------------------ RedisCounts


async def test_redis_counts_refuse_with_the_limit_codes(r: aioredis.Redis) -> None:
    c = counts(r)
    await c.admit("agent", IdentityLimits(rps=1, burst=1))
    with pytest.raises(LimitExceeded) as e:
        await c.admit("agent", IdentityLimits(rps=1, burst=1))
    assert e.value.code == Code.RATE_LIMITED and e.value.retry_after == 1
    b = SecretBudget(calls=1, per=60)
    await c.spend([("k", b), ("free", None)])
    with pytest.raises(LimitExceeded) as e:
        await c.spend([("k", b)])
    assert e.value.code == Code.BUDGET_EXHAUSTED and 1 <= (e.value.retry_after or 0) <= 60


async def test_redis_counts_connections_for_the_fleet(r: aioredis.Redis) -> None:
    a, b = counts(r, "A"), counts(r, "B")
    for p in ("A", "B"):
        await r.set(f"t:proc:{p}", "v", px=60_000)
    lim = IdentityLimits(max_connections=2)
    a.limiter.connected("c1")
    b.limiter.connected("c2")
    b.limiter.connected("c3")
    await a.identified("c1", "agent", lim)
    await b.identified("c2", "agent", lim)
    with pytest.raises(LimitExceeded) as e:
        await b.identified("c3", "agent", lim)
    assert e.value.code == Code.TOO_MANY_CONNECTIONS
    a.disconnected("c1")
    await asyncio.gather(*a._tasks)
    await b.identified("c3", "agent", lim)
    assert await r.hgetall("t:conns:agent") == {"B": "2"}


async def test_state_down_budget_fails_closed_rate_falls_back(tmp_path: Path) -> None:
    dead = aioredis.Redis(unix_socket_path=str(tmp_path / "none.sock"), decode_responses=True,
                          socket_connect_timeout=0.2, socket_timeout=0.2,
                          retry=Retry(NoBackoff(), 0))  # as open_state() makes them
    c = counts(dead)
    with pytest.raises(StateUnavailable) as e:
        await c.spend([("k", SecretBudget(calls=5, per=60))])
    assert e.value.code == Code.STATE_UNAVAILABLE and e.value.status == 503
    assert not c.health.available
    t0 = time.monotonic()
    await c.admit("agent", IdentityLimits(rps=1, burst=1))  # per process now, no wait
    with pytest.raises(LimitExceeded):
        await c.admit("agent", IdentityLimits(rps=1, burst=1))
    assert time.monotonic() - t0 < 5  # known down: nothing waited on the dead server
    closed = counts(dead, fail="closed")
    with pytest.raises(StateUnavailable):
        await closed.admit("agent", IdentityLimits(rps=1, burst=1))
    await dead.aclose()


async def test_fleet_ended_sandbox_is_seen_by_another_process(server: RedisServer,
                                                              r: aioredis.Redis) -> None:
    cfg = config()
    one = Fleet(cfg, r, StateHealth("t"), "one", ended_ttl=60)
    other_client = client(server)
    two = Fleet(cfg, other_client, StateHealth("t"), "two", ended_ttl=60)
    assert not await two.sandbox_ended("sb-1")
    assert await one.end_sandbox("sb-1", "admin_api")
    assert await one.sandbox_ended("sb-1")
    two._checked.clear()  # as if RECHECK seconds had passed (no message received)
    assert await two.sandbox_ended("sb-1")
    assert 0 < await r.ttl("t:ended:sb-1") <= 60
    ended: list[tuple[str, str]] = []

    async def on_end(sandbox: str, why: str) -> None:
        ended.append((sandbox, why))

    two.on_end = on_end
    await two.received('{"type": "end", "sandbox": "sb-2", "why": "admin_api", "from": "one"}')
    await two.received('{"type": "end", "sandbox": "sb-3", "from": "two"}')  # its own: ignored
    await two.received("not json")
    assert ended == [("sb-2", "fleet: admin_api")] and await two.sandbox_ended("sb-2")
    await other_client.aclose()


# ------------------------------------------------------------------------------ TLS and AUTH

TLS_IP = "127.0.61.4"  # a TCP listener: run inside `unshare -n` like every integration test


async def test_rediss_with_auth_from_a_password_file(tmp_path: Path) -> None:
    """`rediss://` verifies the server against --state-ca (and its name), AUTH comes from
    --state-password-file; a wrong CA or password is refused."""
    from sandgate.state import open_state
    from tests.support.pki import make_pki

    pki = make_pki(tmp_path / "pki", ["redis.test"], [TLS_IP])
    other = make_pki(tmp_path / "other", ["redis.test"], [TLS_IP])
    password = "test-redis-pw-not-real"
    s = RedisServer(tmp_path / "r", TLS_IP, 6390, password=password,
                    tls=(pki.cert, pki.key, pki.ca_cert)).start()
    pw = tmp_path / "pw"
    pw.write_text(password + "\n")
    try:
        url = f"rediss://{TLS_IP}:6390/0"
        good = open_state(StateConfig.from_url(url, password_file=pw, ca_file=pki.ca_cert,
                                               timeout=2))
        assert await good.ping() is True
        await good.aclose()
        bad_ca = open_state(StateConfig.from_url(url, password_file=pw,
                                                 ca_file=other.ca_cert, timeout=2))
        with pytest.raises(Exception, match=r"(?i)certificate"):
            await bad_ca.ping()
        await bad_ca.aclose()
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-password")
        bad_pw = open_state(StateConfig.from_url(url, password_file=wrong,
                                                 ca_file=pki.ca_cert, timeout=2))
        with pytest.raises(Exception, match=r"(?i)password|auth"):
            await bad_pw.ping()
        await bad_pw.aclose()
    finally:
        s.stop()
