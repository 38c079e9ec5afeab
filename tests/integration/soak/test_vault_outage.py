"""Soak: OpenBao hangs, then dies and comes back empty, while 50 clients keep calling."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

import pytest

from tests.integration.soak.conftest import (
    IDENTITIES,
    SECRET_VALUES,
    finish,
    placeholder,
    seed,
    start_soak_proxy,
)
from tests.integration.soak.mix import (
    Case,
    check,
    client_ssl,
    make_case,
    open_tunnel,
    run_worker,
    summary,
)
from tests.support.loadclient import Req, Res

pytestmark = pytest.mark.soak

VAULT_TIMEOUT = 1.0  # VAULT_CLIENT_TIMEOUT the soak proxies run with (conftest)
VAULT_DEADLINE = 2 * VAULT_TIMEOUT + 1.0  # the broker's outer bound on one Vault call
SLACK = 4.0  # scheduling on a loaded two-core machine; a hang would be 30 s (the client's limit)
GRACE = VAULT_DEADLINE + 1.0  # after recovery, a request may still share a failing read
OUTAGE = 6.0  # seconds each outage lasts


def cold_case(secret: str, identity: str, rid: str) -> Case:
    return Case(Req(rid, "POST", f"/v1/messages/{rid}", [("x-api-key", placeholder(secret))],
                    b"{}"), identity, "https", f"{secret}.soak.test", secret, 200, "",
                ("x-api-key", SECRET_VALUES[secret]), True)


def test_openbao_stopped_and_restarted_under_load(tmp_path, soak_vault, soak_pki, recorder,
                                                  plain_recorder):
    """Bounds: about 30 s of load: 40 steady clients (cached secrets and no secret) and 10
    clients needing a secret nobody fetched before the outage; 2 outages of 6 s each.

    1. OpenBao frozen (SIGSTOP: connections accepted, never answered), then thawed: requests
       for the uncached `cold1` get 503 secret_unavailable within the Vault timeout
       (VAULT_CLIENT_TIMEOUT=1, at most 3 s per read) and reach no upstream; after the thaw
       they get 200 with the right credential.
    2. OpenBao killed, then started again empty and seeded again (a dev server keeps nothing):
       `cold2` gets 503 while it is down, then 200; the proxy's AppRole token died with the
       server, so this needs a fresh login, done without restarting the proxy.
    Throughout, requests with cached secrets or none keep getting 200 with exactly the right
    credential; no request takes longer than the Vault deadline (plus scheduling slack); no
    secret in any response, log line or audit event.
    """
    sp = start_soak_proxy(tmp_path, soak_vault, soak_pki)

    marks: dict[str, float] = {}

    async def scenario() -> list[tuple[Case, Res]]:
        ctx = client_ssl(str(sp.proxy.ca))
        port, tokens = sp.proxy.port, sp.tokens
        # Warm the cache: every identity's cached secrets are fetched before the outage.
        warm = [make_case(k, i, f"vo-warm-{i}-{k}") for i in IDENTITIES
                for k in ("inject", "bearer")]
        results = await run_worker(port, tokens, ctx, warm)
        stop = asyncio.Event()
        steady = []
        for w in range(40):
            ident = IDENTITIES[w % 4]
            cases = [make_case(("inject", "bearer", "open", "open_http", "no_rule")[n % 5],
                               ident, f"vo-{w}-{n}") for n in range(2000)]
            steady.append(asyncio.create_task(run_worker(port, tokens, ctx, cases, stop=stop)))

        # the cold clients' tunnels are opened now (a CONNECT fetches no secret), so that
        # during the outage their time goes to requests
        cold = {(secret, w): [cold_case(secret, IDENTITIES[w % 4], f"vo-{secret}-{w}-{n}")
                              for n in range(2000)]
                for secret in ("cold1", "cold2") for w in range(5)}
        opened = {k: await open_tunnel(port, tokens, ctx, cases[0])
                  for k, cases in cold.items()}

        def cold_lane(secret: str, w: int) -> asyncio.Task[list[tuple[Case, Res]]]:
            return asyncio.create_task(run_worker(port, tokens, ctx, cold[(secret, w)],
                                                  stop=stop, tunnels=opened[(secret, w)]))

        lanes = []
        await asyncio.sleep(1.5)
        # 1. frozen
        os.kill(soak_vault._proc.pid, signal.SIGSTOP)
        marks["frozen"] = time.monotonic()
        lanes += [cold_lane("cold1", w) for w in range(5)]
        await asyncio.sleep(OUTAGE)
        marks["thawed"] = time.monotonic()
        os.kill(soak_vault._proc.pid, signal.SIGCONT)
        await asyncio.sleep(4)
        # 2. killed, started again empty, seeded again
        await asyncio.to_thread(soak_vault.stop)
        marks["killed"] = time.monotonic()
        lanes += [cold_lane("cold2", w) for w in range(5)]
        await asyncio.sleep(OUTAGE)
        marks["restarting"] = time.monotonic()
        await asyncio.to_thread(soak_vault.start)
        await asyncio.to_thread(seed, soak_vault)
        marks["seeded"] = time.monotonic()
        await asyncio.sleep(GRACE + 3)
        stop.set()
        for part in await asyncio.gather(*steady, *lanes):
            results += part
        return results

    try:
        started = time.monotonic()
        results = asyncio.run(scenario())
        elapsed = time.monotonic() - started
        print(f"\nvault outage: {summary(results, elapsed)}")
        windows = {"cold1": (marks["frozen"], marks["thawed"]),
                   "cold2": (marks["killed"], marks["restarting"])}
        recovered = {"cold1": marks["thawed"], "cold2": marks["seeded"]}

        def phase(c: Case, r: Res) -> str:
            down_from, down_to = windows[c.kind]
            if r.started >= down_from and r.started + r.latency <= down_to:
                return "down"
            if r.started >= recovered[c.kind] + GRACE:
                return "up"
            return "between"

        def excuse(c: Case, r: Res) -> bool:
            # in transition either answer is right (checked further by `check`: a 200 must
            # carry the right credential, a 503 must not have reached the upstream)
            return (c.kind in windows and phase(c, r) == "between"
                    and (r.status, r.reason_code) in ((200, ""), (503, "secret_unavailable")))

        expected = [(replace(c, status=503, code="secret_unavailable", forwarded=False)
                     if c.kind in windows and phase(c, r) == "down" else c, r)
                    for c, r in results]
        problems = check(expected, {"https": recorder, "http": plain_recorder}, excuse)
        assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:20])

        slow = [(c.req.rid, round(r.latency, 1)) for c, r in results
                if r.latency > VAULT_DEADLINE + SLACK]
        assert not slow, f"requests hung past the Vault deadline: {slow[:10]}"
        counts = {s: {p: sum(1 for c, r in results if c.kind == s and phase(c, r) == p)
                      for p in ("down", "between", "up")} for s in windows}
        print(f"vault outage: cold requests by phase {counts}; proxy log has "
              f"{sp.proxy.logs().count('logged in to Vault')} AppRole logins")
        for secret in windows:
            phases = [phase(c, r) for c, r in results if c.kind == secret]
            assert phases.count("down") >= 3, f"{secret}: too few requests during the outage"
            assert phases.count("up") >= 3, f"{secret}: too few requests after recovery"
        steady = [r for c, r in results if c.kind not in windows]
        assert all(r.status in (200, 403) for r in steady)
    finally:
        logs = finish(sp)
    assert logs.count("logged in to Vault") >= 2, "the proxy did not log in again after restart"
