"""Pure parts of `sandgate run --workers N`: merging metrics, readiness and reloads of workers,
the worker's audit lines, the shared port, the admin front and the CLI flags."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sandgate import cli
from sandgate.audit.workerlog import WorkerAuditLog
from sandgate.metrics import Metrics
from sandgate.policy.loader import load_policy_dir
from sandgate.workers import aggregate as A
from sandgate.workers import listen
from sandgate.workers.admin_front import build_front
from sandgate.workers.supervisor import describe_exit

pytestmark = pytest.mark.unit

POLICY = """\
version: v1
secrets:
  k: {vault: secret/data/k, field: v}
identities:
  agent:
    rules:
      - {name: api, hosts: [api.example.com], inject: {headers: {x-key: "{{ secrets.k }}"}}}
"""


def _metrics(tmp_path: Path, version: str, requests: int, open_conns: int,
             draining: int = 0) -> str:
    d = tmp_path / f"p{version}{requests}"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(d)
    m = Metrics(lambda: policy)
    for _ in range(requests):
        m.on_audit("request", {"identity": "agent", "rule": "api", "decision": "allow",
                               "duration_ms": 20, "secrets": ["k@1"]})
    m.open_connections.set_function(lambda: open_conns)
    m.draining.set(draining)
    m.policy_swapped(version, 1000.0 + requests)
    return m.render().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_merge_adds_counters_histograms_and_gauges_in_progress(tmp_path):
    a = _metrics(tmp_path, "v1", 3, 2)
    b = _metrics(tmp_path, "v1", 4, 5, draining=1)
    out = _samples(A.merge([a, b], "v1").decode())
    key = (("code", "none"), ("decision", "allow"), ("identity", "agent"), ("rule", "api"))
    assert out[("sandgate_requests_total", key)] == 7
    assert out[("sandgate_injections_total", (("secret", "k"),))] == 7
    assert out[("sandgate_request_duration_seconds_count", (("decision", "allow"),))] == 7
    assert out[("sandgate_request_duration_seconds_bucket",
                (("decision", "allow"), ("le", "0.025")))] == 7
    assert out[("sandgate_open_client_connections", ())] == 7
    assert out[("sandgate_draining", ())] == 1  # the largest, not the sum
    assert out[("sandgate_policy_loaded_timestamp_seconds", ())] == 1004.0
    sa, sb = _samples(a), _samples(b)
    created = ("sandgate_requests_created", key)
    assert out[created] == min(sa[created], sb[created])


def test_merge_shows_one_policy_version(tmp_path):
    a = _metrics(tmp_path, "old", 1, 0)
    b = _metrics(tmp_path, "new", 2, 0)
    tracker = A.VersionTracker("old")
    versions = [A.policy_version(t) for t in (a, b)]
    assert versions == ["old", "new"]
    shown = tracker.observe(versions)  # mid-reload: the workers disagree
    assert shown == "old"
    info = [k for k in _samples(A.merge([a, b], shown).decode())
            if k[0] == "sandgate_policy_info"]
    assert info == [("sandgate_policy_info", (("version", "old"),))]
    assert tracker.observe(["new", "new"]) == "new"  # every worker swapped
    assert tracker.observe([]) == "new" and tracker.observe([None]) == "new"


def _view(i: int, status: int = 200, **body: Any) -> A.WorkerView:
    return A.WorkerView(i, 100 + i, True, True,
                        (status, {"ready": status == 200, "reasons": [],
                                  "policy_version": "v", **body}))


def test_readiness_needs_every_worker():
    t = A.VersionTracker("v")
    r = A.readiness([_view(0), _view(1)], t, draining=False)
    assert r.ready and r.body["reasons"] == [] and r.body["policy_version"] == "v"
    assert r.body["workers"]["1"] == {"pid": 101, "ready": True, "policy_version": "v"}

    r = A.readiness([_view(0), A.WorkerView(1, None, False, False)], t, draining=False)
    assert not r.ready and r.body["reasons"] == [
        "worker 1 is not running (it is being restarted)"]
    r = A.readiness([_view(0), A.WorkerView(1, 7, True, False)], t, draining=False)
    assert r.body["reasons"] == ["worker 1 is starting"]
    r = A.readiness([_view(0), A.WorkerView(1, 7, True, True, error="TimeoutError")], t,
                    draining=False)
    assert r.body["reasons"] == ["worker 1 did not answer: TimeoutError"]
    r = A.readiness([_view(0, 503, reasons=["vault: down"]), _view(1)], t, draining=False)
    assert r.body["reasons"] == ["worker 0: vault: down"]
    r = A.readiness([_view(0, policy_reload_problems=["a.yaml:3: bad"]), _view(1)], t,
                    draining=False)
    assert r.ready and r.body["policy_reload_problems"] == ["a.yaml:3: bad"]
    r = A.readiness([_view(0, 503, reasons=["shutting down"]), _view(1)], t, draining=True)
    assert not r.ready
    assert r.body["reasons"] == ["shutting down: not accepting new connections"]


def test_combine_reloads():
    t = A.VersionTracker("v0")
    ok = {"outcome": "ok", "version": "v1", "previous": "v0", "problems": []}
    same = {"outcome": "unchanged", "version": "v1", "previous": "v1", "problems": []}
    status, body = A.combine_reloads({0: (200, ok), 1: (200, same)}, t)
    assert status == 200 and body["outcome"] == "ok" and body["version"] == "v1"
    assert body["previous"] == "v0" and set(body["workers"]) == {"0", "1"}

    bad = {"outcome": "error", "version": "v1", "previous": "v1", "problems": ["x.yaml:1: y"]}
    status, body = A.combine_reloads({0: (422, bad), 1: (422, bad)}, t)
    assert status == 422 and body["outcome"] == "error" and body["problems"] == ["x.yaml:1: y"]

    status, body = A.combine_reloads({0: (200, same), 1: "not running"}, t)
    assert status == 200 and body["outcome"] == "unchanged"
    assert body["workers"]["1"]["outcome"] == "not_running"
    status, body = A.combine_reloads({0: "not running"}, t)
    assert status == 422 and body["problems"] == ["no worker is running"]


def test_worker_audit_lines_name_the_worker_and_are_whole(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = WorkerAuditLog(path, 3)
    seen: list[dict[str, Any]] = []
    log.add_listener(lambda e, f: seen.append(f))
    log.emit("request", identity="a", path="/" + "x" * 100_000)
    log.emit("shutdown", drained=True)
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(ln)["worker"] for ln in lines] == [3, 3]
    assert list(json.loads(lines[0]))[:4] == ["time", "event", "worker", "identity"]
    assert seen[0]["worker"] == 3
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_worker_audit_write_failure_marks_the_log_unhealthy():
    log = WorkerAuditLog(Path("/dev/full"), 0)
    with pytest.raises(OSError) as e:
        log.emit("request", identity="a")
    assert e.value.errno == errno.ENOSPC and not log.healthy
    log.close()


async def test_reserve_binds_the_address_the_workers_share():
    """The supervisor's bind: workers (SO_REUSEPORT, mitm/speedups/sharedport.py) join it, a
    program without SO_REUSEPORT cannot take the port, an address not of this host is a clear
    error."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reserved = listen.reserve("127.0.0.1", port)
    servers = []
    try:
        for _ in range(2):
            servers.append(await asyncio.start_server(lambda r, w: None, "127.0.0.1", port,
                                                      reuse_port=True))
        with socket.socket() as other, pytest.raises(OSError):  # a program without it
            other.bind(("127.0.0.1", port))
        with pytest.raises(ValueError, match="cannot bind"):  # not an address of this host
            listen.reserve("192.0.2.1", port)
    finally:
        for s in servers:
            s.close()
        reserved.close()


def test_exit_status_is_described_for_the_log():
    assert describe_exit(0) == "exit status 0"
    assert describe_exit(1) == "exit status 1"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def test_default_workers_is_the_usable_cores():
    assert listen.default_workers() == len(os.sched_getaffinity(0))


def test_cli_workers_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--policies", "policies", "--workers", "0"])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["run", "--policies", "p", "--workers", "3"])
    assert args.workers == 3 and args.worker_id is None
    assert cli.build_parser().parse_args(["run", "--policies", "p"]).workers is None


class FakeSupervisor:
    def __init__(self, ready: bool = True, worker: bool = True) -> None:
        self.ready = ready
        self.worker = worker
        self.asked: list[tuple[str, str, bytes | None]] = []

    async def readiness(self) -> A.Readiness:
        return A.Readiness(self.ready, {"ready": self.ready, "reasons": []})

    async def metrics(self) -> bytes:
        return b"sandgate_workers 2.0\n"

    async def reload_all(self) -> tuple[int, dict[str, Any]]:
        return 200, {"outcome": "ok"}

    async def end_sandbox_all(self, sandbox: str) -> tuple[int, dict[str, Any]]:
        self.asked.append(("DELETE", sandbox, None))
        return 202, {"sandbox": sandbox, "revoked": 1, "pending": 1}

    async def ask_one(self, method: str, path: str, body: bytes | None,
                      content_type: str | None) -> tuple[int, bytes, str] | None:
        self.asked.append((method, path, body))
        return (200, b'{"from": "worker"}', "application/json") if self.worker else None


async def test_front_auth_and_routing():
    sup = FakeSupervisor()
    c = TestClient(TestServer(build_front(sup, "tok")))  # type: ignore[arg-type]
    await c.start_server()
    h = {"Authorization": "Bearer tok"}
    try:
        assert (await c.get("/healthz")).status == 200
        for path in ("/readyz", "/metrics", "/v1/policy"):
            r = await c.get(path, headers={"Authorization": "Bearer nope"})
            assert r.status == 401 and (await r.json())["error"] == "unauthorized"
        assert (await c.get("/readyz", headers=h)).status == 200
        assert await (await c.get("/metrics", headers=h)).read() == b"sandgate_workers 2.0\n"
        assert (await (await c.post("/v1/reload", headers=h)).json()) == {"outcome": "ok"}
        r = await c.post("/v1/tokens", headers=h, json={"identity": "a"})
        assert r.status == 200 and (await r.json()) == {"from": "worker"}
        assert sup.asked == [("POST", "/v1/tokens", b'{"identity": "a"}')]
        sup.ready, sup.worker = False, False
        assert (await c.get("/readyz", headers=h)).status == 503
        assert (await c.get("/v1/policy", headers=h)).status == 503
    finally:
        await c.close()


async def test_front_serves_admin_open_paths_without_the_token():
    """--admin-open reaches the supervisor's admin listener as it does the single process's."""
    sup = FakeSupervisor()
    front = build_front(sup, "tok", frozenset({"/readyz", "/metrics"}))  # type: ignore[arg-type]
    c = TestClient(TestServer(front))
    await c.start_server()
    try:
        assert (await c.get("/readyz")).status == 200
        assert await (await c.get("/metrics")).read() == b"sandgate_workers 2.0\n"
        assert (await c.get("/v1/policy")).status == 401
        assert (await c.post("/v1/reload")).status == 401
    finally:
        await c.close()
    with pytest.raises(ValueError, match="cannot be served without a token"):
        build_front(sup, "tok", frozenset({"/v1/tokens"}))  # type: ignore[arg-type]


def test_merge_keeps_the_replica_info_at_one():
    info = ('# HELP sandgate_info Always 1\n# TYPE sandgate_info gauge\n'
            'sandgate_info{instance="r1",version="1"} 1.0\n')
    text = A.merge([info, info], "v").decode()
    assert 'sandgate_info{instance="r1",version="1"} 1.0' in text


async def test_front_ends_a_sandbox_in_every_worker():
    """DELETE /v1/sandboxes/{id} on the group's admin listener reaches the supervisor's fan-out
    (each worker holds its own leases), behind the token like every other /v1 endpoint."""
    sup = FakeSupervisor()
    c = TestClient(TestServer(build_front(sup, "tok")))  # type: ignore[arg-type]
    await c.start_server()
    try:
        assert (await c.delete("/v1/sandboxes/sbx-1")).status == 401
        r = await c.delete("/v1/sandboxes/sbx-1", headers={"Authorization": "Bearer tok"})
        assert r.status == 202 and (await r.json())["pending"] == 1
        assert sup.asked == [("DELETE", "sbx-1", None)]
    finally:
        await c.close()


async def test_end_sandbox_fans_out_and_waits_for_every_worker():
    from sandgate.workers.supervisor import Supervisor

    class W:
        def __init__(self, wid: int, running: bool) -> None:
            self.id, self.running, self.started = wid, running, True

    calls: list[tuple[int, str, str]] = []

    async def fake_json(w: Any, method: str, path: str, timeout: float = 0) -> Any:
        calls.append((w.id, method, path))
        return 200, {"revoked": 2, "pending": 0}

    sup = Supervisor.__new__(Supervisor)
    sup.workers = [W(0, True), W(1, True)]  # type: ignore[assignment]
    sup._json = fake_json  # type: ignore[method-assign]
    status, body = await sup.end_sandbox_all("a/b")
    assert status == 200 and body["revoked"] == 4 and body["workers_unanswered"] == 0
    path = "/v1/sandboxes/a%2Fb"  # one path segment, whatever the id holds
    assert sorted(calls) == [(0, "DELETE", path), (1, "DELETE", path)]
    sup.workers = [W(0, True), W(1, False)]  # type: ignore[assignment]
    status, body = await sup.end_sandbox_all("x")
    assert status == 202 and body["workers_unanswered"] == 1


class _Proc:
    def poll(self) -> None:
        return None


def test_a_grant_copy_is_asked_again_of_a_worker_that_timed_out(monkeypatch) -> None:
    """What must reach every worker (a remembered approval's grant, approvals/fanout.py) is not
    dropped on one control-socket timeout under load: that worker is asked again; one that never
    answers is named (found in CI: --workers 2 under load, a grant lost, the next request in its
    scope held again and timed out with 403)."""
    from sandgate.workers import supervisor as S

    sup = S.Supervisor.__new__(S.Supervisor)
    sup.workers = [S._Worker(i, Path(f"/nonexistent/{i}"), proc=_Proc(), started=True)  # type: ignore[arg-type]
                   for i in range(3)]
    calls: dict[int, int] = {0: 0, 1: 0, 2: 0}

    async def call(w, method, path, body=None, content_type=None, timeout=5.0, extra=None):
        calls[w.id] += 1
        if w.id == 1 and calls[1] == 1:
            raise TimeoutError  # slow once
        if w.id == 2:
            raise TimeoutError  # never answers
        return 200, b"{}", "application/json"

    monkeypatch.setattr(sup, "_call", call)
    missed = asyncio.run(sup.tell_all("POST", "/v1/approvals/ap_x/grant", b"{}"))
    assert missed == [2]
    assert calls == {0: 1, 1: 2, 2: 3}


def test_the_control_sockets_fit_in_a_unix_address_whatever_tmpdir(tmp_path, monkeypatch):
    """A TMPDIR so deep that worker-N.sock would not fit in sun_path: the sockets go under
    /tmp instead (a worker would fail with "AF_UNIX path too long"); a short TMPDIR is used."""
    from sandgate.workers.control import MAX_SOCKET_PATH, make_run_dir, socket_path

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    run_dir = make_run_dir(16)
    try:
        assert run_dir.parent == Path("/tmp"), run_dir
        assert len(os.fsencode(socket_path(run_dir, 15))) <= MAX_SOCKET_PATH
        assert run_dir.stat().st_mode & 0o777 == 0o700
        assert not list(deep.iterdir())  # the first try is not left behind
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(socket_path(run_dir, 15)))
    finally:
        shutil.rmtree(run_dir)
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # tmp_path may be deep itself
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        assert make_run_dir(2).parent == short
    finally:
        shutil.rmtree(short)
