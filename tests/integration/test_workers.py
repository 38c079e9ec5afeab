"""`sandgate run --workers 2`: one port, two mitmproxy processes, one admin API, one drain.

A real supervisor with two real workers (SO_REUSEPORT on one address), real OpenBao, a real TLS
upstream. What must hold across workers: connections are spread over both (the audit's
`worker`), both inject, /metrics adds both up and shows one policy version, a reload reaches
both, a worker killed with SIGKILL is reported and replaced while the other keeps serving, and
SIGTERM drains both (an open stream finishes) and the group exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from sandgate.policy.live import content_hash, policy_files
from sandgate.runner.config import RunConfig
from sandgate.workers.supervisor import Supervisor
from tests.integration.admin_support import (
    OWN_IP,
    Admin,
    copy_policies,
    delta,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
    wait_for,
)
from tests.integration.conftest import ANTHROPIC_KEY, SECRET_VALUES, free_port, stop_proxy
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

PROBE_POLICY = f"""version: v1
identities:
  reload-probe:
    rules:
      - name: probe
        hosts: [upstream.test]
        methods: [GET]
        paths: ["/probe/**"]
        private_cidrs: [{OWN_IP}/32]
"""


SOCKS_PORT = free_port()


@pytest.fixture(scope="module")
def group(tmp_path_factory, vault, own_upstream, pki) -> Iterator[Admin]:
    tmp = tmp_path_factory.mktemp("workers")
    a = start_admin_proxy(tmp, copy_policies(tmp), vault, pki, "--workers", "2",
                          "--socks5", f"127.0.0.1:{SOCKS_PORT}",
                          "--admin-login-limit", "20")  # the wrong tokens tried below
    wait_for(lambda: a.get("/readyz")[0] == 200, 120, "both workers ready")
    yield a
    if a.proxy.proc.poll() is None:
        stop_proxy(a.proxy)
    a.proxy.audit()  # every line parses: no two workers' lines interleaved
    assert_no_secret([a.proxy.logs(), a.proxy.audit_file.read_text()], SECRET_VALUES, "logs")


_TOKENS: dict[tuple[int, str], str] = {}


def _fresh(admin: Admin, identity: str) -> requests.Session:
    """A session on a new connection (a new source port: the kernel picks a worker)."""
    key = (admin.proxy.port, identity)
    if key not in _TOKENS:
        _TOKENS[key] = admin.proxy.token(identity)
    s = requests.Session()
    s.trust_env = False
    url = f"http://{identity}:{_TOKENS[key]}@{admin.proxy.host}:{admin.proxy.port}"
    s.proxies = {"https": url, "http": url}
    s.verify = str(admin.proxy.ca)
    return s


def _requests(admin: Admin, n: int, **match: str) -> list[dict] | None:
    """The `request` audit events with these fields, once there are at least n of them."""
    events = [e for e in admin.proxy.audit() if e["event"] == "request"
              and all(e.get(k) == v for k, v in match.items())]
    return events if len(events) >= n else None


def _readyz_if(admin: Admin, status: int) -> tuple[int, dict] | None:
    answer = admin.get("/readyz")
    return answer if answer[0] == status else None


def _workers(admin: Admin) -> dict[str, dict]:
    status, body = admin.get("/readyz")
    assert status == 200, body
    return body["workers"]


def test_connections_spread_over_both_workers_and_both_inject(group, own_upstream):
    before_seen = len(own_upstream.seen)
    m0 = group.metrics()
    n = 30
    for i in range(n):
        with _fresh(group, "coding-agent") as s:
            r = s.post(f"https://api.anthropic.com/v1/messages?i={i}", json={}, timeout=15)
        assert r.status_code == 200, r.text
    seen = [x for x in own_upstream.seen[before_seen:] if x.path == "/v1/messages"]
    assert len(seen) == n and all(x.headers.get("x-api-key") == ANTHROPIC_KEY for x in seen)

    events = wait_for(lambda: _requests(group, n, rule="llm"), 10, "the audit events")
    by_worker = Counter(e["worker"] for e in events)
    assert set(by_worker) == {0, 1}, by_worker  # 30 connections all on one worker: 2^-29
    for e in events:
        assert e["decision"] == "allow" and e["secrets"][0].startswith("anthropic@")
    # the worker id comes right after the event name in every line
    line = [ln for ln in group.proxy.audit_file.read_text().splitlines()
            if '"checkpoint"' not in ln][-1]
    assert line.index('"event"') < line.index('"worker"') < line.index('"identity"')

    m1 = group.metrics()  # one answer that adds both workers up
    assert delta(m0, m1, "sandgate_requests_total", identity="coding-agent", rule="llm",
                 decision="allow") == n
    assert delta(m0, m1, "sandgate_injections_total", secret="anthropic") == n
    assert m1[("sandgate_workers", ())] == 2
    assert m1[("sandgate_workers_running", ())] == 2
    versions = [dict(lbls)["version"] for (name, lbls), v in m1.items()
                if name == "sandgate_policy_info"]
    assert versions == [group.version()]


def test_socks5_listener_is_shared_by_both_workers(group, own_upstream):
    """--socks5 binds with SO_REUSEPORT too: every worker takes SOCKS5 connections."""
    token = group.proxy.token("coding-agent")
    n = 16
    for _ in range(n):
        r = subprocess.run(
            ["curl", "-sS", "--max-time", "15", "--cacert", str(group.proxy.ca),
             "--socks5-hostname", f"127.0.0.1:{SOCKS_PORT}", "--proxy-user",
             f"coding-agent:{token}", "-w", "\n%{http_code}", "-d", "{}",
             "https://api.anthropic.com/v1/messages"], capture_output=True, text=True,
            timeout=30)
        assert r.stdout.rstrip().endswith("200"), r.stdout + r.stderr
    events = wait_for(lambda: _requests(group, n, listener="socks5"), 10,
                      "the SOCKS5 requests")
    assert {e["worker"] for e in events} == {0, 1}  # all 16 on one worker: 2^-15
    assert all(e["secrets"][0].startswith("anthropic@") for e in events)


def test_reload_reaches_every_worker(group):
    (group.policies / "probe.yaml").write_text(PROBE_POLICY)
    want = content_hash(policy_files(group.policies))
    status, body = group.post("/v1/reload")  # the file watchers may have been first: fine
    assert status == 200, body
    assert body["version"] == want and body["outcome"] in ("ok", "unchanged")
    assert set(body["workers"]) == {"0", "1"}
    for w in body["workers"].values():
        assert w["version"] == want and w["outcome"] in ("ok", "unchanged")
    assert all(w["policy_version"] == want for w in _workers(group).values())
    m = group.metrics()
    assert [dict(lbls)["version"] for (name, lbls), _ in m.items()
            if name == "sandgate_policy_info"] == [want]

    n = 20  # every connection, whichever worker takes it, is judged by the new policy
    for i in range(n):
        with _fresh(group, "reload-probe") as s:
            assert s.get(f"https://upstream.test/probe/{i}", timeout=15).status_code == 200
    events = wait_for(lambda: _requests(group, n, identity="reload-probe"), 10,
                      "the probe events")
    assert {e["worker"] for e in events} == {0, 1}
    policy_events = [e for e in group.proxy.audit() if e["event"] == "policy"
                     and e["version"] == want]
    assert {e["worker"] for e in policy_events} == {0, 1}

    # a file change alone reaches both too (each worker watches the directory)
    (group.policies / "probe.yaml").write_text(PROBE_POLICY.replace("/probe/**", "/probe2/**"))
    want2 = content_hash(policy_files(group.policies))
    wait_for(lambda: all(w["policy_version"] == want2 for w in _workers(group).values()), 10,
             "both workers on the changed file")
    assert group.get("/readyz")[1]["policy_version"] == want2


def test_admin_answers_for_the_group(group):
    assert group.get("/healthz", token=None) == (200, {"status": "ok"})
    for method, path in (("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/policy"),
                         ("POST", "/v1/reload"), ("POST", "/v1/tokens")):
        status, body = group.call(method, path, token="wrong",
                                  body={} if method == "POST" else None)
        assert status == 401 and body["error"] == "unauthorized"
    status, doc = group.get("/v1/policy")
    assert status == 200 and "reload-probe" in doc["identities"]
    status, out = group.post("/v1/explain", {"identity": "coding-agent", "method": "POST",
                                             "url": "https://api.anthropic.com/v1/messages"})
    assert status == 200 and out["decision"] == "allow", out
    status, tok = group.post("/v1/tokens", {"identity": "coding-agent", "ttl": "5m"})
    assert status == 200
    with _fresh(group, "coding-agent") as s:  # a token one worker issued works in any worker
        url = f"http://coding-agent:{tok['token']}@{group.proxy.host}:{group.proxy.port}"
        s.proxies = {"https": url}
        assert s.post("https://api.anthropic.com/v1/messages", json={},
                      timeout=15).status_code == 200


def test_a_killed_worker_is_reported_and_replaced(group):
    old = _workers(group)["1"]["pid"]
    os.kill(old, signal.SIGKILL)
    _, body = wait_for(lambda: _readyz_if(group, 503), 10, "/readyz to report the dead worker")
    # "did not answer" (dying), "is not running" (dead), "is starting" (its replacement)
    assert any(r.startswith("worker 1 ") for r in body["reasons"]), body
    assert body["workers"]["0"]["ready"] is True
    for i in range(10):  # the other worker takes every connection meanwhile
        with _fresh(group, "coding-agent") as s:
            assert s.post(f"https://api.anthropic.com/v1/messages?k={i}", json={},
                          timeout=15).status_code == 200
    wait_for(lambda: group.get("/readyz")[0] == 200, 120, "the replacement worker")
    assert _workers(group)["1"]["pid"] != old
    assert f"worker 1 (pid {old}) died (killed by SIGKILL)" in group.proxy.logs()
    m = group.metrics()
    assert m[("sandgate_worker_restarts_total", (("worker", "1"),))] == 1
    assert m[("sandgate_workers_running", ())] == 2


def _established(pids: list[int], port: int) -> dict[int, int]:
    """How many established connections to the proxy port each pid holds (/proc, this netns)."""
    inodes: set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    out: dict[int, int] = {}
    for pid in pids:
        n = 0
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                n += 1
        out[pid] = n
    return out


def test_sigterm_drains_every_worker_and_the_group_exits_0(group, own_upstream):
    up = own_upstream.upstream
    up.sse_release.clear()
    p = group.proxy
    pids = [w["pid"] for w in _workers(group).values()]
    token = p.token("coding-agent")
    clients: list[subprocess.Popen[str]] = []
    try:
        # open slow streams until both workers hold one (each a new connection)
        while len(clients) < 16 and not all(_established(pids, p.port).values()):
            clients.append(subprocess.Popen(
                ["curl", "-sS", "-N", "--max-time", "40", "--proxy", p.url, "--cacert",
                 str(p.ca), "--proxy-user", f"coding-agent:{token}", "-w", "\n%{http_code}",
                 "https://api.anthropic.com/sse"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            time.sleep(0.3)
        held = _established(pids, p.port)
        assert all(held.values()), held
        p.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: group.get("/readyz")[0] == 503, 5, "/readyz to say shutting down")
        assert any("shutting down" in r for r in group.get("/readyz")[1]["reasons"])
        time.sleep(1.0)
        assert p.proc.poll() is None, "the group exited while streams were open"
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
        up.sse_release.set()
        outs = [c.communicate(timeout=30) for c in clients]
        assert p.proc.wait(30) == 0, p.logs()[-3000:]
    finally:
        up.sse_release.set()
        for c in clients:
            if c.poll() is None:
                c.kill()
    for out, err in outs:
        assert "data: first" in out and "data: second" in out, out + err
        assert out.rstrip().endswith("200")
    events = p.audit()
    shutdowns = [e for e in events if e["event"] == "shutdown"]
    assert sorted(e["worker"] for e in shutdowns) == [0, 1]
    assert all(e["drained"] is True and e["unfinished"] == 0 for e in shutdowns)
    sse = [e for e in events if e["event"] == "request" and e.get("path") == "/sse"]
    assert len(sse) == len(clients) and {e["worker"] for e in sse} == {0, 1}


def test_a_worker_that_fails_to_start_fails_the_run(tmp_path):
    """The supervisor stops the others and returns 1 (here: workers given a missing policy
    directory, which the supervisor's own checks would have refused before)."""
    (tmp_path / "policies").mkdir()
    cfg = RunConfig(policies=tmp_path / "policies", confdir=tmp_path / "conf",
                    listen_host="127.0.0.1", listen_port=free_port(),
                    audit_file=tmp_path / "audit.jsonl", drain_timeout=5)
    sup = Supervisor(cfg, 2, ["run", "--policies", str(tmp_path / "missing"), "--listen",
                              f"127.0.0.1:{cfg.listen_port}", "--confdir", str(cfg.confdir),
                              "--audit", str(cfg.audit_file)], "text",
                     env={"VAULT_ADDR": "http://127.0.0.1:9", "VAULT_TOKEN": "x"})
    t = time.monotonic()
    assert asyncio.run(sup.run()) == 1
    assert time.monotonic() - t < 60
    assert not sup.run_dir.exists()
    assert all(w.proc is None for w in sup.workers)
