"""SIGTERM: stop accepting, let open streams finish (up to --drain-timeout), audit, exit 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest

from tests.integration.admin_support import (
    copy_policies,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
    wait_for,
)

pytestmark = pytest.mark.integration


def _sse(proxy) -> subprocess.Popen[str]:
    cmd = ["curl", "-sS", "-N", "--max-time", "30", "--proxy", proxy.url, "--cacert",
           str(proxy.ca), "--proxy-user", f"coding-agent:{proxy.token('coding-agent')}",
           "-w", "\n%{http_code}", "https://api.anthropic.com/sse"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _accepts(proxy) -> bool:
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=1):
            return True
    except OSError:
        return False


def test_sigterm_lets_a_long_stream_finish(tmp_path, vault, own_upstream, pki):
    up = own_upstream.upstream
    up.sse_release.clear()
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki)
    p = a.proxy
    try:
        before = len(own_upstream.seen)
        client = _sse(p)
        wait_for(lambda: any(s.path == "/sse" for s in own_upstream.seen[before:]), 10,
                 "the stream to start")
        time.sleep(0.3)  # the first event is on its way to the client
        p.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not _accepts(p), 5, "the listener to close")
        status, body = a.get("/readyz")
        assert status == 503 and any("shutting down" in r for r in body["reasons"])
        time.sleep(1.0)
        assert p.proc.poll() is None, "exited while a stream was open"
        up.sse_release.set()
        out, err = client.communicate(timeout=20)
        assert p.proc.wait(20) == 0
    finally:
        up.sse_release.set()
        if p.proc.poll() is None:
            p.proc.kill()
    assert "data: first" in out and "data: second" in out, out + err
    assert out.rstrip().endswith("200")
    events = p.audit()
    sse = [e for e in events if e["event"] == "request" and e.get("path") == "/sse"]
    assert len(sse) == 1 and sse[0]["decision"] == "allow" and sse[0]["upstream_status"] == 200
    assert events[-1]["event"] == "shutdown"
    assert events[-1]["drained"] is True and events[-1]["unfinished"] == 0


def test_drain_timeout_cuts_what_is_left(tmp_path, vault, own_upstream, pki):
    up = own_upstream.upstream
    up.sse_release.clear()
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki, "--drain-timeout", "1")
    p = a.proxy
    try:
        before = len(own_upstream.seen)
        client = _sse(p)
        wait_for(lambda: any(s.path == "/sse" for s in own_upstream.seen[before:]), 10,
                 "the stream to start")
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(15) == 0
        assert time.monotonic() - t0 < 6
        client.communicate(timeout=20)
    finally:
        up.sse_release.set()
        if p.proc.poll() is None:
            p.proc.kill()
    last = p.audit()[-1]
    assert last["event"] == "shutdown" and last["drained"] is False and last["unfinished"] == 1


def test_idle_proxy_exits_at_once_and_logs_json(tmp_path, vault, own_upstream, pki):
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki)
    p = a.proxy
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(15) == 0
    assert time.monotonic() - t0 < 5
    # stderr is not a terminal here: every log line is one JSON object
    lines = [ln for ln in p.logs().splitlines() if ln.strip()]
    assert lines
    docs = [json.loads(ln) for ln in lines]
    assert all("event" in d and "level" in d for d in docs)
    assert any("listening" in d["event"] for d in docs)
    assert p.audit()[-1]["event"] == "shutdown"
