"""Sandgate's benchmark: the same load client against direct HTTPS, squid, mitmdump and Sandgate.

    .venv/bin/python bench/run.py [--rounds 3] [--requests 3000] [--json bench/results.json]

Needs squid (Debian package `squid`: bench/setup.sh installs it) and the project's venv (mitmdump,
the OpenBao `bao` binary). Everything listens on 127.0.13.x; no root needed (as root, squid drops
to the `proxy` user). Prints a table (median, min-max of the rounds) and the ratios, and writes the
figures as JSON. Asserts nothing: speed is shown, not tested.

Variants (each started once, measured every round, in alternating order):
  direct              TLS straight to the upstream
  squid               squid's CONNECT tunnel
  mitmdump            plain `mitmdump -q` intercepting (the venv's mitmproxy)
  mitmdump+header     the same with an addon adding a header to every request
  sandgate            policy, token identity, header injection from a warm secret cache, audit to
                      a file, response scrubbing
  sandgate-passthrough a `passthrough: true` rule (SNI checked, then a tunnel)
  sandgate-workers2   `sandgate run --workers 2` (when this checkout's CLI offers it)
  sandgate-noreuse    sandgate with `--upstream-reuse-idle 0`: every client connection dials its
                      own upstream connection (when this checkout's CLI offers the option)
  mitm-floor          mitmproxy's core with no addon (bench/mitm_floor.py): the floor of any
                      mitmproxy addon

Before and after in one run: `--baseline-python PY --baseline-src DIR` adds mitmdump@base,
mitm-floor@base and sandgate@base, the same three run by another interpreter (an environment
with the older mitmproxy and Sandgate's dependencies) from another checkout of Sandgate (DIR, its
proxy/ on PYTHONPATH), measured in the same rounds, and prints X/X@base for each figure:

    .venv/bin/python bench/run.py --baseline-python /tmp/old/bin/python --baseline-src /tmp/old-src

Figures per variant: keep-alive req/s at concurrency 16 and 64, req/s with a new CONNECT+TLS per
request, SSE time to first event (ms), a 20 MiB download's MiB/s, the proxy's peak RSS and its
growth during the download (MiB), and the proxy's CPU ms per request (utime+stime of the proxy's
processes over the two keep-alive phases).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "proxy"), str(HERE)]

import client  # noqa: E402
from client import Target  # noqa: E402

UPSTREAM_IP = "127.0.13.2"
PROXY_IP = "127.0.13.1"
NAME = "bench.test"
TUNNEL_NAME = "tunnel.bench.test"
SECRET_VALUE = "bench-secret-value-not-a-real-key-5e1f"
CLK_TCK = os.sysconf("SC_CLK_TCK")

FIGURES = {  # key: (label, unit, higher is better)
    "keepalive_c16_rps": ("keep-alive c16", "req/s", True),
    "keepalive_c64_rps": ("keep-alive c64", "req/s", True),
    "new_conn_rps": ("new CONNECT+TLS", "req/s", True),
    "new_conn_cpu_ms": ("CPU/new conn", "ms", False),
    "c1_keepalive_p50_ms": ("c1 keep-alive p50", "ms", False),
    "c1_keepalive_p99_ms": ("c1 keep-alive p99", "ms", False),
    "c1_new_conn_p50_ms": ("c1 new conn p50", "ms", False),
    "c1_new_conn_p99_ms": ("c1 new conn p99", "ms", False),
    "sse_first_event_ms": ("SSE 1st event", "ms", False),
    "download_mib_s": ("20 MiB download", "MiB/s", True),
    "download_rss_growth_mib": ("RSS growth dl", "MiB", False),
    "peak_rss_mib": ("peak RSS", "MiB", False),
    "cpu_ms_per_request": ("CPU/request", "ms", False),
}
PROXY_ONLY = {"download_rss_growth_mib", "peak_rss_mib", "cpu_ms_per_request", "new_conn_cpu_ms"}
VARIANTS = ["direct", "squid", "mitmdump", "mitmdump+header", "sandgate", "sandgate-passthrough",
            "sandgate-workers2", "sandgate-noreuse", "mitm-floor"]
BASELINE = ["mitmdump", "mitm-floor", "sandgate"]  # run again as NAME@base with --baseline-python
# the figures compared before/after (X/X@base): the targets plus CPU per request
BASELINE_FIGURES = ["keepalive_c16_rps", "keepalive_c64_rps", "new_conn_rps", "new_conn_cpu_ms",
                    "cpu_ms_per_request", "download_mib_s", "c1_keepalive_p50_ms",
                    "sse_first_event_ms"]

POLICY = f"""\
version: v1
secrets:
  api: {{vault: secret/data/bench/api, field: key}}
identities:
  bench:
    rules:
      - name: api
        hosts: [{NAME}]
        ports: [{{port}}]
        methods: [GET, POST]
        paths: [/v1/messages, /sse, /big]
        inject: {{headers: {{x-api-key: "{{{{ secrets.api }}}}"}}}}
        private_cidrs: [{UPSTREAM_IP}/32]
      - name: tunnel
        hosts: [{TUNNEL_NAME}]
        ports: [{{port}}]
        passthrough: true
        private_cidrs: [{UPSTREAM_IP}/32]
"""

HEADER_ADDON = f"""\
def request(flow):
    flow.request.headers["x-api-key"] = {SECRET_VALUE!r}
"""

SQUID_CONF = """\
http_port {listen}
http_access allow all
cache deny all
cache_mem 8 MB
access_log none
cache_store_log none
cache_log {dir}/cache.log
pid_filename {dir}/squid.pid
coredump_dir {dir}
pinger_enable off
shutdown_lifetime 0 seconds
cache_effective_user proxy
dns_v4_first on
"""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], log: Path,
                   timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{proc.args!r} did not listen on {host}:{port}")


# ------------------------------------------------------------------ /proc figures


def tree(pid: int) -> list[int]:
    """pid and its descendants (sandgate --workers forks; squid may)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def status_kib(pid: int, key: str) -> int:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def reset_peak(pid: int) -> None:
    for p in tree(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            pass


# ------------------------------------------------------------------ the parts


@dataclass
class Variant:
    name: str
    target: Target | None  # None: not available
    proc: subprocess.Popen[bytes] | None = None
    note: str = ""
    peak_kib: int = 0
    runs: dict[str, list[float]] = field(default_factory=dict)


class Bench:
    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.vault: Any = None
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "proxy"), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.bindir = Path(sys.executable).parent
        self.tokens: dict[str, tuple[str, Path]] = {}  # confdir -> (token, CA file)
        # bench/focus.py's RSA and baseline variants start Sandgate on a confdir of their own
        self.confdir_override: Path | None = None

    def python(self, base: bool) -> str:
        return str(self.args.baseline_python) if base else sys.executable

    def env_for(self, base: bool) -> dict[str, str]:
        """The baseline's processes import Sandgate from its own checkout, nothing from here."""
        if not base:
            return self.env
        return {**self.env, "PYTHONPATH": str(self.args.baseline_src / "proxy")}

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.work / f"{name}.log"
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                env=env or self.env, cwd=str(cwd or self.work))
        self.procs.append(proc)
        return proc, log

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.vault is not None:
            self.vault.stop()

    def pki(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.support.pki import make_pki

        self.certs = make_pki(self.work / "pki", [NAME, TUNNEL_NAME], [UPSTREAM_IP])

    def upstream(self) -> None:
        self.up_port = free_port(UPSTREAM_IP)
        proc, log = self.spawn("upstream", [sys.executable, str(HERE / "upstream.py"),
                                            UPSTREAM_IP, str(self.up_port),
                                            str(self.certs.cert), str(self.certs.key)])
        wait_listening(UPSTREAM_IP, self.up_port, proc, log)

    def direct(self) -> Variant:
        return Variant("direct", Target(UPSTREAM_IP, self.up_port, NAME,
                                        str(self.certs.ca_cert)))

    def squid(self) -> Variant:
        binary = shutil.which("squid") or "/usr/sbin/squid"
        if not Path(binary).exists():
            raise RuntimeError("squid is not installed: run bench/setup.sh (apt-get install "
                               "squid)")
        d = self.work / "squid"
        d.mkdir()
        os.chmod(d, 0o777)  # noqa: S103 - squid running as root drops to the `proxy` user
        port = free_port(PROXY_IP)
        conf = d / "squid.conf"
        conf.write_text(SQUID_CONF.format(listen=f"{PROXY_IP}:{port}", dir=d))
        proc, log = self.spawn("squid", [binary, "-N", "-f", str(conf)])
        wait_listening(PROXY_IP, port, proc, log)
        return Variant("squid", Target("", 0, NAME, str(self.certs.ca_cert), (PROXY_IP, port),
                                       f"{UPSTREAM_IP}:{self.up_port}"), proc)

    def mitmdump(self, name: str, addon: bool, base: bool = False) -> Variant:
        conf = self.work / name.replace("+", "-").replace("@", "-")
        conf.mkdir()
        port = free_port(PROXY_IP)
        bindir = Path(self.python(base)).parent
        cmd = [str(bindir / "mitmdump"), "-q", "--listen-host", PROXY_IP,
               "--listen-port", str(port), "--set", f"confdir={conf}",
               "--set", f"ssl_verify_upstream_trusted_ca={self.certs.ca_cert}"]
        if addon:
            script = conf / "header_addon.py"
            script.write_text(HEADER_ADDON)
            cmd += ["-s", str(script)]
        proc, log = self.spawn(name, cmd, env=self.env_for(base))
        wait_listening(PROXY_IP, port, proc, log)
        return Variant(name, Target("", 0, NAME, str(conf / "mitmproxy-ca-cert.pem"),
                                    (PROXY_IP, port), f"{UPSTREAM_IP}:{self.up_port}"), proc)

    def mitm_floor(self, name: str, base: bool = False) -> Variant:
        conf = self.work / name.replace("@", "-")
        conf.mkdir()
        port = free_port(PROXY_IP)
        proc, log = self.spawn(name, [self.python(base), str(HERE / "mitm_floor.py"), PROXY_IP,
                                      str(port), str(conf), str(self.certs.ca_cert)],
                               env=self.env_for(base))
        wait_listening(PROXY_IP, port, proc, log)
        return Variant(name, Target("", 0, NAME, str(conf / "mitmproxy-ca-cert.pem"),
                                    (PROXY_IP, port), f"{UPSTREAM_IP}:{self.up_port}"), proc)

    def sandgate_setup(self) -> None:
        from sandgate.secrets.devserver import DevVault

        self.vault = DevVault()
        self.vault.start()
        self.vault.put_kv2("bench/api", {"key": SECRET_VALUE})
        self.policies = self.work / "policies"
        self.policies.mkdir()
        (self.policies / "bench.yaml").write_text(POLICY.replace("{port}", str(self.up_port)))

    def sandgate_cli(self, base: bool = False) -> list[str]:
        return [self.python(base), "-m", "sandgate.cli"]

    def confdir(self, base: bool) -> Path:
        if self.confdir_override is not None:
            return self.confdir_override
        return self.work / ("sandgate-conf-base" if base else "sandgate-conf")

    def token_and_ca(self, base: bool) -> tuple[str, Path]:
        """A token and the CA of this side's confdir, issued by this side's own CLI."""
        conf = self.confdir(base)
        if str(conf) not in self.tokens:
            cli, env = self.sandgate_cli(base), self.env_for(base)
            token = subprocess.run(
                [*cli, "token", "issue", "--confdir", str(conf), "--identity", "bench",
                 "--ttl", "12h"], env=env, check=True, capture_output=True,
                text=True).stdout.strip()
            ca = subprocess.run([*cli, "ca", "--confdir", str(conf)], env=env,
                                check=True, capture_output=True, text=True).stdout
            path = self.work / f"{conf.name}-ca.pem"
            path.write_text(ca)
            self.tokens[str(conf)] = (token, path)
        return self.tokens[str(conf)]

    def sandgate_help(self, base: bool = False) -> str:
        return subprocess.run([*self.sandgate_cli(base), "run", "--help"],
                              env=self.env_for(base), capture_output=True, text=True).stdout

    def sandgate(self, name: str, *extra: str, passthrough: bool = False,
                 base: bool = False) -> Variant:
        if "--workers" not in extra and "--workers" in self.sandgate_help(base):
            extra = ("--workers", "1", *extra)  # one process unless asked: the CLI's default
            # is one worker per core
        token, sandgate_ca = self.token_and_ca(base)
        port = free_port(PROXY_IP)
        env = {k: v for k, v in self.env_for(base).items() if not k.startswith("VAULT_")}
        env.update(VAULT_ADDR=self.vault.addr, VAULT_TOKEN=self.vault.root_token)
        cmd = [*self.sandgate_cli(base), "run", "--policies", str(self.policies),
               "--listen", f"{PROXY_IP}:{port}", "--confdir", str(self.confdir(base)),
               "--audit", str(self.work / f"{name}-audit.jsonl"),
               "--upstream-ca", str(self.certs.ca_cert),
               f"--resolve={NAME}={UPSTREAM_IP}", f"--resolve={TUNNEL_NAME}={UPSTREAM_IP}",
               "--no-watch", "--log-format", "json", *extra]
        proc, log = self.spawn(name, cmd, env=env,
                               cwd=self.args.baseline_src if base else ROOT)
        wait_listening(PROXY_IP, port, proc, log)
        host = TUNNEL_NAME if passthrough else NAME
        cafile = str(self.certs.ca_cert) if passthrough else str(sandgate_ca)
        return Variant(name, Target("", 0, host, cafile, (PROXY_IP, port),
                                    f"{host}:{self.up_port}", ("bench", token)), proc)


# ------------------------------------------------------------------ measuring


def measure(v: Variant, args: argparse.Namespace) -> dict[str, float]:
    t = v.target
    assert t is not None
    pid = v.proc.pid if v.proc is not None else None
    out: dict[str, float] = {}
    cpu0 = cpu_seconds(pid) if pid else 0.0
    out["keepalive_c16_rps"] = asyncio.run(client.keepalive(t, args.requests, 16))
    out["keepalive_c64_rps"] = asyncio.run(client.keepalive(t, args.requests, 64))
    if pid:
        cpu = cpu_seconds(pid) - cpu0
        out["cpu_ms_per_request"] = cpu * 1000 / (2 * args.requests + 16 + 64)
    cpu0 = cpu_seconds(pid) if pid else 0.0
    out["new_conn_rps"] = asyncio.run(client.new_connections(t, args.new_conn, 8))
    if pid:
        out["new_conn_cpu_ms"] = (cpu_seconds(pid) - cpu0) * 1000 / args.new_conn
    p50, p99 = asyncio.run(client.latency_keepalive(t, args.latency))
    out["c1_keepalive_p50_ms"], out["c1_keepalive_p99_ms"] = p50, p99
    p50, p99 = asyncio.run(client.latency_new_connection(t, max(1, args.latency // 4)))
    out["c1_new_conn_p50_ms"], out["c1_new_conn_p99_ms"] = p50, p99
    out["sse_first_event_ms"] = asyncio.run(client.sse_first_event(t, args.sse))
    if pid:
        v.peak_kib = max(v.peak_kib, status_kib(pid, "VmHWM"))
        before = status_kib(pid, "VmRSS")
        reset_peak(pid)
    out["download_mib_s"] = asyncio.run(client.download(t))
    if pid:
        peak = status_kib(pid, "VmHWM")
        v.peak_kib = max(v.peak_kib, peak)
        out["download_rss_growth_mib"] = max(0, peak - before) / 1024
        out["peak_rss_mib"] = v.peak_kib / 1024
    return out


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def paired(results: dict[str, Any], a: str, b: str, key: str) -> list[float]:
    """a/b per round. Each round measures every variant back to back, so a machine that is
    faster in one round than in the next (steal, frequency) cancels out of the ratio; the
    ratio of the medians would compare figures from different rounds."""
    try:
        xs, ys = results[a][key]["runs"], results[b][key]["runs"]
        if len(xs) != len(ys):
            return []
        return [float(x / y) for x, y in zip(xs, ys, strict=True)]
    except (KeyError, TypeError, ZeroDivisionError):
        return []


def ratio(results: dict[str, Any], a: str, b: str, key: str) -> float | None:
    runs = paired(results, a, b, key)
    return statistics.median(runs) if runs else None


def ratios(results: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("keepalive_c16_rps", "keepalive_c64_rps", "new_conn_rps", "cpu_ms_per_request"):
        for name in VARIANTS:
            if name not in ("direct", "mitmdump"):
                out[f"{name}/mitmdump {key}"] = ratio(results, name, "mitmdump", key)
        out[f"sandgate-passthrough/squid {key}"] = ratio(results, "sandgate-passthrough",
                                                         "squid", key)
    out["sandgate-passthrough/squid download_mib_s"] = ratio(results, "sandgate-passthrough",
                                                             "squid", "download_mib_s")
    out["sandgate-passthrough/squid new_conn_cpu_ms"] = ratio(results, "sandgate-passthrough",
                                                              "squid", "new_conn_cpu_ms")
    out["sandgate/mitmdump new_conn_cpu_ms"] = ratio(results, "sandgate", "mitmdump",
                                                     "new_conn_cpu_ms")
    for key in ("new_conn_rps", "new_conn_cpu_ms"):  # what upstream connection reuse gives
        out[f"sandgate/sandgate-noreuse {key}"] = ratio(results, "sandgate", "sandgate-noreuse",
                                                        key)
    for name in ("sandgate", "mitmdump"):
        out[f"{name}/direct download_mib_s"] = ratio(results, name, "direct", "download_mib_s")
    out["sandgate/mitmdump download_mib_s"] = ratio(results, "sandgate", "mitmdump",
                                                    "download_mib_s")
    for key in ("c1_keepalive_p50_ms", "c1_keepalive_p99_ms", "c1_new_conn_p50_ms",
                "c1_new_conn_p99_ms"):
        for name in ("sandgate", "sandgate-passthrough", "mitmdump", "squid"):
            out[f"{name} - direct {key}"] = added(results, name, key)
    for name in BASELINE:  # before/after: this checkout over the baseline's
        if f"{name}@base" in results:
            for key in BASELINE_FIGURES:
                out[f"{name}/{name}@base {key}"] = ratio(results, name, f"{name}@base", key)
    try:
        out["sandgate - direct sse_first_event_ms"] = statistics.median(
            x - y for x, y in zip(results["sandgate"]["sse_first_event_ms"]["runs"],
                                  results["direct"]["sse_first_event_ms"]["runs"], strict=True))
    except (KeyError, ValueError, statistics.StatisticsError):
        out["sandgate - direct sse_first_event_ms"] = None
    return out


def added(results: dict[str, Any], name: str, key: str) -> float | None:
    """Median over rounds of (variant - direct): the latency a proxy adds."""
    try:
        return statistics.median(
            x - y for x, y in zip(results[name][key]["runs"], results["direct"][key]["runs"],
                                  strict=True))
    except (KeyError, ValueError, statistics.StatisticsError):
        return None


def spread(results: dict[str, Any], name: str) -> str:
    """min-max of the per-round ratios behind a ratio's name ("a/b key")."""
    if "/" not in name:
        return ""
    a, rest = name.split("/", 1)
    b, key = rest.split(" ", 1)
    runs = paired(results, a, b, key)
    return f"({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""


def fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def table(results: dict[str, Any], rat: dict[str, float | None]) -> str:
    cols = list(FIGURES)
    head = ["variant"] + [f"{FIGURES[c][0]} ({FIGURES[c][1]})" for c in cols]
    rows = [head, ["---"] * len(head)]
    for name in [*VARIANTS, *(n for n in results if n not in VARIANTS)]:
        r = results.get(name, {})
        if not r.get("available", False):
            rows.append([name, r.get("note", "not available")] + [""] * (len(cols) - 1))
            continue
        cells = [name]
        for c in cols:
            s = r.get(c)
            cells.append("-" if s is None else
                         f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})")
        rows.append(cells)
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    lines.append("Ratios (median of the per-round ratios, min-max): ")
    targets = {
        "sandgate/mitmdump keepalive_c16_rps": ">= 1.5",
        "sandgate-workers2/mitmdump keepalive_c16_rps": ">= 1.8",
        "sandgate-passthrough/squid keepalive_c16_rps": ">= 0.8",
        "sandgate - direct sse_first_event_ms": "<= 15",
        "sandgate/mitmdump download_mib_s": ">= 1.0",
        "sandgate-passthrough/squid new_conn_cpu_ms": "<= 2.0",
        "sandgate - direct c1_keepalive_p50_ms": "<= 1",
    }
    for k, val in rat.items():
        if val is None:
            continue
        goal = f"   (target {targets[k]})" if k in targets else ""
        lines.append(f"  {k:<50} {val:6.2f} {spread(results, k):<12}{goal}")
    return "\n".join(lines)


def version_of(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True).stdout.strip()


def mitmproxy_version(python: str, env: dict[str, str]) -> str:
    return subprocess.run([python, "-c", "from mitmproxy.version import VERSION; print(VERSION)"],
                          capture_output=True, text=True, env=env).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="measure every variant this often")
    ap.add_argument("--requests", type=int, default=3000,
                    help="requests per keep-alive phase (c16 and c64 each)")
    ap.add_argument("--new-conn", type=int, default=300,
                    help="requests with a new CONNECT+TLS each")
    ap.add_argument("--sse", type=int, default=30, help="SSE samples (median)")
    ap.add_argument("--latency", type=int, default=200,
                    help="concurrency-1 keep-alive samples (a quarter as many new connections)")
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--json", type=Path, default=HERE / "results.json")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    ap.add_argument("--baseline-python", type=Path, metavar="PY",
                    help="the interpreter of the 'before' environment (its mitmproxy and "
                         "Sandgate's dependencies): adds mitmdump@base, mitm-floor@base and "
                         "sandgate@base")
    ap.add_argument("--baseline-src", type=Path, metavar="DIR",
                    help="the 'before' checkout of Sandgate (its proxy/ is imported)")
    args = ap.parse_args(argv)
    if (args.baseline_python is None) != (args.baseline_src is None):
        ap.error("--baseline-python and --baseline-src go together")
    if args.baseline_src is not None and not (args.baseline_src / "proxy" / "sandgate").is_dir():
        ap.error(f"--baseline-src {args.baseline_src}: no proxy/sandgate there (a checkout of "
                 "Sandgate, e.g. `git archive REV | tar -x -C DIR`)")
    base_names = ([f"{n}@base" for n in BASELINE if not args.only or n in args.only.split(",")]
                  if args.baseline_python else [])
    wanted = [v for v in VARIANTS if not args.only or v in args.only.split(",")] + base_names
    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    os.chmod(work, 0o755)  # noqa: S103 - squid (user proxy) reads its config under it
    b = Bench(work, args)
    variants: list[Variant] = []
    try:
        b.pki()
        b.upstream()
        makers: dict[str, Callable[[], Variant]] = {
            "direct": b.direct,
            "squid": b.squid,
            "mitmdump": lambda: b.mitmdump("mitmdump", False),
            "mitmdump+header": lambda: b.mitmdump("mitmdump+header", True),
            "sandgate": lambda: b.sandgate("sandgate"),
            "sandgate-passthrough": lambda: b.sandgate("sandgate-passthrough",
                                                       passthrough=True),
            "sandgate-workers2": lambda: (
                b.sandgate("sandgate-workers2", "--workers", "2")
                if "--workers" in b.sandgate_help()
                else Variant("sandgate-workers2", None, note="not available")),
            "sandgate-noreuse": lambda: (
                b.sandgate("sandgate-noreuse", "--upstream-reuse-idle", "0")
                if "--upstream-reuse-idle" in b.sandgate_help()
                else Variant("sandgate-noreuse", None, note="not available")),
            "mitm-floor": lambda: b.mitm_floor("mitm-floor"),
            "mitmdump@base": lambda: b.mitmdump("mitmdump@base", False, base=True),
            "mitm-floor@base": lambda: b.mitm_floor("mitm-floor@base", base=True),
            "sandgate@base": lambda: b.sandgate("sandgate@base", base=True),
        }
        if any(n.startswith("sandgate") for n in wanted):
            b.sandgate_setup()
        for name in wanted:
            variants.append(makers[name]())
        live = [v for v in variants if v.target is not None]
        for rnd in range(args.rounds):
            order = live if rnd % 2 == 0 else live[::-1]
            for v in order:
                print(f"round {rnd + 1}/{args.rounds}: {v.name} ...", file=sys.stderr, flush=True)
                for k, x in measure(v, args).items():
                    v.runs.setdefault(k, []).append(x)
    finally:
        b.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory: {work}", file=sys.stderr)
    results: dict[str, Any] = {}
    for v in variants:
        if v.target is None:
            results[v.name] = {"available": False, "note": v.note}
        else:
            results[v.name] = {"available": True, **{k: summary(x) for k, x in v.runs.items()}}
    rat = ratios(results)
    doc = {
        "meta": {"rounds": args.rounds, "requests": args.requests, "new_conn": args.new_conn,
                 "sse_samples": args.sse, "latency_samples": args.latency,
                 "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                 "python": platform.python_version(),
                 "mitmproxy": mitmproxy_version(sys.executable, b.env),
                 **({"baseline_python": version_of(args.baseline_python),
                     "baseline_mitmproxy": mitmproxy_version(str(args.baseline_python),
                                                             b.env_for(True)),
                     "baseline_src": str(args.baseline_src)} if args.baseline_python else {}),
                 "machine": platform.machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime())},
        "figures": {k: {"label": lab, "unit": u, "higher_is_better": hb}
                    for k, (lab, u, hb) in FIGURES.items()},
        "variants": results,
        "ratios": rat,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results, rat))
    print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
