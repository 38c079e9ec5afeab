"""What reading an LLM call's usage costs per call: Sandgate with and without `llm:` + a budget.

    .venv/bin/python bench/spend.py [--rounds 3] [--requests 1500]

Two Sandgate processes serve the same request (bench/run.py's keep-alive phase at concurrency
16: `POST /v1/messages` with an Anthropic Messages body, answered by bench/upstream.py with a
JSON body carrying `usage`), one under the bench's rule as it is, the other under the same rule
with `llm: {api: anthropic, models, max_tokens, budget}` and a budget counting input and output
tokens and cost (limits far above what the bench spends). So each call of the second is read
strictly (model, cap), re-decided with its model, reserves its worst case, has its answer's
usage read and settles it, in process (no `--state`). Prints the median keep-alive req/s and
the proxy's CPU ms per request of each, and the ratio llm/plain (target: within the rounds'
noise). Upstream and proxies on 127.0.13.x as in bench/run.py (no root). Asserts nothing:
speed is shown, not tested (it only checks that the llm variant read the usage).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "proxy"), str(HERE), str(ROOT)]

import client  # noqa: E402
import run  # noqa: E402

RULE = "        inject: {headers: {x-api-key: \"{{ secrets.api }}\"}}\n"
LLM = ("        llm: {api: anthropic, models: [\"bench*\"], max_tokens: 1024, budget: bench}\n")
BUDGET = ("budgets:\n"
          "  bench: {input_tokens: 1000000000000, output_tokens: 1000000000000, "
          "cost_usd: 1000000000, per: 1h}\n"
          "prices:\n"
          "  - {model: \"bench*\", input: 3, output: 15}\n")


def llm_policy(text: str) -> str:
    """bench/run.py's policy with `llm:` and a budget on its intercepted rule."""
    assert RULE in text and "identities:\n" in text, "bench/run.py's POLICY changed"
    return text.replace(RULE, RULE + LLM, 1).replace("identities:\n", BUDGET + "identities:\n", 1)


def measure(v: run.Variant, args: argparse.Namespace) -> dict[str, float]:
    t, proc = v.target, v.proc
    assert t is not None and proc is not None
    cpu0 = run.cpu_seconds(proc.pid)
    out = {"keepalive_c16_rps": asyncio.run(client.keepalive(t, args.requests, 16))}
    out["cpu_ms_per_request"] = (run.cpu_seconds(proc.pid) - cpu0) * 1000 / (args.requests + 16)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1500, help="keep-alive requests (c16)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-spend-"))
    b = run.Bench(work, args)
    variants: list[run.Variant] = []
    try:
        b.pki()
        b.upstream()
        b.sandgate_setup()
        plain_dir = b.policies
        llm_dir = work / "policies-llm"
        llm_dir.mkdir()
        (llm_dir / "bench.yaml").write_text(llm_policy((plain_dir / "bench.yaml").read_text()))
        variants.append(b.sandgate("plain"))
        b.policies = llm_dir
        variants.append(b.sandgate("llm"))
        b.policies = plain_dir
        for rnd in range(args.rounds):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                print(f"round {rnd + 1}/{args.rounds}: {v.name} ...", file=sys.stderr,
                      flush=True)
                for k, x in measure(v, args).items():
                    v.runs.setdefault(k, []).append(x)
        audit = (work / "llm-audit.jsonl").read_text()
    finally:
        b.stop()
        shutil.rmtree(work, ignore_errors=True)
    # the llm variant really read the usage (else the figure would measure nothing)
    assert '"usage": {"input_tokens": 10, "output_tokens": 20' in audit or (
        '"usage":{"input_tokens":10,"output_tokens":20' in audit), "no usage in the llm audit"
    med = {v.name: {k: statistics.median(x) for k, x in v.runs.items()} for v in variants}
    rng = {v.name: {k: (min(x), max(x)) for k, x in v.runs.items()} for v in variants}
    plain, llm = med["plain"], med["llm"]
    print(f"{'figure':<24}{'plain':>12}{'llm+budget':>12}{'llm/plain':>12}   rounds' range")
    for key, label in (("keepalive_c16_rps", "keep-alive c16 req/s"),
                       ("cpu_ms_per_request", "proxy CPU ms/request")):
        lo_p, hi_p = rng["plain"][key]
        lo_l, hi_l = rng["llm"][key]
        d = 3 if key == "cpu_ms_per_request" else 1  # CPU: tenths of a ms are the signal
        print(f"{label:<24}{plain[key]:>12.{d}f}{llm[key]:>12.{d}f}"
              f"{llm[key] / plain[key]:>12.2f}"
              f"   plain {lo_p:.{d}f}-{hi_p:.{d}f}, llm {lo_l:.{d}f}-{hi_l:.{d}f}")
    added = 16 / llm["keepalive_c16_rps"] - 16 / plain["keepalive_c16_rps"]
    print(f"\nadded time per call at c16: {added * 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
