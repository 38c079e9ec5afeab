"""Soak: 10,000 mixed requests from 50 concurrent keep-alive clients; every answer checked."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.integration.soak.conftest import finish, start_soak_proxy
from tests.integration.soak.mix import check, make_mix, run_all, summary

pytestmark = pytest.mark.soak


def test_ten_thousand_mixed_requests(tmp_path, soak_vault, soak_pki, recorder, plain_recorder):
    """Bounds: 10,000 requests, 50 concurrent clients (4 identities, 10 kinds of request over 6
    hosts, keep-alive tunnels), about 30 s on two cores; every read times out after 30 s.

    Allowed requests (with injection: x-api-key, Bearer, an upstream echoing the key; without:
    https and plain http) must reach the upstream exactly once with exactly their identity's
    credential (or none) and get their own answer back; refused ones (no rule, deny rule,
    another identity's placeholder, an internal address) must carry their code and never reach
    it. No response, log line or audit event holds a secret; the audit has one request event
    per request.
    """
    sp = start_soak_proxy(tmp_path, soak_vault, soak_pki)
    try:
        mix = make_mix("load", workers=50, per_worker=200)
        started, cpu0 = time.monotonic(), sp.cpu_seconds()
        results = asyncio.run(run_all(sp.proxy.port, sp.tokens, str(sp.proxy.ca), mix))
        elapsed, cpu = time.monotonic() - started, sp.cpu_seconds() - cpu0
        # the proxy's own CPU time says more than wall time on a shared machine
        print(f"\nsoak load: {summary(results, elapsed)}; proxy CPU {cpu:.1f} s "
              f"({len(results) / cpu:.0f} requests per CPU second); proxy RSS "
              f"{sp.rss_kib() // 1024} MiB")
        assert len(results) == 10_000
        problems = check(results, {"https": recorder, "http": plain_recorder})
        assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:20])
        ids = {c.req.rid for c, _ in results}
        load_seen = {k for r in (recorder, plain_recorder) for k in r.seen if k.startswith("load-")}
        assert load_seen <= ids
        assert not [k for r in (recorder, plain_recorder) for k in r.dupes if k in ids]
        assert recorder.anonymous == 0 and plain_recorder.anonymous == 0
    finally:
        finish(sp)
    events = [json.loads(line) for line in sp.proxy.audit_file.read_text().splitlines() if line]
    requests = [e for e in events if e.get("event") == "request"]
    assert len(requests) == 10_000, f"{len(requests)} request audit events for 10,000 requests"
