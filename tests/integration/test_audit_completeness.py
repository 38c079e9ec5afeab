"""`sandgate audit verify` notices a whole run or a worker's share deleted (issue 34).

Three real `sandgate run`s write one audit file one after the other (with the suite's
OpenBao, its TLS upstream and curl through the proxy): one process, then `--workers 2`, then
one process again. Then whole runs, and one worker's share, are deleted from a copy of the
file, and `sandgate audit verify --public-key` (the confdir's key, pinned) must exit 3 and say
what is missing; the intact file verifies, with the anchor the proxy kept in its confdir.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import HERE, SANDGATE, curl, split_status, start_proxy, stop_proxy

pytestmark = pytest.mark.integration

LISTEN = "127.0.66.3"


@dataclass
class History:
    audit: Path
    public: Path
    anchor: Path | None  # the confdir's anchor of the file (None: the proxy kept none)
    lines: list[tuple[bytes, dict[str, object]]]
    spans: list[range]  # the line numbers (0-based) of each run, oldest first
    runs: list[str]  # their run ids, as their checkpoints name them


def _wait_for_workers(audit: Path, run_start: int, n: int) -> None:
    """Until each of the n workers has written its first line (a worker stopped before it has
    opened its log would be a worker of the run with no chain)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        seen = {json.loads(x).get("worker") for x in audit.read_bytes().splitlines()[run_start:]}
        if set(range(n)) <= seen:
            return
        time.sleep(0.2)
    raise AssertionError(f"not every worker wrote to {audit}")


@pytest.fixture(scope="module")
def history(tmp_path_factory, vault, upstream, plain_upstream, pki) -> History:
    tmp = tmp_path_factory.mktemp("audit-history")
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}
    starts = []
    for extra in ((), ("--workers", "2"), ()):
        audit = tmp / "audit.jsonl"  # start_proxy's --audit: every run appends to it
        start = len(audit.read_bytes().splitlines()) if audit.exists() else 0
        starts.append(start)
        p = start_proxy(tmp, HERE / "policies", env, pki, "--audit-checkpoint-lines", "3",
                        *extra, listen_host=LISTEN)
        try:
            if extra:
                _wait_for_workers(p.audit_file, start, 2)
            token = p.token("bash-tool")
            for i in range(3):
                r = curl(p, "bash-tool", f"https://upstream.test/docs/{i}", token=token)
                assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
        finally:
            stop_proxy(p)
        assert p.proc.returncode == 0, p.logs()[-2000:]
    public = tmp / "audit.pub"
    out = subprocess.run([*SANDGATE, "audit", "public-key", "--confdir", str(p.confdir)],
                         capture_output=True, text=True, check=True)
    public.write_text(out.stdout)
    anchors = list(p.confdir.glob("audit-anchor.*.json"))  # one: there is one audit file
    anchor = anchors[0] if len(anchors) == 1 else None
    lines = [(x, json.loads(x)) for x in p.audit_file.read_bytes().splitlines(keepends=True)]
    spans = [range(a, b) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    runs = [str(next((d["run"] for _, d in lines[s.start:s.stop] if "run" in d), None))
            for s in spans]
    return History(p.audit_file, public, anchor, lines, spans, runs)


def _verify(h: History, path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SANDGATE, "audit", "verify", str(path), "--public-key",
                           str(h.public), *extra], capture_output=True, text=True, timeout=60)


def _without(h: History, tmp_path: Path, drop: object) -> Path:
    """A copy of the file without the lines for which drop(index, record) is true."""
    out = tmp_path / "audit.jsonl"
    out.write_bytes(b"".join(x for i, (x, d) in enumerate(h.lines)
                             if not drop(i, d)))  # type: ignore[operator]
    return out


def test_the_intact_history_verifies_against_the_anchor(history):
    assert len(set(history.runs)) == 3, history.runs  # each run names itself
    workers = {history.lines[i][1].get("worker") for i in history.spans[1]}
    assert workers == {0, 1}
    assert history.anchor is not None, "the proxy kept no anchor in its confdir"
    r = _verify(history, history.audit, "--anchor", str(history.anchor))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 chain(s)" in r.stdout and "3 run(s)" in r.stdout, r.stdout
    assert "reach their anchored heads" in r.stdout, r.stdout


def test_deleting_the_earliest_run_is_reported(history, tmp_path):
    cut = _without(history, tmp_path, lambda i, d: i in history.spans[0])
    r = _verify(history, cut)  # no anchor needed for this one
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.startswith(f"INCOMPLETE: {cut}:1: the files begin mid-history"), r.stdout
    assert history.anchor is not None
    r = _verify(history, cut, "--anchor", str(history.anchor))
    assert r.returncode == 3, r.stdout + r.stderr


def test_deleting_the_latest_run_is_reported(history, tmp_path):
    last = history.runs[-1]
    cut = _without(history, tmp_path, lambda i, d: i in history.spans[2])
    assert history.anchor is not None, "the proxy kept no anchor: nothing names the last run"
    r = _verify(history, cut, "--anchor", str(history.anchor))
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.startswith(f"INCOMPLETE: {history.anchor}:1: chain "), r.stdout
    assert f"run {last}" in r.stdout and "has no line in the files" in r.stdout, r.stdout


def test_deleting_one_workers_share_is_reported(history, tmp_path):
    run = history.runs[1]
    cut = _without(history, tmp_path, lambda i, d: d.get("worker") == 1)
    r = _verify(history, cut)  # no anchor needed: the run's checkpoints say 2 workers
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.startswith("INCOMPLETE: "), r.stdout
    assert f"run {run} had 2 workers" in r.stdout, r.stdout
    assert "worker(s) 1 of this run" in r.stdout, r.stdout
    assert history.anchor is not None
    r = _verify(history, cut, "--anchor", str(history.anchor))
    assert r.returncode == 3 and "worker(s) 1 of this run" in r.stdout, r.stdout + r.stderr
