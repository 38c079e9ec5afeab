"""Benchmark: requests per second and latency through Sandgate vs. direct, and decide() cost.

    .venv/bin/python tests/bench/bench_proxy.py [--requests 2000] [--concurrency 16]

Starts a real OpenBao dev server, a real TLS upstream on 127.0.0.2:443 and the real `sandgate`
process, then drives keep-alive HTTPS clients (aiohttp) through the proxy with injection on
every request. Prints figures; asserts nothing. Needs root (binds port 443 on 127.0.0.2).
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))

from sandgate.decision import decide  # noqa: E402
from sandgate.policy.loader import load_policy_dir  # noqa: E402
from sandgate.request import parse_url  # noqa: E402
from tests.integration.conftest import (  # noqa: E402
    ANTHROPIC_KEY,
    NAMES,
    UPSTREAM_IP,
    start_proxy,
    stop_proxy,
)
from tests.support.bao import SeedableVault  # noqa: E402
from tests.support.pki import make_pki  # noqa: E402
from tests.support.upstream import UpstreamServer  # noqa: E402


async def drive(url: str, n: int, conc: int, ssl_ctx: ssl.SSLContext, proxy: str | None,
                headers: dict[str, str]) -> tuple[float, list[float]]:
    lat: list[float] = []
    per = n // conc

    async def worker() -> None:
        conn = aiohttp.TCPConnector(ssl=ssl_ctx, limit=1)
        async with aiohttp.ClientSession(connector=conn) as s:
            for _ in range(per):
                t0 = time.perf_counter()
                async with s.post(url, data=b"{}", proxy=proxy, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"status {r.status}")
                lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, lat


def report(name: str, elapsed: float, lat: list[float]) -> None:
    lat_ms = sorted(x * 1000 for x in lat)
    p = lambda q: lat_ms[min(len(lat_ms) - 1, int(q * len(lat_ms)))]  # noqa: E731
    print(f"{name:<28} {len(lat) / elapsed:8.0f} req/s   p50 {p(0.5):6.2f} ms   "
          f"p99 {p(0.99):6.2f} ms   mean {statistics.mean(lat_ms):6.2f} ms")


def bench_decide(n: int = 200_000) -> None:
    policy = load_policy_dir(ROOT / "policies")
    reqs = [parse_url("POST", "https://api.anthropic.com/v1/messages"),
            parse_url("GET", "https://pypi.org/simple/requests/"),
            parse_url("POST", "https://evil.example/x")]
    t0 = time.perf_counter()
    for i in range(n):
        decide(policy, "coding-agent" if i % 2 else "bash-tool", reqs[i % 3])
    dt = time.perf_counter() - t0
    print(f"{'decide()':<28} {n / dt:8.0f} decisions/s   {dt / n * 1e6:.2f} us each")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    bench_decide()
    tmp = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    pki = make_pki(tmp / "pki", NAMES, [UPSTREAM_IP])
    up = UpstreamServer(UPSTREAM_IP, 443, str(pki.cert), str(pki.key)).start()
    vault = SeedableVault()
    vault.start()
    vault.put_kv2("llm/anthropic", {"api_key": ANTHROPIC_KEY})
    p = start_proxy(tmp, ROOT / "tests/integration/policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--audit", str(tmp / "audit-bench.jsonl"))
    try:
        direct_ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
        proxy_ctx = ssl.create_default_context(cafile=str(p.ca))
        url_direct = f"https://{UPSTREAM_IP}/v1/messages"
        url = "https://api.anthropic.com/v1/messages"
        direct_ctx.check_hostname = False
        n, c = args.requests, args.concurrency
        print(f"{n} POST requests, {c} keep-alive connections, 2 cores shared by all parties")
        el, lat = asyncio.run(drive(url_direct, n, c, direct_ctx, None, {}))
        report("direct to upstream", el, lat)
        el, lat = asyncio.run(drive(url, n, c, proxy_ctx, p.proxy_url("coding-agent"),
                                    {"x-api-key": "sandgate-placeholder-anthropic"}))
        report("through sandgate (inject)", el, lat)
        el, lat = asyncio.run(drive(url, c * 20, c, proxy_ctx, p.proxy_url("coding-agent"),
                                    {"x-api-key": "sandgate-placeholder-anthropic",
                                     "connection": "close"}))
        report("sandgate, new TLS each", el, lat)
    finally:
        stop_proxy(p)
        vault.stop()
        up.stop()


if __name__ == "__main__":
    main()
