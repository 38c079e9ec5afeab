"""One phase of bench/run.py, repeated, alternating variants; optionally under py-spy.

    .venv/bin/python bench/focus.py --phase download --only mitmdump,sandgate --rounds 5
    .venv/bin/python bench/focus.py --phase new_conn --only sandgate --profile /tmp/prof

For profiling and for before/after comparisons of one change: the same parts as bench/run.py
(same upstream, policy, clients); each round measures every variant back to back and the ratios
printed are medians of per-round ratios against the first variant named in --only (the machine
may be shared: absolute figures move, ratios within a round much less). With --profile DIR,
`py-spy record` samples each proxy process during the phase and writes DIR/VARIANT.txt
(collapsed stacks) and prints the top frames by own and by total time. Asserts nothing.

`mitm-floor` (bench/mitm_floor.py) is mitmproxy's core intercepting with no addon doing
anything: what every addon on mitmproxy 11 pays. `tunnel-floor` and `tunnel-floor-judged`
(bench/tunnel_floor.py) are the floors of a passthrough path in Python, bare and with
Sandgate's judging; their `-uvloop` twins run on uvloop's loop (uvloop importable, e.g.
`pip install --target DIR uvloop`, DIR on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import client  # noqa: E402
import run  # noqa: E402

PHASES = {
    "download": lambda t, n: client.download(t),
    "new_conn": lambda t, n: client.new_connections(t, n, 8),
    "new_conn_c1": lambda t, n: client.new_connections(t, n, 1),
    "keepalive": lambda t, n: client.keepalive(t, n, 16),
    "c1_keepalive_p50_ms": lambda t, n: _first(client.latency_keepalive(t, n)),
}


async def _first(coro: Any) -> float:
    return float((await coro)[0])


def top(collapsed: Path, n: int = 25) -> str:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        samples += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    out = [f"{samples} samples; own:"]
    out += [f"  {100 * c / samples:5.1f}% {f}" for f, c in own.most_common(n)]
    out.append("total:")
    out += [f"  {100 * c / samples:5.1f}% {f}" for f, c in total.most_common(n)]
    return "\n".join(out)


def floor_variant(b: run.Bench, judged: bool = False, uvloop: bool = False) -> run.Variant:
    """bench/tunnel_floor.py: a bare asyncio CONNECT tunnel, the floor of a Python
    passthrough path; `judged`: with Sandgate's own per-tunnel work (token, decision, address,
    ClientHello SNI, chained audit line); `uvloop`: on uvloop's event loop (it must be
    importable, e.g. `pip install --target DIR uvloop` and DIR on PYTHONPATH)."""
    name = ("tunnel-floor-judged" if judged else "tunnel-floor") + ("-uvloop" if uvloop else "")
    port = run.free_port(run.PROXY_IP)
    cmd = [sys.executable, str(HERE / "tunnel_floor.py"), run.PROXY_IP, str(port)]
    target = run.Target("", 0, run.NAME, str(b.certs.ca_cert), (run.PROXY_IP, port),
                        f"{run.UPSTREAM_IP}:{b.up_port}")
    if judged:
        cmd += ["--sandgate", str(b.confdir(False)), str(b.policies), str(b.work / f"{name}.jsonl"),
                f"{run.TUNNEL_NAME}={run.UPSTREAM_IP}"]
        target = run.Target("", 0, run.TUNNEL_NAME, str(b.certs.ca_cert), (run.PROXY_IP, port),
                            f"{run.TUNNEL_NAME}:{b.up_port}", ("bench", b.token_and_ca(False)[0]))
    env = dict(b.env, FLOOR_UVLOOP="1") if uvloop else None
    proc, log = b.spawn(name, cmd, env=env)
    run.wait_listening(run.PROXY_IP, port, proc, log)
    return run.Variant(name, target, proc)


def mitm_floor_variant(b: run.Bench) -> run.Variant:
    """bench/mitm_floor.py: mitmproxy's core with no addon doing anything, intercepting."""
    conf = b.work / "mitm-floor"
    conf.mkdir()
    port = run.free_port(run.PROXY_IP)
    proc, log = b.spawn("mitm-floor", [sys.executable, str(HERE / "mitm_floor.py"), run.PROXY_IP,
                                       str(port), str(conf), str(b.certs.ca_cert)])
    run.wait_listening(run.PROXY_IP, port, proc, log)
    return run.Variant("mitm-floor", run.Target("", 0, run.NAME,
                                                str(conf / "mitmproxy-ca-cert.pem"),
                                                (run.PROXY_IP, port),
                                                f"{run.UPSTREAM_IP}:{b.up_port}"), proc)


def rsa_variant(b: run.Bench, extra: list[str], checkout: Path | None = None,
                passthrough: bool = False) -> run.Variant:
    """Sandgate with an RSA-2048 confdir CA (what confdirs made before ECDSA have); with
    `checkout`, the code of that other checkout (its proxy/ first on PYTHONPATH): the "before"
    of a before/after comparison in one run."""
    from mitmproxy.certs import CertStore

    name = ("baseline" + ("-passthrough" if passthrough else "")) if checkout else "sandgate-rsa"
    conf = b.work / f"{name}-conf"
    conf.mkdir(mode=0o700)
    b.token_and_ca(False)  # makes the main confdir (its token key) if no variant has yet
    shutil.copy2(b.confdir(False) / "sandgate-token.key", conf / "sandgate-token.key")
    CertStore.create_store(conf, "mitmproxy", 2048)
    saved_env = b.env
    b.confdir_override = conf
    if checkout is not None:
        b.env = {**saved_env, "PYTHONPATH": str(checkout / "proxy")}
    try:
        v = b.sandgate(name, *extra, passthrough=passthrough)
    finally:
        b.confdir_override, b.env = None, saved_env
    assert v.target is not None
    if not passthrough:
        v.target = dataclasses.replace(v.target, cafile=str(conf / "mitmproxy-ca-cert.pem"))
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", choices=sorted(PHASES), default="download")
    ap.add_argument("--only", default="mitmdump,sandgate")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=300, help="requests (new_conn, keepalive)")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, default=Path("/work/main"),
                    help="the checkout the variants baseline[-passthrough] run")
    ap.add_argument("--extra", default="", help="extra `sandgate run` options (space-separated)")
    args = ap.parse_args(argv)
    names = args.only.split(",")
    work = Path(tempfile.mkdtemp(prefix="sandgate-focus-"))
    os.chmod(work, 0o755)  # noqa: S103 - squid (user proxy) reads its config under it
    b = run.Bench(work, args)
    try:
        b.pki()
        b.upstream()
        if any(n.startswith(("sandgate", "tunnel-floor-judged")) for n in names):
            b.sandgate_setup()
        extra = args.extra.split()
        makers = {
            "direct": b.direct, "squid": b.squid,
            "mitmdump": lambda: b.mitmdump("mitmdump", False),
            "sandgate": lambda: b.sandgate("sandgate", *extra),
            "sandgate-noreuse": lambda: b.sandgate("sandgate-noreuse", *extra,
                                                   "--upstream-reuse-idle", "0"),
            "sandgate-passthrough": lambda: b.sandgate("sandgate-passthrough", *extra,
                                                       passthrough=True),
        }
        makers["mitm-floor"] = lambda: mitm_floor_variant(b)
        makers["tunnel-floor"] = lambda: floor_variant(b)
        makers["tunnel-floor-judged"] = lambda: floor_variant(b, judged=True)
        makers["tunnel-floor-uvloop"] = lambda: floor_variant(b, uvloop=True)
        makers["tunnel-floor-judged-uvloop"] = lambda: floor_variant(b, True, True)
        makers["sandgate-rsa"] = lambda: rsa_variant(b, extra)
        makers["baseline"] = lambda: rsa_variant(b, extra, args.baseline)
        makers["baseline-passthrough"] = lambda: rsa_variant(b, extra, args.baseline, True)
        variants = [makers[n]() for n in names]
        runs: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for v in variants:  # warm-up: certificates generated, secrets cached
            asyncio.run(PHASES[args.phase](v.target, 20))
        for rnd in range(args.rounds):
            for v in (variants if rnd % 2 == 0 else variants[::-1]):
                spy = None
                if args.profile is not None and v.proc is not None and rnd == 0:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    spy = subprocess.Popen(
                        [str(b.bindir / "py-spy"), "record", "--format", "raw", "-r", "250",
                         "-o", str(args.profile / f"{v.name}.txt"), "--pid", str(v.proc.pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    asyncio.run(asyncio.sleep(1.0))
                c0 = run.cpu_seconds(v.proc.pid) if v.proc else 0.0
                runs[v.name].append(asyncio.run(PHASES[args.phase](v.target, args.n)))
                cpu[v.name].append(run.cpu_seconds(v.proc.pid) - c0 if v.proc else 0.0)
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(30)
    finally:
        b.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = names[0]
    for n in names:
        ratios = [x / y for x, y in zip(runs[n], runs[base], strict=True)]
        cpus = [x / y if y else 0.0 for x, y in zip(cpu[n], cpu[base], strict=True)]
        print(f"{n:<22} {args.phase} median {statistics.median(runs[n]):9.4g}  "
              f"/{base} {statistics.median(ratios):5.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})  CPU s/phase "
              f"{statistics.median(cpu[n]):6.2f} (/{base} {statistics.median(cpus):5.2f})")
    if args.profile is not None:
        for n in names:
            f = args.profile / f"{n}.txt"
            if f.exists():
                print(f"--- {n}\n{top(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
