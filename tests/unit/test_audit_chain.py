"""The audit hash chain, its signed checkpoints, rotation and retention, `sandgate audit verify`.

Logs are written by sandgate.audit.events.AuditLog as the proxy writes them; the tests then edit,
delete, reorder and truncate lines as an attacker would, and check that verify names the line.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandgate.audit import file as audit_file
from sandgate.audit.chain import (
    GENESIS,
    SIGNING_KEY_FILE,
    Chain,
    confdir_signing_key,
    line_hash,
    parse_private_key,
    public_hex,
)
from sandgate.audit.events import AuditLog
from sandgate.audit.file import AuditFile, Rotation, rotated_files
from sandgate.audit.verify import Broken, verify
from sandgate.audit.workerlog import WorkerAuditLog
from sandgate.cli import main
from tests.unit.audit_log import fields

KEY = Ed25519PrivateKey.from_private_bytes(b"\x01" * 32)
PUBLIC = public_hex(KEY.public_key())


def write_log(path: Path, n: int = 10, fmt: str = "json", every: int = 4,
              key: Ed25519PrivateKey | None = KEY, close: bool = True) -> AuditLog:
    log = AuditLog(path, instance="test", format=fmt, chain=Chain(key, every, 3600))
    for i in range(n):
        log.emit("request", **fields("agent", "GET", f"https://api.example/v1/{i}?q=1"))
    if close:
        log.close()
    return log


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def broken(files: list[Path], **kw: object) -> Broken:
    with pytest.raises(Broken) as e:
        verify(files, **kw)  # type: ignore[arg-type]
    return e.value


# --------------------------------------------------------------------------- the chain itself

@pytest.mark.parametrize("fmt", ["json", "ocsf"])
def test_each_line_links_to_the_previous_one_and_checkpoints_sign(tmp_path, fmt):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=10, fmt=fmt, every=4)
    raw = lines_of(path)
    docs = [json.loads(x) for x in raw]
    slots = [d["unmapped"] if fmt == "ocsf" else d for d in docs]
    assert slots[0]["prev"] == GENESIS and slots[0]["seq"] == 0
    for before, s in zip(raw, slots[1:], strict=False):
        assert s["prev"] == line_hash(before.rstrip(b"\n")) and s["chain"] == slots[0]["chain"]
    assert [s["seq"] for s in slots] == list(range(len(raw)))
    events = [s["event"] for s in slots]
    # a checkpoint after every 4 lines, and the closing one
    assert events.count("checkpoint") == 3 and events[4] == "checkpoint"
    assert slots[-1]["final"] is True and slots[-1]["key"] == PUBLIC
    report = verify([path], PUBLIC)
    assert (report.lines, report.chains, report.checkpoints) == (len(raw), 1, 3)
    assert "OK: 1 file(s)" in report.summary()


def test_stdout_and_streams_carry_the_chain_too():
    buf = io.StringIO()
    log = AuditLog(buf, chain=Chain(KEY, 2, 3600))
    log.emit("request", identity="a")
    log.emit("request", identity="b")
    log.close()
    docs = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [d["event"] for d in docs] == ["request", "request", "checkpoint", "checkpoint"]
    assert docs[-1]["final"] is True  # closing: the chain ends here
    assert docs[0]["prev"] == GENESIS  # nothing to link to on a stream


def test_a_new_writer_links_to_the_last_line_already_in_the_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=2)
    last = lines_of(path)[-1]
    write_log(path, n=2)
    second = json.loads(lines_of(path)[len(lines_of(path)) // 2])
    assert second["seq"] == 0 and second["prev"] == line_hash(last)
    assert verify([path]).chains == 2


def test_a_failed_write_does_not_advance_the_chain():
    class Flaky(io.StringIO):
        fail = False

        def write(self, s: str) -> int:
            if self.fail:
                raise OSError(28, "No space left on device")
            return super().write(s)

    stream = Flaky()
    log = AuditLog(stream, chain=Chain(KEY, 100, 3600))
    log.emit("a")
    stream.fail = True
    with pytest.raises(OSError):
        log.emit("b")
    assert not log.healthy
    stream.fail = False
    log.emit("c")
    docs = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [d["seq"] for d in docs] == [0, 1] and docs[1]["event"] == "c"


def test_checkpoint_after_a_quiet_interval(tmp_path):
    now = [0.0]
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, chain=Chain(KEY, 1000, 10.0, clock=lambda: now[0]))
    log.emit("a")
    assert not log._chain.checkpoint_due()  # type: ignore[union-attr]
    now[0] = 11.0
    assert log._chain.checkpoint_due()  # type: ignore[union-attr]
    log._checkpoint_locked()
    log._stop.set()
    assert json.loads(lines_of(path)[-1])["event"] == "checkpoint"
    assert verify([path], live=True).checkpoints == 1


# ----------------------------------------------------------------------------- tampering

def test_an_edited_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=10)
    raw = lines_of(path)
    raw[2] = raw[2].replace(b"/v1/2", b"/v1/X")
    path.write_bytes(b"".join(raw))
    e = broken([path])
    assert (e.line, e.file) == (3, str(path)) and "edited" in e.what
    assert main(["audit", "verify", str(path)]) == 1


def test_a_deleted_line_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=10)
    raw = lines_of(path)
    del raw[5]
    path.write_bytes(b"".join(raw))
    e = broken([path])
    assert e.line == 6 and "missing" in e.what


def test_reordered_lines_are_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=10)
    raw = lines_of(path)
    raw[2], raw[3] = raw[3], raw[2]
    path.write_bytes(b"".join(raw))
    e = broken([path])
    assert e.line == 3 and "missing" in e.what  # seq 3 where 2 was due
    e2 = broken([path])
    assert e2.line == e.line


def test_a_repeated_line_is_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=6)
    raw = lines_of(path)
    raw.insert(3, raw[2])
    path.write_bytes(b"".join(raw))
    e = broken([path])
    assert e.line == 4 and "out of order" in e.what


@pytest.mark.parametrize("cut", ["mid_line", "line_boundary", "at_a_checkpoint"])
def test_a_truncated_file_is_found(tmp_path, cut):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=10, every=4)
    data = path.read_bytes()
    raw = lines_of(path)
    if cut == "mid_line":
        path.write_bytes(data[:-20])
    elif cut == "line_boundary":
        path.write_bytes(b"".join(raw[:-3]))
    else:  # drop the tail after the second checkpoint: the chain is not closed
        path.write_bytes(b"".join(raw[:10]))
        assert json.loads(raw[9])["event"] == "checkpoint"
    e = broken([path])
    assert "incomplete" in e.what or "without its closing checkpoint" in e.what
    if cut != "mid_line":
        assert verify([path], live=True).open_tails  # what a live file may look like


def test_a_forged_checkpoint_fails_and_a_foreign_key_is_refused(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=3, every=100)
    other = public_hex(Ed25519PrivateKey.generate().public_key())
    e = broken([path], public_key=other)
    assert "not by the key given" in e.what
    raw = lines_of(path)
    last = json.loads(raw[-1])
    last["lines"] = 99  # a checkpoint says what it covers: no changing it
    raw[-1] = (json.dumps(last) + "\n").encode()
    path.write_bytes(b"".join(raw))
    assert "signature does not verify" in broken([path]).what


def test_lines_inserted_without_the_chain_are_found(tmp_path):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=3)
    raw = lines_of(path)
    raw.insert(1, b'{"time": "x", "event": "request"}\n')
    path.write_bytes(b"".join(raw))
    assert "no chain fields" in broken([path]).what


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_byte_change_is_caught(tmp_path_factory, data):
    """Property: whatever line and byte an attacker changes, to whatever value, verify fails."""
    path = tmp_path_factory.mktemp("chain") / "audit.jsonl"
    fmt = data.draw(st.sampled_from(["json", "ocsf"]))
    write_log(path, n=6, fmt=fmt, every=3)
    blob = bytearray(path.read_bytes())
    i = data.draw(st.integers(0, len(blob) - 1))
    new = data.draw(st.integers(0, 255).filter(lambda b: b != blob[i]))
    blob[i] = new
    path.write_bytes(bytes(blob))
    with pytest.raises(Broken):
        verify([path], PUBLIC)


# ------------------------------------------------------------------- rotation and retention

def rotating_log(path: Path, max_bytes: int = 4000, keep: int | None = None,
                 worker: int | None = None) -> AuditLog:
    rot = Rotation(max_bytes=max_bytes, keep=keep)
    chain = Chain(KEY, 5, 3600)
    if worker is None:
        return AuditLog(path, instance="t", chain=chain, rotation=rot)
    return WorkerAuditLog(path, worker, instance="t", chain=chain, rotation=rot)


def test_rotation_by_size_keeps_the_chain_across_files(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = rotating_log(path)
    for i in range(60):
        log.emit("request", **fields("agent", "GET", f"https://api.example/{i}"))
    log.close()
    old = rotated_files(path)
    assert len(old) >= 3
    for p in [*old, path]:
        assert p.stat().st_size <= 4000 and stat.S_IMODE(p.stat().st_mode) == 0o600
    files = [*old, path]
    report = verify(files, PUBLIC)
    assert report.files == len(files) and report.chains == 1 and report.begins is None
    first = json.loads(lines_of(path)[0])
    assert first["event"] == "rotate" and first["previous_file"] == old[-1].name
    assert first["previous_last"] == line_hash(lines_of(old[-1])[-1])
    # the CLI takes them in order; swapped, it says which file does not follow
    assert main(["audit", "verify", *map(str, files), "--public-key", _pubfile(tmp_path)]) == 0
    swapped = [files[1], files[0], *files[2:]]
    e = broken(swapped)
    assert e.file == str(files[0]) and e.line == 1 and "out of order" in e.what
    e = broken([files[0], *files[2:]])  # a rotated file missing
    assert e.file == str(files[2]) and "out of order" in e.what


def _pubfile(tmp_path: Path) -> str:
    p = tmp_path / "audit.pub"
    p.write_text(PUBLIC + "\n")
    return str(p)


def test_a_truncated_rotated_file_is_found_by_the_next_one(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = rotating_log(path)
    for i in range(30):
        log.emit("request", **fields("agent", "GET", f"https://api.example/{i}"))
    log.close()
    old = rotated_files(path)
    old[0].write_bytes(b"".join(lines_of(old[0])[:-1]))
    e = broken([*old, path])
    assert e.file == str(old[1]) and e.line == 1 and "truncated" in e.what


def test_retention_drops_old_files_and_records_it(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = rotating_log(path, max_bytes=3000, keep=2)
    dropped_last: dict[str, str] = {}
    real_unlink = Path.unlink

    def remember(p: Path, *a: object, **k: object) -> None:
        if p.name.startswith("audit.jsonl."):
            dropped_last[p.name] = line_hash(lines_of(p)[-1])
        real_unlink(p)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "unlink", remember)
        for i in range(80):
            log.emit("request", **fields("agent", "GET", f"https://api.example/{i}"))
    log.close()
    kept = rotated_files(path)
    assert len(kept) == 2 and dropped_last
    records = [json.loads(x) for p in [*kept, path] for x in lines_of(p)]
    retention = {r["dropped_file"]: r["dropped_last"] for r in records
                 if r["event"] == "retention"}
    assert retention == {n: h for n, h in dropped_last.items() if n in retention}
    report = verify([*kept, path], PUBLIC)
    assert report.begins is not None and "deleted by retention" in report.begins
    assert main(["audit", "verify", *map(str, [*kept, path])]) == 0


def test_a_failed_rotation_fails_closed(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = rotating_log(path, max_bytes=2000)
    log.emit("request", **fields("agent", "GET", "https://api.example/"))

    def refuse(*a: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(audit_file.os, "rename", refuse)
    with pytest.raises(OSError):
        for _ in range(20):
            log.emit("request", **fields("agent", "GET", "https://api.example/"))
    assert not log.healthy  # the gate refuses with 503 audit_unavailable meanwhile
    monkeypatch.undo()
    log.emit("request", **fields("agent", "GET", "https://api.example/"))
    assert log.healthy
    log.close()
    assert verify([*rotated_files(path), path]).files == 2


def test_workers_rotating_one_file_each_keep_their_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    logs = [rotating_log(path, max_bytes=5000, worker=w) for w in (0, 1)]
    for i in range(100):
        logs[i % 2].emit("request", **fields("agent", "GET", f"https://api.example/{i}"))
    for log in logs:
        log.close()
    files = [*rotated_files(path), path]
    assert len(files) > 3
    report = verify(files, PUBLIC)
    assert report.chains == 2 and report.lines >= 100
    workers = {json.loads(x)["worker"] for p in files for x in lines_of(p)}
    assert workers == {0, 1}


def test_rotation_by_age(tmp_path):
    now = [1_000.0]
    path = tmp_path / "audit.jsonl"
    f = AuditFile(path, Rotation(max_age=60), clock=lambda: now[0])
    log = AuditLog(f, chain=Chain(KEY, 100, 3600))
    log.emit("a")
    now[0] += 30
    log.emit("b")
    assert not rotated_files(path)
    now[0] += 31
    log.emit("c")
    log.close()
    (old,) = rotated_files(path)
    assert old.name == "audit.jsonl.19700101T001741.000000Z"
    assert verify([old, path]).lines == 5  # a, b | rotate, c, checkpoint


# ----------------------------------------------------------------------------- keys, CLI

def test_the_confdir_key_is_created_once_private(tmp_path):
    k1 = confdir_signing_key(tmp_path)
    k2 = confdir_signing_key(tmp_path)
    assert public_hex(k1.public_key()) == public_hex(k2.public_key())
    assert stat.S_IMODE((tmp_path / SIGNING_KEY_FILE).stat().st_mode) == 0o600
    assert main(["audit", "public-key", "--confdir", str(tmp_path)]) == 0


@pytest.mark.parametrize("raw", [b"\x02" * 32, (b"\x02" * 32).hex().encode(),
                                 b"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI="])
def test_signing_keys_are_read_from_pem_or_a_seed(raw):
    assert public_hex(parse_private_key(raw, "x").public_key()) == \
        public_hex(Ed25519PrivateKey.from_private_bytes(b"\x02" * 32).public_key())


def test_a_bad_signing_key_says_what_is_wrong():
    with pytest.raises(ValueError, match="Ed25519"):
        parse_private_key(b"short", "--audit-signing-key k")


def test_verify_cli_reports_ok_and_counts(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    write_log(path, n=5)
    assert main(["audit", "verify", str(path), "--public-key", _pubfile(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 1 file(s), 7 lines, 1 chain(s), 2 signed checkpoint(s)")
    assert main(["audit", "verify", str(tmp_path / "missing")]) == 2


def test_run_options_are_checked():
    from sandgate.audit.options import parse_vault_spec

    assert parse_vault_spec("vault:secret/sandgate/audit#key") == \
        ("secret", "sandgate/audit", "key")
    for bad in ("vault:secret#key", "vault:secret/a", "vault:/a#k"):
        with pytest.raises(ValueError, match="vault:MOUNT/PATH#FIELD"):
            parse_vault_spec(bad)
    base = ["run", "--policies", "policies"]
    for extra, msg in ((["--audit-max-bytes", "1m"], "give --audit FILE"),
                       (["--audit", "a", "--audit-keep", "2"], "--audit-max-bytes"),
                       (["--audit", "a", "--audit-max-bytes", "10"], "at least 1k"),
                       (["--audit-signing-key", "/nonexistent/k"], "no such file")):
        assert main([*base, *extra]) == 2, msg


def test_rotated_names_sort_in_time_order(tmp_path):
    names = [audit_file.rotated_name(tmp_path / "a.log", t) for t in (5.0, 60.5, 3600.25)]
    assert names == sorted(names)
    for n in names:
        (tmp_path / n).write_text("")
    (tmp_path / "a.log.other").write_text("")
    assert [p.name for p in rotated_files(tmp_path / "a.log")] == names
    assert os.path.exists(tmp_path / "a.log.other")


def test_a_chained_log_on_a_full_disk_fails_closed():
    """--audit /dev/full: nothing to link to (reading it would never end), every write fails."""
    from sandgate.audit.chain import last_line_hash

    assert last_line_hash(Path("/dev/full")) == GENESIS
    log = AuditLog(Path("/dev/full"), chain=Chain(KEY, 10, 3600))
    with pytest.raises(OSError):
        log.emit("request", identity="a")
    assert not log.healthy
    log.close()
