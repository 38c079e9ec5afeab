"""`sandgate audit verify` proves the set of files whole, not only each line (issue 34).

The files are written by the real writers (sandgate.audit.events.AuditLog, WorkerAuditLog, the
confdir's Anchor) as `sandgate run` writes them: runs one after another on one file, one of
them with two workers. The tests then delete whole runs, a worker's share, a chain's tail, as
someone hiding what happened would, and check that verify says what is missing (exit 3), with
the signing key pinned; and that an intact set, a crash followed by a restart and a start
stated with --after still verify.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandgate.audit.anchor import Anchor, AnchorDoc, anchor_path, read_anchor
from sandgate.audit.chain import Chain, line_hash, public_hex
from sandgate.audit.events import AuditLog
from sandgate.audit.file import Rotation, rotated_files
from sandgate.audit.verify import Broken, Incomplete, verify
from sandgate.audit.workerlog import WorkerAuditLog
from sandgate.cli import main
from tests.unit.audit_log import fields
from tests.unit.test_audit_chain import KEY, PUBLIC


def request(log: AuditLog, i: int) -> None:
    log.emit("request", **fields("agent", "GET", f"https://api.example/v1/{i}?q=1"))


def single_run(path: Path, conf: Path, n: int = 5, close: bool = True,
               rotation: Rotation | None = None) -> AuditLog:
    """One `sandgate run` of one process: its own run id, a checkpoint every 3 lines."""
    chain = Chain(KEY, 3, 3600, run=secrets.token_hex(8))
    log = AuditLog(path, instance="t", chain=chain, rotation=rotation,
                   anchor=Anchor(conf, path, KEY))
    for i in range(n):
        request(log, i)
    if close:
        log.close()
    return log


def workers_run(path: Path, conf: Path, n: int = 8, workers: int = 2) -> None:
    """One `sandgate run --workers N`: N writers sharing the run id, lines interleaved."""
    run = secrets.token_hex(8)
    logs = [WorkerAuditLog(path, w, instance="t", chain=Chain(KEY, 3, 3600, run=run,
                                                                 workers=workers),
                           anchor=Anchor(conf, path, KEY)) for w in range(workers)]
    for i in range(n):
        request(logs[i % workers], i)
    for log in logs:
        log.close()


def records(path: Path) -> list[tuple[bytes, dict[str, object]]]:
    return [(x, json.loads(x)) for x in path.read_bytes().splitlines(keepends=True)]


def runs_of(path: Path) -> list[str]:
    """The run ids in the order they begin."""
    out: list[str] = []
    for _, d in records(path):
        if isinstance(d.get("run"), str) and d["run"] not in out:
            out.append(d["run"])  # type: ignore[arg-type]
    return out


def chain_run(path: Path) -> dict[str, str]:
    return {str(d["chain"]): str(d["run"]) for _, d in records(path) if "run" in d}


def keep(path: Path, out: Path, drop: object) -> Path:
    """Write to `out` the lines of `path` for which drop(record) is false."""
    out.write_bytes(b"".join(x for x, d in records(path) if not drop(d)))  # type: ignore[operator]
    return out


def anchor_of(conf: Path, path: Path) -> AnchorDoc:
    return read_anchor(anchor_path(conf, path), PUBLIC)


@dataclass
class History:
    path: Path
    conf: Path
    runs: list[str]  # oldest first: single, workers (2), single


@pytest.fixture
def history(tmp_path: Path) -> History:
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    single_run(path, conf)
    workers_run(path, conf)
    single_run(path, conf)
    return History(path, conf, runs_of(path))


def _pub(tmp_path: Path) -> str:
    p = tmp_path / "audit.pub"
    p.write_text(PUBLIC + "\n")
    return str(p)


# ------------------------------------------------------------------------ the intact history

def test_the_intact_history_verifies_with_its_anchor(history, tmp_path, capsys):
    report = verify([history.path], PUBLIC, anchor=anchor_of(history.conf, history.path))
    assert len(history.runs) == 3 and report.runs == set(history.runs) and report.chains == 4
    assert main(["audit", "verify", str(history.path), "--public-key", _pub(tmp_path),
                 "--confdir", str(history.conf)]) == 0
    out = capsys.readouterr().out
    assert "3 run(s)" in out and "reach their anchored heads" in out, out


def test_the_anchor_names_the_latest_run_and_is_signed(history):
    a = anchor_of(history.conf, history.path)
    assert a.run == history.runs[-1] and len(a.chains) == 1
    (c,) = a.chains.values()
    last = records(history.path)[-1]
    assert c.final and c.head == line_hash(last[0]) and c.seq == last[1]["seq"]


# --------------------------------------------------------------------------- found: issue 34

def test_deleting_an_entire_earlier_run_is_reported(history, tmp_path, capsys):
    first = history.runs[0]
    chains = chain_run(history.path)
    cut = keep(history.path, tmp_path / "cut.jsonl", lambda d: chains[d["chain"]] == first)
    e = _broken([cut], anchor=anchor_of(history.conf, history.path))
    assert isinstance(e, Incomplete) and (e.file, e.line) == (str(cut), 1)
    assert "begin mid-history" in e.what and "--after " in e.what
    assert main(["audit", "verify", str(cut), "--public-key", _pub(tmp_path)]) == 3
    assert capsys.readouterr().out.startswith(f"INCOMPLETE: {cut}:1: the files begin "
                                              "mid-history")


def test_deleting_an_entire_later_run_is_reported(history, tmp_path, capsys):
    last = history.runs[-1]
    chains = chain_run(history.path)
    cut = keep(history.path, tmp_path / "cut.jsonl", lambda d: chains[d["chain"]] == last)
    anchor = anchor_path(history.conf, history.path)
    e = _broken([cut], PUBLIC, anchor=read_anchor(anchor, PUBLIC))
    assert isinstance(e, Incomplete) and e.file == str(anchor)
    assert f"run {last}" in e.what and "has no line in the files" in e.what
    assert main(["audit", "verify", str(cut), "--public-key", _pub(tmp_path),
                 "--anchor", str(anchor)]) == 3
    assert "that run (or that worker's share of it) was deleted" in capsys.readouterr().out


def test_deleting_one_workers_share_is_reported(history, tmp_path, capsys):
    run = history.runs[1]
    cut = keep(history.path, tmp_path / "cut.jsonl", lambda d: d.get("worker") == 1)
    e = _broken([cut], PUBLIC)  # no anchor needed: the run's own checkpoints say 2 workers
    assert isinstance(e, Incomplete)
    assert f"run {run} had 2 workers" in e.what and "worker(s) 1 of this run" in e.what
    assert main(["audit", "verify", str(cut), "--public-key", _pub(tmp_path)]) == 3
    assert "that share of the run (or its end) was deleted" in capsys.readouterr().out


def test_deleting_the_only_run_of_a_workers_file_is_reported_by_the_anchor(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    workers_run(path, conf)
    cut = keep(path, tmp_path / "cut.jsonl", lambda d: d.get("worker") == 0)
    with pytest.raises(Incomplete, match="had 2 workers"):
        verify([cut], PUBLIC)
    (path.parent / "empty.jsonl").write_bytes(b"")
    e = _broken([path.parent / "empty.jsonl"], PUBLIC, anchor=anchor_of(conf, path))
    assert isinstance(e, Incomplete) and "has no line in the files" in e.what


def test_a_chain_cut_back_to_a_checkpoint_falls_short_of_the_anchor(tmp_path):
    """The writer crashed after a checkpoint (no closing one), its next run not yet started:
    cutting the lines back to an earlier checkpoint leaves no gap in the file itself."""
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    single_run(path, conf, n=8, close=False)  # checkpoints after 3 and 6 lines, then a crash
    lines = records(path)
    checkpoints = [i for i, (_, d) in enumerate(lines) if d["event"] == "checkpoint"]
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(x for x, _ in lines[: checkpoints[0] + 1]))
    with pytest.raises(Incomplete, match="short of the head the anchor names"):
        verify([cut], PUBLIC, live=True, anchor=anchor_of(conf, path))
    # the crash itself, uncut, is an open tail (live) that reaches the anchored head
    assert verify([path], PUBLIC, live=True, anchor=anchor_of(conf, path)).open_tails


# ----------------------------------------------------------------- what stays legitimate

def test_a_crashed_run_followed_by_the_next_is_a_crash_not_a_deletion(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    single_run(path, conf, n=4, close=False)  # killed: no closing checkpoint
    crashed_last = records(path)[-1]
    single_run(path, conf)
    report = verify([path], PUBLIC, anchor=anchor_of(conf, path))
    assert any("crashed or was killed" in n and "nothing after it is missing" in n
               for n in report.notes), report.notes
    # but the crashed run's last line deleted: the next run's link shows the gap
    cut = keep(path, tmp_path / "cut.jsonl", lambda d: d == crashed_last[1])
    with pytest.raises(Incomplete, match="a gap"):
        verify([cut], PUBLIC)


def test_a_stated_start_verifies(history, tmp_path):
    first = history.runs[0]
    chains = chain_run(history.path)
    cut = keep(history.path, tmp_path / "cut.jsonl", lambda d: chains[d["chain"]] == first)
    start = str(records(cut)[0][1]["prev"])
    report = verify([cut], PUBLIC, after=[start], anchor=anchor_of(history.conf,
                                                                     history.path))
    assert report.begins is not None and start in report.begins
    assert main(["audit", "verify", str(cut), "--after", start, "--public-key",
                 _pub(tmp_path)]) == 0
    assert main(["audit", "verify", str(cut), "--after", "not-a-hash"]) == 2


def test_a_file_cut_at_its_start_is_reported_not_skipped(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    single_run(path, conf, n=6)
    lines = records(path)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(x for x, _ in lines[2:]))
    e = _broken([cut], PUBLIC)
    assert isinstance(e, Incomplete) and "first line here (seq 2, not 0) follows" in e.what
    assert verify([cut], PUBLIC, after=[str(lines[2][1]["prev"])]).lines == len(lines) - 2


def test_rotated_files_beginning_after_one_not_given_must_be_stated(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    single_run(path, conf, n=40, rotation=Rotation(max_bytes=3000))
    files = [*rotated_files(path), path]
    assert len(files) >= 3
    assert verify(files, PUBLIC, anchor=anchor_of(conf, path)).begins is None
    e = _broken(files[1:], PUBLIC)
    assert isinstance(e, Incomplete) and (e.file, e.line) == (str(files[1]), 1)
    assert f"begin after {files[0].name}" in e.what
    start = str(records(files[1])[0][1]["previous_last"])
    report = verify(files[1:], PUBLIC, after=[start], anchor=anchor_of(conf, path))
    assert report.begins is not None and "as stated by --after" in report.begins


def test_workers_rotating_with_retention_verify_against_their_anchor(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "conf"
    conf.mkdir()
    run, rot = "r" * 16, Rotation(max_bytes=3000, keep=2)
    logs = [WorkerAuditLog(path, w, instance="t", rotation=rot, anchor=Anchor(conf, path, KEY),
                           chain=Chain(KEY, 5, 3600, run=run, workers=2)) for w in (0, 1)]
    for i in range(80):
        request(logs[i % 2], i)
    for log in logs:
        log.close()
    files = [*rotated_files(path), path]
    anchor = anchor_of(conf, path)
    assert len(anchor.chains) == 2 and all(c.final for c in anchor.chains.values())
    report = verify(files, PUBLIC, anchor=anchor)
    assert report.begins is not None and "deleted by retention" in report.begins
    assert report.runs == {run}
    # worker 1's lines of the current file deleted (its rotate and retention lines kept)
    cut = [*files[:-1], tmp_path / "current.jsonl"]
    keep(path, cut[-1],
         lambda d: d.get("worker") == 1 and d["event"] in ("request", "checkpoint"))
    with pytest.raises(Broken) as e:
        verify(cut, PUBLIC, anchor=anchor)
    assert "signed line of worker(s) 1 of this run" in e.value.what, e.value.what


def test_a_forged_or_foreign_anchor_is_refused(history, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    where = anchor_path(history.conf, history.path)
    doc = json.loads(where.read_text())
    cid = next(iter(doc["chains"]))
    doc["chains"][cid]["seq"] -= 2  # an anchor moved back to hide a tail
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="signature does not verify"):
        read_anchor(forged, PUBLIC)
    other = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
    with pytest.raises(ValueError, match="not by the key given"):
        read_anchor(where, public_hex(other.public_key()))
    assert main(["audit", "verify", str(history.path), "--anchor", str(forged)]) == 2
    assert main(["audit", "verify", str(history.path), "--confdir", str(tmp_path)]) == 2


def test_an_anchor_write_that_fails_fails_the_checkpoint(tmp_path):
    path, conf = tmp_path / "audit.jsonl", tmp_path / "gone" / "conf"
    log = AuditLog(path, chain=Chain(KEY, 2, 3600, run="r"), anchor=Anchor(conf, path, KEY))
    log.emit("request", identity="a")
    with pytest.raises(OSError):
        log.emit("request", identity="b")  # the checkpoint after it cannot be anchored
    assert not log.healthy
    conf.mkdir(parents=True)
    log.emit("request", identity="c")
    log.close()
    assert log.healthy and anchor_of(conf, path).chains


# ------------------------------------------------------------------------- property tests

def _broken(files: list[Path], public: str | None = PUBLIC, **kw: object) -> Broken:
    with pytest.raises(Broken) as e:
        verify(files, public, **kw)  # type: ignore[arg-type]
    return e.value


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[Path, list[tuple[bytes, dict[str, object]]], object]:
    tmp = tmp_path_factory.mktemp("history")
    path, conf = tmp / "audit.jsonl", tmp / "conf"
    conf.mkdir()
    single_run(path, conf, n=4)
    workers_run(path, conf, n=9, workers=3)
    single_run(path, conf, n=2)
    workers_run(path, conf, n=6, workers=2)
    return tmp, records(path), anchor_of(conf, path)


def _write(tmp: Path, lines: list[tuple[bytes, dict[str, object]]]) -> Path:
    out = tmp / f"cut-{secrets.token_hex(6)}.jsonl"
    out.write_bytes(b"".join(x for x, _ in lines))
    return out


def test_the_sample_history_verifies(sample):
    tmp, lines, anchor = sample
    report = verify([_write(tmp, lines)], PUBLIC, anchor=anchor)
    assert len(report.runs) == 4 and report.chains == 1 + 3 + 1 + 2


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deleting_any_whole_chains_is_reported(sample, data):
    tmp, lines, anchor = sample
    chains = sorted({str(d["chain"]) for _, d in lines})
    gone = data.draw(st.sets(st.sampled_from(chains), min_size=1, max_size=len(chains) - 1))
    with pytest.raises(Broken):
        verify([_write(tmp, [r for r in lines if r[1]["chain"] not in gone])], PUBLIC,
               anchor=anchor)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deleting_any_whole_runs_is_reported(sample, data):
    tmp, lines, anchor = sample
    run_of = {str(d["chain"]): str(d["run"]) for _, d in lines if "run" in d}
    runs = sorted(set(run_of.values()))
    gone = data.draw(st.sets(st.sampled_from(runs), min_size=1, max_size=len(runs) - 1))
    with pytest.raises(Incomplete):
        verify([_write(tmp, [r for r in lines if run_of[str(r[1]["chain"])] not in gone])],
               PUBLIC, anchor=anchor)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncating_any_chain_is_reported(sample, data):
    tmp, lines, anchor = sample
    chains = sorted({str(d["chain"]) for _, d in lines})
    cid = data.draw(st.sampled_from(chains))
    mine = [i for i, (_, d) in enumerate(lines) if d["chain"] == cid]
    k = data.draw(st.integers(1, len(mine)))
    cut = set(mine[len(mine) - k:])
    with pytest.raises(Broken):
        verify([_write(tmp, [r for i, r in enumerate(lines) if i not in cut])], PUBLIC,
               anchor=anchor)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.sampled_from([None, 2, 3]), st.integers(1, 7)), min_size=1,
                     max_size=4),
       data=st.data())
def test_any_history_verifies_whole_and_is_incomplete_without_any_of_its_runs(
        tmp_path_factory, runs, data):
    """Histories of 1 to 4 runs, each one process or 2 or 3 workers: intact they verify
    against their anchor; without any non-empty set of their runs they are incomplete."""
    tmp = tmp_path_factory.mktemp("any-history")
    path, conf = tmp / "audit.jsonl", tmp / "conf"
    conf.mkdir()
    for workers, n in runs:
        if workers is None:
            single_run(path, conf, n=n)
        else:
            workers_run(path, conf, n=n, workers=workers)
    lines = records(path)
    anchor = anchor_of(conf, path)
    assert verify([path], PUBLIC, anchor=anchor).runs == set(runs_of(path))
    run_of = chain_run(path)
    gone = data.draw(st.sets(st.sampled_from(runs_of(path)), min_size=1))
    with pytest.raises(Incomplete):
        verify([_write(tmp, [r for r in lines if run_of[str(r[1]["chain"])] not in gone])],
               PUBLIC, anchor=anchor)
