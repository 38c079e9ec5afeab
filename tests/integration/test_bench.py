"""bench/run.py keeps working: every variant runs on a tiny load and the JSON has every figure.

No timing is asserted (speed is shown by the bench's figures, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PROXY_ONLY = {"download_rss_growth_mib", "peak_rss_mib", "cpu_ms_per_request", "new_conn_cpu_ms"}


def test_bench_tiny_load_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--rounds", "1", "--requests", "20",
         "--new-conn", "4", "--sse", "2", "--latency", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    figures = set(doc["figures"])
    assert figures == {"keepalive_c16_rps", "keepalive_c64_rps", "new_conn_rps",
                       "sse_first_event_ms", "download_mib_s", "download_rss_growth_mib",
                       "peak_rss_mib", "cpu_ms_per_request", "new_conn_cpu_ms",
                       "c1_keepalive_p50_ms", "c1_keepalive_p99_ms", "c1_new_conn_p50_ms",
                       "c1_new_conn_p99_ms"}
    variants = doc["variants"]
    assert set(variants) == {"direct", "squid", "mitmdump", "mitmdump+header", "sandgate",
                             "sandgate-passthrough", "sandgate-workers2", "sandgate-noreuse",
                             "mitm-floor"}
    for name, v in variants.items():
        if name == "sandgate-workers2" and not v["available"]:
            assert v["note"] == "not available"  # the CLI of this checkout has no --workers
            continue
        assert v["available"], name
        want = figures - PROXY_ONLY if name == "direct" else figures
        assert set(v) - {"available"} == want, name
        for key in want:
            s = v[key]
            assert s["min"] <= s["median"] <= s["max"] and len(s["runs"]) == 1, (name, key)
            assert s["median"] >= 0
            if key.endswith("_rps") or key.endswith("_s"):
                assert s["median"] > 0, (name, key)
    assert doc["ratios"]["sandgate/mitmdump keepalive_c16_rps"] > 0
    assert doc["ratios"]["sandgate-passthrough/squid keepalive_c16_rps"] > 0
    assert "sandgate-passthrough/squid new_conn_cpu_ms" in doc["ratios"]  # squid: 0 ticks
    assert doc["ratios"]["sandgate/direct download_mib_s"] > 0
    assert doc["ratios"]["sandgate/sandgate-noreuse new_conn_rps"] > 0
    assert doc["ratios"]["sandgate - direct c1_keepalive_p50_ms"] is not None
    # the table is printed, with every variant
    for name in variants:
        assert f"| {name} |" in run.stdout


def test_bench_before_and_after_in_one_run(tmp_path: Path) -> None:
    """--baseline-python/--baseline-src run mitmdump, the mitmproxy floor and Sandgate again from
    another environment and checkout (here: this one, whose figures are then both sides'), in
    the same rounds, and give X/X@base for each compared figure."""
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--rounds", "1", "--requests", "20",
         "--new-conn", "4", "--sse", "2", "--latency", "4", "--json", str(out),
         "--only", "direct,mitmdump,mitm-floor,sandgate",
         "--baseline-python", sys.executable, "--baseline-src", str(ROOT)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["variants"]) == {"direct", "mitmdump", "mitm-floor", "sandgate",
                                    "mitmdump@base", "mitm-floor@base", "sandgate@base"}
    assert all(v["available"] for v in doc["variants"].values())
    assert doc["meta"]["baseline_mitmproxy"] == doc["meta"]["mitmproxy"] != ""
    for name in ("mitmdump", "mitm-floor", "sandgate"):
        assert doc["ratios"][f"{name}/{name}@base keepalive_c16_rps"] > 0
        assert doc["ratios"][f"{name}/{name}@base new_conn_rps"] > 0
        assert f"| {name}@base |" in run.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--baseline-python",
                          sys.executable], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "go together" in bad.stderr


def test_focus_runs_the_floors(tmp_path: Path) -> None:
    """bench/focus.py's floors carry real traffic: bench/tunnel_floor.py (a bare asyncio CONNECT
    tunnel, and one doing Sandgate's per-tunnel judging with Sandgate's functions, reached with
    the bench's proxy token and the passthrough host, so a token, decision, address or SNI check
    that refused would fail the run) and bench/mitm_floor.py (mitmproxy's core intercepting)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "focus.py"), "--phase", "new_conn", "--only",
         "tunnel-floor,tunnel-floor-judged,mitm-floor", "--rounds", "1", "-n", "6"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for name in ("tunnel-floor", "tunnel-floor-judged", "mitm-floor"):
        assert any(line.split()[:2] == [name, "new_conn"] for line in lines), run.stdout


def test_spend_bench_runs_and_reads_the_usage() -> None:
    """bench/spend.py keeps working: both variants serve the calls, the `llm:` one reads their
    usage (the script checks its audit), and the ratio line is printed."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "spend.py"), "--rounds", "1", "--requests", "20"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "keep-alive c16 req/s" in run.stdout and "llm/plain" in run.stdout
