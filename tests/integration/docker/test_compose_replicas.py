"""Replicas behind HAProxy (docker-compose.replicas.yml + its CI override), end to end.

Three Sandgate replicas share one confdir volume (one CA, one token key) and one policy; Debian's
HAProxy, built from the local base image, balances TCP over them. The agent sandbox identifies
with a proxy token (HAProxy hides its address); all of them count in one Redis (`--state`). Shown:
every replica serves the agent's calls and injects the seeded key; every replica heartbeats into
the shared state and they agree on the policy; stopping one replica mid-run loses at most the
one request a sequential client has in flight; no secret in any log. Bounds: 3 replicas,
30 + 60 requests, about 2 minutes with the image builds cached.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.integration.docker.conftest import REPO
from tests.integration.docker.test_compose import Stack, _find_compose, _sha

pytestmark = [pytest.mark.docker, pytest.mark.integration]

PROJECT = "sandgate-replicas-citest"
FILES = ("docker-compose.replicas.yml", "docker-compose.replicas.ci.yml")
REPLICAS = 3
PLACEHOLDER = "sandgate-placeholder-anthropic"

# N sequential calls, each on a new connection (urllib does not keep alive): one CONNECT each,
# so HAProxy spreads them. Prints one JSON line per call.
LOOP = """
import json, os, sys, time, urllib.request
proxy = open(os.environ["SANDGATE_PROXY_URL_FILE"]).read().strip()
opener = urllib.request.build_opener(urllib.request.ProxyHandler({"https": proxy}))
body = json.dumps({"model": "claude-test", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
for i in range(int(sys.argv[1])):
    req = urllib.request.Request("https://api.anthropic.com/v1/messages", data=body, headers={
        "x-api-key": os.environ["ANTHROPIC_API_KEY"], "content-type": "application/json",
        "anthropic-version": "2023-06-01"})
    t = time.monotonic()
    try:
        with opener.open(req, timeout=20) as r:
            out = {"i": i, "status": r.status, "ok": b"hello from the test upstream" in r.read()}
    except Exception as e:
        out = {"i": i, "status": getattr(e, "code", None), "ok": False, "error": type(e).__name__}
    out["ms"] = round((time.monotonic() - t) * 1000)
    print(json.dumps(out), flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _audit(stack: Stack) -> list[dict[str, object]]:
    events = []
    for line in stack.logs("sandgate").splitlines():
        _, sep, rest = line.partition("| ")
        text = rest if sep else line
        if text.startswith("{"):
            try:
                events.append(json.loads(text))
            except ValueError:
                continue
    return events


def _served(stack: Stack) -> Counter[str]:
    return Counter(str(e["instance"]) for e in _audit(stack)
                   if e.get("event") == "request" and e.get("decision") == "allow"
                   and e.get("identity") == "coding-agent")


@pytest.fixture(scope="module")
def stack(docker_client) -> Iterator[Stack]:
    t0 = time.monotonic()
    build = subprocess.run([str(REPO / "sandbox_images/build-compose.sh"), "--ci", "--replicas"],
                           cwd=REPO, capture_output=True, text=True, timeout=1200)
    if build.returncode != 0:
        pytest.fail(f"build-compose.sh --replicas failed (exit {build.returncode}):\n"
                    f"{build.stdout[-4000:]}\n{build.stderr[-4000:]}", pytrace=False)
    print(f"build-compose.sh --ci --replicas: {time.monotonic() - t0:.1f} s")
    files = [a for f in FILES for a in ("-f", str(REPO / f))]
    s = Stack(compose=[*_find_compose(build.stdout), "-p", PROJECT, *files],
              anthropic_key=f"sk-ant-FAKE-replicas-{secrets.token_hex(16)}",
              openai_key=f"sk-FAKE-replicas-{secrets.token_hex(16)}", env={})
    s.env = {**os.environ, "SANDGATE_DEMO_ANTHROPIC_KEY": s.anthropic_key,
             "SANDGATE_DEMO_OPENAI_KEY": s.openai_key}
    down = ("down", "-v", "--remove-orphans", "--timeout", "5")
    s.run(*down, timeout=180, check=False)
    try:
        t1 = time.monotonic()
        up = s.run("up", "-d", "--scale", f"sandgate={REPLICAS}", timeout=300, check=False)
        if up.returncode != 0:
            pytest.fail(f"compose up failed:\n{s.scrub(up.stderr[-3000:])}\n"
                        f"{s.scrub(s.logs()[-6000:])}", pytrace=False)
        print(f"compose up --scale sandgate={REPLICAS}: {time.monotonic() - t1:.1f} s")
        ids = s.exec("sandgate", "sh", "-c", "cat /var/lib/sandgate/approle/role_id; echo; "
                     "cat /var/lib/sandgate/approle/secret_id")
        assert ids.returncode == 0, "sandgate cannot read its AppRole credentials"
        s.extra_secrets = [v for v in ids.stdout.split() if v]
        yield s
    finally:
        res = s.run(*down, timeout=180, check=False)
        assert res.returncode == 0, f"compose down failed: {s.scrub(res.stderr[-2000:])}"


def _replica_ids(stack: Stack) -> list[str]:
    ids = stack.run("ps", "-q", "sandgate").stdout.split()
    assert len(ids) == REPLICAS, ids
    return ids


def _run_loop(stack: Stack, n: int, pause: float) -> list[dict[str, object]]:
    r = stack.exec("agent", "python", "-c", LOOP, str(n), str(pause), timeout=300)
    assert r.returncode == 0, stack.scrub(r.stderr[-3000:])
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_every_replica_serves_the_agent_with_the_seeded_key(stack: Stack) -> None:
    # HAProxy may still be finding the replicas (Docker DNS, 1 s checks): wait until all three
    # have answered, then count a clean run
    deadline = time.monotonic() + 60
    while len(_served(stack)) < REPLICAS and time.monotonic() < deadline:
        _run_loop(stack, 6, 0)
    assert len(_served(stack)) == REPLICAS, _served(stack)
    before = _served(stack)
    results = _run_loop(stack, 30, 0)
    assert [r["ok"] for r in results] == [True] * 30, results
    after = _served(stack)
    per_replica = {k: after[k] - before.get(k, 0) for k in after}
    assert sum(per_replica.values()) == 30
    assert len([k for k, v in per_replica.items() if v > 0]) == REPLICAS, per_replica
    # the instance names are the replicas' host names (container ids)
    ids = _replica_ids(stack)
    assert all(any(cid.startswith(name) for cid in ids) for name in per_replica), per_replica
    fake = stack.logs("fake-anthropic")
    assert fake.count(f"x-api-key-sha256={_sha(stack.anthropic_key)}") >= 30
    assert _sha(PLACEHOLDER) not in fake, "the placeholder reached the upstream"


def test_the_replicas_share_one_state(stack: Stack) -> None:
    """--state redis://redis:6379/0: every replica (each of its workers) heartbeats into the one
    Redis with the policy version it serves (docs/fleet-state.md)."""
    def live() -> dict[str, str]:
        r = stack.exec("redis", "redis-cli", "--raw", "hgetall", "sandgate:policy")
        assert r.returncode == 0, stack.scrub(r.stderr)
        words = r.stdout.split()
        return dict(zip(words[::2], words[1::2], strict=True))

    deadline = time.monotonic() + 30
    while len({p.split("/")[0] for p in live()}) < REPLICAS and time.monotonic() < deadline:
        time.sleep(1)
    procs = live()
    why = [e for e in _audit(stack) if e.get("event") == "state"][-5:]
    logs = [line for line in stack.logs("sandgate").splitlines() if "state" in line][-10:]
    assert len({p.split("/")[0] for p in procs}) == REPLICAS, (procs, why, logs)
    assert len({v.rpartition("|")[0] for v in procs.values()}) == 1, procs  # they agree
    budgets = stack.exec("redis", "redis-cli", "--raw", "keys", "sandgate:*")
    assert "sandgate:proc:" in budgets.stdout


def test_stopping_a_replica_loses_at_most_what_it_was_serving(stack: Stack) -> None:
    victim = _replica_ids(stack)[0]
    proc = subprocess.Popen([*stack.compose, "exec", "-T", "agent", "python", "-c", LOOP, "60",
                             "0.1"], cwd=REPO, env=stack.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    results: list[dict[str, object]] = []
    try:
        while len(results) < 15:
            line = proc.stdout.readline()
            assert line, f"the loop ended early: {proc.stderr.read() if proc.stderr else ''}"
            results.append(json.loads(line))
        stop = subprocess.run(["docker", "stop", "-t", "40", victim], capture_output=True,
                              text=True, timeout=90)
        assert stop.returncode == 0, stop.stderr
        for line in proc.stdout:
            if line.startswith("{"):
                results.append(json.loads(line))
        assert proc.wait(120) == 0, stack.scrub(proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(results) == 60, "requests were lost without an answer"
    failed = [r for r in results if not r["ok"]]
    # a sequential client has one request in flight: at most that one may fail
    assert len(failed) <= 1, failed
    # after the stop, the two remaining replicas keep serving
    assert all(r["ok"] for r in results[-20:]), results[-20:]
    # in the order they happened: `docker compose logs` prints each replica's lines as a block
    # of its own, so the last lines of its output are not the last events
    requests = sorted((e for e in _audit(stack) if e.get("event") == "request"),
                      key=lambda e: str(e.get("time", "")))
    survivors = {e["instance"] for e in requests[-40:]}
    assert not any(victim.startswith(str(name)) for name in survivors)
    stopped = [e for e in _audit(stack) if e.get("event") == "shutdown"
               and victim.startswith(str(e.get("instance")))]
    assert stopped and stopped[-1].get("unfinished") in (0, None), stopped
    stack.run("start", "sandgate", timeout=120, check=False)  # leave the stack whole


def test_no_secret_in_any_log(stack: Stack) -> None:
    text = stack.logs()
    leaked = [i for i, s in enumerate(stack.secrets) if s in text]
    assert not leaked, f"secret #{leaked} in the compose logs"
