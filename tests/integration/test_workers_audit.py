"""Workers share one audit file: under load from several processes no line is split, merged or
lost (each event is one write() on an O_APPEND descriptor)."""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from pathlib import Path

import pytest

from sandgate.audit.workerlog import WorkerAuditLog

pytestmark = pytest.mark.integration

WORKERS = 4
EVENTS = 300


def _write(path: str, worker: int, start: multiprocessing.synchronize.Event) -> None:
    log = WorkerAuditLog(Path(path), worker)
    start.wait()
    for i in range(EVENTS):
        # sizes from a few bytes to well over a pipe's PIPE_BUF and a stdio buffer
        log.emit("request", seq=i, path="/" + chr(97 + worker) * ((i * 997) % 70_000))
    log.close()


def test_concurrent_workers_never_interleave_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_write, args=(str(path), w, start)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    events = [json.loads(line) for line in lines[:-1]]  # a torn line would not parse
    assert Counter(e["worker"] for e in events) == {w: EVENTS for w in range(WORKERS)}
    for e in events:  # and no line carries another worker's bytes
        assert set(e["path"][1:]) <= {chr(97 + e["worker"])}
        assert len(e["path"]) - 1 == (e["seq"] * 997) % 70_000
    for w in range(WORKERS):  # each worker's lines in its own order
        assert [e["seq"] for e in events if e["worker"] == w] == list(range(EVENTS))


def _write_anchored(path: str, conf: str, worker: int,
                    start: multiprocessing.synchronize.Event) -> None:
    from sandgate.audit.anchor import Anchor
    from sandgate.audit.chain import Chain
    from tests.unit.test_audit_chain import KEY

    log = WorkerAuditLog(Path(path), worker, chain=Chain(KEY, 3, 3600, run="r" * 16,
                                                         workers=WORKERS),
                         anchor=Anchor(Path(conf), Path(path), KEY))
    start.wait()
    for i in range(EVENTS // 3):
        log.emit("request", seq=i, path=f"/{worker}/{i}")
    log.close()


def test_concurrent_workers_each_keep_their_head_in_the_anchor(tmp_path):
    """The workers update one anchor at once (a checkpoint every 3 lines each): none loses
    another's entry, and the files verify against it."""
    from sandgate.audit.anchor import anchor_path, read_anchor
    from sandgate.audit.verify import verify
    from tests.unit.test_audit_chain import PUBLIC

    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_write_anchored, args=(str(path), str(conf), w, start))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    anchor = read_anchor(anchor_path(conf, path), PUBLIC)
    assert sorted(c.worker for c in anchor.chains.values()) == list(range(WORKERS))
    assert all(c.final for c in anchor.chains.values())
    report = verify([path], PUBLIC, anchor=anchor)
    assert report.chains == WORKERS and report.runs == {"r" * 16}
