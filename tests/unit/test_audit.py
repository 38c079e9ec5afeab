"""The audit stream: one JSON object per line, canonical field names, no query values."""

from __future__ import annotations

import io
import json
import re
import stat
import threading

import pytest
import structlog

from sandgate.audit import events as A
from sandgate.audit.events import AuditLog, redact_path

TIME_RE = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z")


def lines(text: str) -> list[dict]:
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_constants() -> None:
    assert (A.TIME, A.EVENT, A.IDENTITY, A.SANDBOX, A.IDENTITY_SOURCE, A.CLIENT) == (
        "time", "event", "identity", "sandbox", "identity_source", "client")
    assert (A.METHOD, A.SCHEME, A.HOST, A.PORT, A.PATH, A.RULE, A.DECISION, A.CODE) == (
        "method", "scheme", "host", "port", "path", "rule", "decision", "code")
    assert (A.REASON, A.SECRETS, A.UPSTREAM_STATUS, A.BYTES_IN, A.BYTES_OUT) == (
        "reason", "secrets", "upstream_status", "bytes_in", "bytes_out")
    assert (A.DURATION_MS, A.DIALED, A.EXFIL, A.REDACTIONS) == (
        "duration_ms", "dialed", "exfiltration", "redactions")


def test_one_json_line_per_emit_with_exact_keys() -> None:
    buf = io.StringIO()
    log = AuditLog(buf)
    log.emit("request", **{
        A.IDENTITY: "bash-tool", A.SANDBOX: None, A.METHOD: "GET", A.HOST: "example.com",
        A.PORT: 443, A.PATH: redact_path("/v1?key=FAKE-SECRET&x=1"), A.DECISION: "allow",
        A.SECRETS: ["api@3"], A.DURATION_MS: 1.25,
    })
    log.emit("connect", **{A.DECISION: "deny", A.CODE: "no_rule", A.REASON: "line\nbreak"})
    docs = lines(buf.getvalue())
    assert len(docs) == 2
    first = docs[0]
    assert list(first) == ["time", "event", "identity", "sandbox", "method", "host", "port",
                           "path", "decision", "secrets", "duration_ms"]
    assert TIME_RE.fullmatch(first["time"])
    assert first["event"] == "request"
    assert first["path"] == "/v1?key=REDACTED&x=REDACTED"
    assert first["sandbox"] is None and first["port"] == 443 and first["secrets"] == ["api@3"]
    assert "FAKE-SECRET" not in buf.getvalue()
    assert list(docs[1]) == ["time", "event", "decision", "code", "reason"]
    assert docs[1]["reason"] == "line\nbreak"


def test_unknown_fields_and_odd_values_are_still_written() -> None:
    buf = io.StringIO()
    AuditLog(buf).emit("x", custom_field=1, obj=object(), nested={"a": [1, 2]})
    (doc,) = lines(buf.getvalue())
    assert doc["custom_field"] == 1 and doc["nested"] == {"a": [1, 2]}
    assert isinstance(doc["obj"], str)


def test_callers_cannot_override_time() -> None:
    buf = io.StringIO()
    AuditLog(buf).emit("x", time="yesterday")
    (doc,) = lines(buf.getvalue())
    assert TIME_RE.fullmatch(doc["time"])


def test_stdout_by_default(capsys) -> None:
    log = AuditLog()
    log.emit("request", host="example.com")
    log.close()
    out = capsys.readouterr().out
    assert lines(out)[0]["host"] == "example.com"


def test_file_sink_appends(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"pre": "existing"}\n')
    log = AuditLog(path)
    log.emit("a", n=1)
    # Line buffered: visible before close.
    assert lines(path.read_text())[-1]["n"] == 1
    log.close()
    log2 = AuditLog(str(path))
    log2.emit("b", n=2)
    log2.close()
    docs = lines(path.read_text())
    assert [d.get("event") for d in docs] == [None, "a", "b"]


def test_new_file_is_private(tmp_path) -> None:
    path = tmp_path / "new.jsonl"
    with AuditLog(path) as log:
        log.emit("a")
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_close_is_idempotent_and_emit_after_close_fails(tmp_path) -> None:
    log = AuditLog(tmp_path / "f.jsonl")
    log.close()
    log.close()
    with pytest.raises(ValueError):
        log.emit("late")


def test_close_leaves_a_passed_stream_open() -> None:
    buf = io.StringIO()
    AuditLog(buf).close()
    assert not buf.closed


def test_global_structlog_config_untouched() -> None:
    before = structlog.get_config()
    AuditLog(io.StringIO()).emit("x")
    assert structlog.get_config() == before


def test_threads_never_interleave_lines() -> None:
    buf = io.StringIO()
    log = AuditLog(buf)

    def worker(i: int) -> None:
        for j in range(200):
            log.emit("e", worker=i, j=j, pad="p" * 200)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lines(buf.getvalue())) == 800


@pytest.mark.parametrize("given, want", [
    ("/a?key=s3cr3t&x=1", "/a?key=REDACTED&x=REDACTED"),
    ("/a", "/a"),
    ("/", "/"),
    ("", ""),
    ("/a?", "/a?"),
    ("/a?key=", "/a?key=REDACTED"),
    ("/a?key==x=y", "/a?key=REDACTED"),
    ("/a?=v", "/a?=REDACTED"),
    ("/a?a=1&&b=2&", "/a?a=REDACTED&&b=REDACTED&"),
    ("/a?bareFAKEsecret", "/a?REDACTED"),
    ("/a?x=1?y=2", "/a?x=REDACTED"),
    ("/a?x=1#frag", "/a?x=REDACTED#REDACTED"),
    ("/a#", "/a#"),
    ("/p/q%20r?k%20n=v%20w", "/p/q%20r?k%20n=REDACTED"),
    ("/a?x=1;y=2", "/a?x=REDACTED"),
    ("*", "*"),
    ("https://h.example/a?token=FAKE", "https://h.example/a?token=REDACTED"),
])
def test_redact_path(given: str, want: str) -> None:
    assert redact_path(given) == want


def test_a_failed_write_marks_the_log_unhealthy_until_one_succeeds():
    class Flaky(io.StringIO):
        fail = True

        def write(self, s: str) -> int:
            if self.fail:
                raise OSError(28, "No space left on device")
            return super().write(s)

    stream = Flaky()
    log = AuditLog(stream)
    assert log.healthy
    with pytest.raises(OSError):
        log.emit("request", identity="a")
    assert not log.healthy
    stream.fail = False
    log.emit("request", identity="a")
    assert log.healthy and '"identity": "a"' in stream.getvalue()
