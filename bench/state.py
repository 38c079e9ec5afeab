"""The cost of the fleet's shared state per request: Sandgate with and without `--state`.

    .venv/bin/python bench/state.py [--rounds 3] [--requests 1500] [--new-conn 200]

Both variants serve the same policy, in which every request is counted: the identity has an
`rps` limit and the injected secret a `budget` (both far above what the bench sends), so each
request costs the rate script and the budget script (and each new connection the connection
script) with `--state`, and the in-process counting without. A real `redis-server` (Debian's
package) on 127.0.61.3, the upstream and proxies on 127.0.13.x as in bench/run.py (no root).
Prints per variant the median keep-alive req/s (c16), new-connection req/s and the proxy's CPU
ms per request, the ratios state/local, and the added latency per request derived from the
keep-alive figures. Asserts nothing: speed is shown, not tested.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "proxy"), str(HERE), str(ROOT)]

import client  # noqa: E402
import run  # noqa: E402

from tests.support.redis import RedisServer  # noqa: E402

REDIS_IP = "127.0.61.3"
COUNTED = {
    "  api: {vault: secret/data/bench/api, field: key}":
        "  api: {vault: secret/data/bench/api, field: key, budget: {calls: 100000000, per: 1h}}",
    "  bench:\n    rules:": "  bench:\n    limits: {rps: 1000000, burst: 1000000}\n    rules:",
}


def counted_policy(text: str) -> str:
    for old, new in COUNTED.items():
        assert old in text, f"bench/run.py's POLICY changed: {old!r} not found"
        text = text.replace(old, new)
    return text


def measure(v: run.Variant, args: argparse.Namespace) -> dict[str, float]:
    t, proc = v.target, v.proc
    assert t is not None and proc is not None
    cpu0 = run.cpu_seconds(proc.pid)
    out = {"keepalive_c16_rps": asyncio.run(client.keepalive(t, args.requests, 16))}
    out["cpu_ms_per_request"] = (run.cpu_seconds(proc.pid) - cpu0) * 1000 / (args.requests + 16)
    out["new_conn_rps"] = asyncio.run(client.new_connections(t, args.new_conn, 8))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1500, help="keep-alive requests (c16)")
    ap.add_argument("--new-conn", type=int, default=200, help="requests on new connections")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-state-"))
    b = run.Bench(work, args)
    redis = RedisServer(work / "redis", REDIS_IP, 6379)
    variants: list[run.Variant] = []
    try:
        b.pki()
        b.upstream()
        b.sandgate_setup()
        policy = b.policies / "bench.yaml"
        policy.write_text(counted_policy(policy.read_text()))
        redis.start()
        variants = [b.sandgate("local"),
                    b.sandgate("state", "--state", redis.url, "--state-timeout", "1")]
        for rnd in range(args.rounds):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                print(f"round {rnd + 1}/{args.rounds}: {v.name} ...", file=sys.stderr,
                      flush=True)
                for k, x in measure(v, args).items():
                    v.runs.setdefault(k, []).append(x)
        calls = int(redis_info_calls(redis))
    finally:
        b.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {v.name: {k: statistics.median(x) for k, x in v.runs.items()} for v in variants}
    local, state = med["local"], med["state"]
    print(f"{'figure':<24}{'local':>12}{'--state':>12}{'state/local':>14}")
    for key, label in (("keepalive_c16_rps", "keep-alive c16 req/s"),
                       ("new_conn_rps", "new conn req/s"),
                       ("cpu_ms_per_request", "proxy CPU ms/request")):
        print(f"{label:<24}{local[key]:>12.1f}{state[key]:>12.1f}"
              f"{state[key] / local[key]:>14.2f}")
    added = 16 / state["keepalive_c16_rps"] - 16 / local["keepalive_c16_rps"]
    print(f"\nadded time per request at c16: {added * 1000:.2f} ms "
          f"(redis-server ran {calls} scripts and commands)")
    return 0


def redis_info_calls(redis: RedisServer) -> str:
    out = subprocess.run(["redis-cli", "-h", REDIS_IP, "-p", "6379", "info", "stats"],
                         capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        if line.startswith("total_commands_processed:"):
            return line.split(":", 1)[1].strip()
    return "0"


if __name__ == "__main__":
    sys.exit(main())
