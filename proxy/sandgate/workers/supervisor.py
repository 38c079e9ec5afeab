"""The supervisor of `sandgate run --workers N` (N > 1).

Before any worker starts it creates what every worker must share: the confdir with the CA (so
every worker presents the same CA to sandboxes) and the token key (tokens verify in any worker),
and the dev Vault when there is no VAULT_ADDR (cli.py starts it and passes its address on). It
checks the proxy address (listen.reserve), starts the admin front (admin_front.py) if --admin is
given, then starts N workers: `python -m sandgate.cli run <the same arguments> --worker-id K
--worker-dir RUN_DIR`, each a complete proxy with its own mitmproxy master, Vault cache,
policy watcher and Docker event follower.

- Start: the supervisor waits until every worker's listener is up; a worker that exits first,
  or is not up within START_TIMEOUT, stops the others and `sandgate run` exits 1.
- Signals: SIGTERM, SIGINT and SIGHUP are forwarded to every worker (a graceful drain of all of
  them; a second SIGTERM stops them at once; SIGHUP reloads each). The supervisor exits 0 when
  every worker drained and exited 0, else 1. A worker whose supervisor dies gets SIGTERM.
- A worker that dies while serving is logged as an error with its exit status, counted in
  `sandgate_worker_restarts_total{worker}`, shown by /readyz as not running, and started again
  after RESTART_DELAY; the others keep serving meanwhile (its share of new connections goes to
  them: SO_REUSEPORT). A worker that dies CRASH_LOOP times within CRASH_WINDOW seconds is not
  restarted again: every worker is stopped and `sandgate run` exits 1, rather than serving on
  with fewer workers than asked for while nobody notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sandgate import confdir
from sandgate.runner.config import RunConfig
from sandgate.workers import aggregate, listen
from sandgate.workers.admin_front import build_front
from sandgate.workers.control import (
    RUN_ENV,
    SUPERVISOR_ENV,
    TOKEN_ENV,
    make_run_dir,
    socket_path,
)

log = logging.getLogger("sandgate")

START_TIMEOUT = 120.0
RESTART_DELAY = 1.0
CRASH_LOOP = 5
CRASH_WINDOW = 60.0
CONTROL_TIMEOUT = 5.0


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


@dataclass
class _Worker:
    id: int
    socket: Path
    proc: subprocess.Popen[bytes] | None = None
    started: bool = False  # its listener is up
    final: int | None = None  # exit status once it exited during shutdown
    respawn_at: float | None = None
    deaths: deque[float] = field(default_factory=deque)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, cfg: RunConfig, n: int, argv: Sequence[str], log_format: str,
                 env: Mapping[str, str] | None = None, out: IO[bytes] | None = None) -> None:
        self.cfg = cfg
        self.n = n
        self.argv = list(argv)
        self.log_format = log_format
        self.env = dict(env or {})
        self.out = out if out is not None else sys.stdout.buffer
        self.token = secrets.token_urlsafe(32)
        self.run_id = secrets.token_hex(8)  # the audit run: every worker's checkpoints name it
        self.run_dir = make_run_dir(n)
        self.workers = [_Worker(i, socket_path(self.run_dir, i)) for i in range(n)]
        self.stopping = False
        self.failed = False
        self.tracker = aggregate.VersionTracker(cfg.loaded.version if cfg.loaded else "")
        self._out_lock = threading.Lock()
        self._relays: list[threading.Thread] = []  # joined at exit: no audit line lost
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_began: float | None = None
        r = self.registry = CollectorRegistry()
        Gauge("sandgate_workers", "Worker processes asked for (--workers)",
              registry=r).set(n)
        Gauge("sandgate_workers_running", "Worker processes running with their listener up",
              registry=r).set_function(lambda: sum(w.running and w.started
                                                   for w in self.workers))
        self.restarts = Counter("sandgate_worker_restarts", "Workers that died while serving "
                                "and were started again, by worker id", ["worker"], registry=r)

    # ---------------------------------------------------------------------------- processes

    def _spawn(self, w: _Worker) -> None:
        cmd = [sys.executable, "-m", "sandgate.cli", *self.argv, "--worker-id", str(w.id),
               "--worker-dir", str(self.run_dir), "--log-format", self.log_format]
        env = {**os.environ, **self.env, TOKEN_ENV: self.token, SUPERVISOR_ENV: str(os.getpid()),
               RUN_ENV: f"{self.run_id}/{self.n}"}
        relay = self.cfg.audit_file is None
        w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE if relay else None)
        w.started = False
        w.respawn_at = None
        if relay:
            assert w.proc.stdout is not None
            t = threading.Thread(target=self._relay, args=(w.id, w.proc.stdout),
                                 name=f"sandgate-audit-relay-{w.id}", daemon=True)
            t.start()
            self._relays.append(t)
        log.info("sandgate: worker %d started (pid %d)", w.id, w.proc.pid)

    def _join_relays(self) -> None:
        for t in self._relays:
            t.join(10)

    def _relay(self, wid: int, stream: IO[bytes]) -> None:
        """Copy a worker's audit lines to our stdout whole: one line, one write, under a lock."""
        try:
            for line in iter(stream.readline, b""):
                with self._out_lock:
                    self.out.write(line)
                    self.out.flush()
        except (OSError, ValueError) as e:
            # closing our end makes the worker's next audit write fail: it fails closed
            log.error("sandgate: the audit stream (stdout) failed (%s); worker %d's audit "
                      "writes now fail", type(e).__name__, wid)
        finally:
            stream.close()

    def _signal_all(self, sig: signal.Signals) -> None:
        for w in self.workers:
            if w.running:
                assert w.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    def begin_stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if not self.stopping:
            self.stopping = True
            self._stop_began = time.monotonic()
            log.info("sandgate: %s: draining all %d workers", sig.name, self.n)
        self._signal_all(sig)

    def _died(self, w: _Worker, rc: int) -> None:
        assert w.proc is not None
        pid = w.proc.pid
        was_listening = w.started
        w.proc = None
        w.started = False
        if self.stopping:
            # stopped by our signal before it had installed its handlers: it served nothing
            w.final = 0 if rc in (-signal.SIGTERM, -signal.SIGINT) and not was_listening \
                and not self.failed else rc
            if w.final != 0:
                log.error("sandgate: worker %d (pid %d) ended with %s while shutting down",
                          w.id, pid, describe_exit(rc))
            return
        now = time.monotonic()
        w.deaths.append(now)
        while w.deaths and w.deaths[0] < now - CRASH_WINDOW:
            w.deaths.popleft()
        if len(w.deaths) >= CRASH_LOOP:
            log.error("sandgate: worker %d (pid %d) died (%s), %d times in %gs: not restarting "
                      "it; stopping every worker", w.id, pid, describe_exit(rc), len(w.deaths),
                      CRASH_WINDOW)
            self.failed = True
            w.final = rc
            self.begin_stop()
            return
        self.restarts.labels(str(w.id)).inc()
        log.error("sandgate: worker %d (pid %d) died (%s); the other workers keep serving; "
                  "restarting it in %gs", w.id, pid, describe_exit(rc), RESTART_DELAY)
        w.respawn_at = now + RESTART_DELAY

    # ---------------------------------------------------------------------------- control

    async def _call(self, w: _Worker, method: str, path: str, body: bytes | None = None,
                    content_type: str | None = None,
                    timeout: float = CONTROL_TIMEOUT,
                    extra: Mapping[str, str] | None = None) -> tuple[int, bytes, str]:
        headers = {**(extra or {}), "Authorization": f"Bearer {self.token}"}
        if content_type:
            headers["Content-Type"] = content_type
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(w.socket)),
                timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                s.request(method, f"http://worker-{w.id}{path}", data=body,
                          headers=headers) as r:
            return r.status, await r.read(), r.headers.get("Content-Type", "")

    async def _json(self, w: _Worker, method: str, path: str,
                    timeout: float = CONTROL_TIMEOUT) -> tuple[int, dict[str, Any]]:
        import json

        status, raw, _ = await self._call(w, method, path, timeout=timeout)
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"worker {w.id} answered {path} with a non-object")
        return status, doc

    async def _listening(self, w: _Worker) -> bool:
        try:
            _, doc = await self._json(w, "GET", "/worker/status", timeout=2.0)
        except (TimeoutError, OSError, ValueError, aiohttp.ClientError):
            return False
        return bool(doc.get("listener_up"))

    async def readiness(self) -> aggregate.Readiness:
        async def view(w: _Worker) -> aggregate.WorkerView:
            v = aggregate.WorkerView(w.id, w.proc.pid if w.proc else None, w.running,
                                     w.started)
            if v.running and v.started:
                try:
                    v.readyz = await self._json(w, "GET", "/readyz")
                except (TimeoutError, OSError, ValueError, aiohttp.ClientError) as e:
                    v.error = type(e).__name__
            return v

        views = await asyncio.gather(*(view(w) for w in self.workers))
        return aggregate.readiness(views, self.tracker, self.stopping)

    async def metrics(self) -> bytes:
        async def text(w: _Worker) -> str | None:
            if not w.running:
                return None
            try:
                status, raw, _ = await self._call(w, "GET", "/metrics")
            except (TimeoutError, OSError, aiohttp.ClientError):
                return None
            return raw.decode() if status == 200 else None

        texts = [t for t in await asyncio.gather(*(text(w) for w in self.workers)) if t]
        version = self.tracker.observe(aggregate.policy_version(t) for t in texts)
        return aggregate.merge([*texts, generate_latest(self.registry).decode()], version)

    async def reload_all(self) -> tuple[int, dict[str, Any]]:
        async def one(w: _Worker) -> tuple[int, tuple[int, dict[str, Any]] | str]:
            if not (w.running and w.started):
                return w.id, "not running"
            try:
                return w.id, await self._json(w, "POST", "/v1/reload", timeout=60.0)
            except (TimeoutError, OSError, ValueError, aiohttp.ClientError) as e:
                return w.id, (500, {"outcome": "error", "problems": [
                    f"worker {w.id} did not answer the reload ({type(e).__name__})"]})

        answers = dict(await asyncio.gather(*(one(w) for w in self.workers)))
        return aggregate.combine_reloads(answers, self.tracker)

    async def end_sandbox_all(self, sandbox: str) -> tuple[int, dict[str, Any]]:
        """DELETE /v1/sandboxes/{id} on every worker: each holds its own leases. 200 when every
        worker revoked what it held, 202 while any revocation is pending or a worker did not
        answer (it is not done yet; the controller asks again)."""
        path = f"/v1/sandboxes/{quote(sandbox, safe='')}"

        async def one(w: _Worker) -> dict[str, Any] | None:
            if not (w.running and w.started):
                return None
            try:
                status, body = await self._json(w, "DELETE", path, timeout=30.0)
            except (TimeoutError, OSError, ValueError, aiohttp.ClientError):
                return None
            return body if status in (200, 202) else None

        answers = await asyncio.gather(*(one(w) for w in self.workers))
        revoked = sum(int(a.get("revoked", 0)) for a in answers if a)
        pending = sum(int(a.get("pending", 0)) for a in answers if a)
        unanswered = sum(1 for a in answers if a is None)
        body = {"sandbox": sandbox, "revoked": revoked, "pending": pending,
                "workers_unanswered": unanswered}
        return (200 if not pending and not unanswered else 202), body

    async def ask_one(self, method: str, path: str, body: bytes | None,
                      content_type: str | None) -> tuple[int, bytes, str] | None:
        for w in self.workers:
            if w.running and w.started:
                try:
                    return await self._call(w, method, path, body, content_type)
                except (TimeoutError, OSError, aiohttp.ClientError):
                    continue
        return None

    async def ask_all(self, method: str, path: str, body: bytes | None = None,
                      extra: Mapping[str, str] | None = None
                      ) -> list[tuple[int, bytes, str]]:
        """The same request to every running worker, in worker order; those that do not
        answer are left out (approvals: held requests live in the workers)."""
        async def one(w: _Worker) -> tuple[int, bytes, str] | None:
            try:
                return await self._call(w, method, path, body, "application/json",
                                        extra=extra)
            except (TimeoutError, OSError, aiohttp.ClientError):
                return None
        answers = await asyncio.gather(*(one(w) for w in self.workers
                                         if w.running and w.started))
        return [a for a in answers if a is not None]

    async def tell_all(self, method: str, path: str, body: bytes | None = None,
                       attempts: int = 3) -> list[int]:
        """The same request to every running worker until each has answered (a worker whose
        control socket is slow under load is asked again, up to `attempts` times): what must
        reach every worker, such as a remembered approval's grant, is not dropped on one
        timeout. Returns the ids of the workers that never answered, or answered 5xx."""
        async def one(w: _Worker) -> int | None:
            for _ in range(attempts):
                try:
                    status, _raw, _ct = await self._call(w, method, path, body,
                                                         "application/json")
                except (TimeoutError, OSError, aiohttp.ClientError):
                    continue
                if status < 500:
                    return None
            return w.id
        missed = await asyncio.gather(*(one(w) for w in self.workers
                                        if w.running and w.started))
        return [m for m in missed if m is not None]

    async def ask_until(self, method: str, path: str, body: bytes | None = None,
                        extra: Mapping[str, str] | None = None
                        ) -> tuple[int, bytes, str] | None:
        """The request to one worker after another until one answers anything but 404 (the
        worker holding an approval; with a shared store, the first)."""
        for w in self.workers:
            if not (w.running and w.started):
                continue
            try:
                answer = await self._call(w, method, path, body, "application/json",
                                          extra=extra)
            except (TimeoutError, OSError, aiohttp.ClientError):
                continue
            if answer[0] != 404:
                return answer
        return None

    # ---------------------------------------------------------------------------- main

    def _spawn_task(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _wait_started(self, w: _Worker, proc: subprocess.Popen[bytes]) -> None:
        while w.proc is proc and proc.poll() is None:
            if await self._listening(w):
                if w.proc is proc:
                    w.started = True
                    log.info("sandgate: worker %d (pid %d) is listening", w.id, proc.pid)
                return
            await asyncio.sleep(0.1)

    def _start_worker(self, w: _Worker) -> None:
        self._spawn(w)
        assert w.proc is not None
        self._spawn_task(self._wait_started(w, w.proc))

    async def run(self) -> int:
        conf = confdir.ensure_confdir(self.cfg.confdir)
        confdir.ensure_ca(conf)  # once, before any worker: every worker presents this CA
        confdir.token_key(conf)
        reserved = [listen.reserve(self.cfg.listen_host, self.cfg.listen_port)]
        roles = [(f"--role-listen {r}", (h, p)) for r, h, p in self.cfg.role_listens]
        for flag, addr in (("--socks5", self.cfg.socks5), ("--gateway", self.cfg.gateway),
                           ("--transparent", self.cfg.transparent), *roles):
            if addr is None:
                continue
            try:
                reserved.append(listen.reserve(*addr))
            except ValueError as e:
                for s in reserved:
                    s.close()
                raise ValueError(str(e).replace("--listen", flag, 1)) from None
        loop = asyncio.get_running_loop()
        handlers = {signal.SIGTERM: lambda: self.begin_stop(signal.SIGTERM),
                    signal.SIGINT: lambda: self.begin_stop(signal.SIGINT),
                    signal.SIGHUP: lambda: self._signal_all(signal.SIGHUP)}
        for sig, fn in handlers.items():
            loop.add_signal_handler(sig, fn)
        front = None
        try:
            if self.cfg.admin is not None:
                assert self.cfg.admin_token is not None
                front = web_runner = web.AppRunner(
                    build_front(self, self.cfg.admin_token, frozenset(self.cfg.admin_open),
                                self.cfg.admin_users, self.cfg.admin_login_limit),
                    access_log=None,
                    handle_signals=False)
                await web_runner.setup()
                await web.TCPSite(web_runner, *self.cfg.admin).start()
                log.info("sandgate: admin listener at %s:%d (for all %d workers)",
                         self.cfg.admin[0], self.cfg.admin[1], self.n)
            for w in self.workers:
                self._start_worker(w)
            await self._start_phase()
            if not self.stopping:
                log.info("sandgate: all %d workers are listening on %s:%d", self.n,
                         self.cfg.listen_host, self.cfg.listen_port)
            await self._watch()
        finally:
            if not self.stopping:  # an exception here must not orphan workers
                self.begin_stop(signal.SIGTERM)
            await self._reap(force_after=0 if self.failed else None)
            # the workers' last audit lines (shutdown, the closing checkpoint) reach stdout
            # before we exit: their relays end at the EOF of an exited worker's stdout
            await asyncio.to_thread(self._join_relays)
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if front is not None:
                await front.cleanup()
            for sig in handlers:
                loop.remove_signal_handler(sig)
            for s in reserved:
                s.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        bad = [w for w in self.workers if w.final not in (0, None)]
        return 1 if self.failed or bad else 0

    async def _start_phase(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.stopping and not all(w.started for w in self.workers):
            for w in self.workers:
                rc = w.proc.poll() if w.proc is not None else None
                if rc is not None:
                    log.error("sandgate: worker %d (pid %d) failed to start (%s); stopping "
                              "the others", w.id, w.proc.pid if w.proc else 0,
                              describe_exit(rc))
                    self.failed = True
                    self.begin_stop()
                    return
            if time.monotonic() > deadline:
                late = [w.id for w in self.workers if not w.started]
                log.error("sandgate: worker(s) %s not listening after %gs; stopping", late,
                          START_TIMEOUT)
                self.failed = True
                self.begin_stop()
                return
            await asyncio.sleep(0.05)

    async def _watch(self) -> None:
        """Restart workers that die; return once every worker has exited after a stop."""
        while True:
            now = time.monotonic()
            for w in self.workers:
                if w.proc is not None:
                    rc = w.proc.poll()
                    if rc is not None:
                        self._died(w, rc)
                if (w.proc is None and w.respawn_at is not None and now >= w.respawn_at
                        and not self.stopping):
                    self._start_worker(w)
            if self.stopping and not any(w.running for w in self.workers):
                for w in self.workers:
                    if w.proc is not None:
                        self._died(w, w.proc.wait())
                return
            if self.stopping and self._stop_began is not None and \
                    now - self._stop_began > self.cfg.drain_timeout + 15:
                return  # _reap kills what is left
            await asyncio.sleep(0.05)

    async def _reap(self, force_after: float | None = None) -> None:
        """Wait for every worker to exit; kill what is still there after the drain timeout."""
        grace = self.cfg.drain_timeout + 15 if force_after is None else force_after + 10
        deadline = time.monotonic() + grace
        while any(w.running for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for w in self.workers:
            if w.proc is None:
                continue
            if w.proc.poll() is None:
                log.error("sandgate: worker %d (pid %d) did not exit; killing it", w.id,
                          w.proc.pid)
                w.proc.kill()
                self.failed = True
            self._died(w, w.proc.wait())
