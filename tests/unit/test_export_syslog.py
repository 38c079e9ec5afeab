"""RFC 5424 messages and octet-counting frames of audit events (sandgate.audit.export.rfc5424), and
the syslog sender's queue, reconnection and option checks (sandgate.audit.export.syslog)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.audit.export import rfc5424
from sandgate.audit.export.counters import ExportCounters
from sandgate.audit.export.syslog import SyslogSink, Target, parse_target

pytestmark = pytest.mark.unit

AT = datetime(2026, 11, 24, 12, 0, 0, 123000, tzinfo=UTC)

# RFC 5424 6: the header up to STRUCTURED-DATA
HEADER = re.compile(rb"<(\d{1,3})>1 (\S+) (\S+) (\S+) (\S+) (\S+) ")


def sd_params(sd: str) -> dict[str, str]:
    """A receiver's parse of one SD-ELEMENT: SD-NAME="escaped value" pairs."""
    assert sd.startswith(f"[{rfc5424.SD_ID} ") and sd.endswith("]")
    out: dict[str, str] = {}
    for name, value in re.findall(r'([^ =\]"]+)="((?:[^"\\\]]|\\["\\\]])*)"',
                                  sd[len(rfc5424.SD_ID) + 2:-1]):
        out[name] = rfc5424.unescape_param(value)
    return out


def split(msg: bytes) -> tuple[re.Match[bytes], str, dict[str, object]]:
    m = HEADER.match(msg)
    assert m is not None, msg[:80]
    rest = msg[m.end():].decode()
    sd, _, body = rest.partition(" " + rfc5424.BOM)
    return m, sd, json.loads(body)


@given(st.text())
def test_escaping_round_trips_and_leaves_no_bare_terminator(value):
    escaped = rfc5424.escape_param(value)
    assert rfc5424.unescape_param(escaped) == value
    # every '"', ']' and '\' in the escaped form is escaped: a parser never ends the value early
    i = 0
    while i < len(escaped):
        if escaped[i] == "\\":
            assert escaped[i + 1] in '"\\]'
            i += 2
            continue
        assert escaped[i] not in '"]'
        i += 1


def test_escaping_of_the_three_characters():
    assert rfc5424.escape_param('a"b\\c]d') == 'a\\"b\\\\c\\]d'


sandbox_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(identity=sandbox_text, host=sandbox_text, rule=sandbox_text, event=sandbox_text)
def test_a_message_parses_back_to_the_event(identity, host, rule, event):
    fields = {"identity": identity, "host": host, "rule": rule, "decision": "deny",
              "code": "no_rule", "upstream_status": None, "secrets": ["openai@3"]}
    msg = rfc5424.message(event, fields, hostname="gw 1", procid="42", at=AT)
    m, sd, body = split(msg)
    assert int(m.group(1)) == 13 * 8 + 5  # log audit, notice: a refusal
    assert m.group(2) == b"2026-11-24T12:00:00.123Z"
    assert m.group(3) == b"gw_1"  # no space in a header field
    assert m.group(4) == b"sandgate" and m.group(5) == b"42"
    assert re.fullmatch(rb"[\x21-\x7e]{1,32}", m.group(6))
    params = sd_params(sd)
    shown = [re.sub(r"[\x00-\x1f\x7f]", "\ufffd", v) for v in (identity, host, rule)]
    assert [params["identity"], params["host"], params["rule"]] == shown
    assert "upstream_status" not in params  # None is left out
    assert body["identity"] == identity and body["event"] == event
    assert body["secrets"] == ["openai@3"]
    assert b"\n" not in msg  # one message is one line, whatever the sandbox wrote


def test_allowed_events_are_info_and_nilvalues_stand_for_missing_fields():
    msg = rfc5424.message("request", {"decision": "allow"}, hostname="", procid="", at=AT)
    m, sd, _ = split(msg)
    assert sd == f'[{rfc5424.SD_ID} event="request" decision="allow"]'
    assert int(m.group(1)) == 13 * 8 + 6
    assert m.group(3) == b"-" and m.group(5) == b"-"
    assert rfc5424.structured_data({}) == "-"


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=8), st.integers(0, 50))
def test_frames_split_back_whatever_the_chunking(messages, cut):
    stream = b"".join(rfc5424.frame(m) for m in messages)
    got, rest = rfc5424.unframe(stream)
    assert got == [m for m in messages] and rest == b""
    # a receiver reading a prefix sees whole frames only, and keeps the rest
    head, tail = stream[:cut], stream[cut:]
    first, left = rfc5424.unframe(head)
    more, end = rfc5424.unframe(left + tail)
    assert first + more == messages and end == b""


@pytest.mark.parametrize("bad", [b"x 1", b"01 a", b"-1 a"])
def test_a_malformed_count_is_an_error(bad):
    with pytest.raises(ValueError):
        rfc5424.unframe(bad)


@pytest.mark.parametrize(("url", "target"), [
    ("tcp://127.0.0.1:514", Target("127.0.0.1", 514, False)),
    ("tcp+tls://logs.example:6514", Target("logs.example", 6514, True)),
    ("tcp+tls://[::1]:6514", Target("::1", 6514, True)),
])
def test_targets(url, target):
    assert parse_target(url) == target


@pytest.mark.parametrize(("url", "words"), [
    ("udp://h:514", "UDP is not offered"),
    ("h:514", "tcp://HOST:PORT"),
    ("tcp://h", "needs a host and a port"),
    ("tcp://:514", "needs a host and a port"),
    ("tcp://h:99999", "needs a host and a port"),
    ("tcp://h:514/x", "only scheme, host and port"),
])
def test_bad_targets_say_why(url, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_target(url)


class Collector:
    """A plain TCP receiver that collects frames (a stand-in: rsyslog is the integration one)."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.sock = sock or socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.frames: list[bytes] = []
        self.got = threading.Condition()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            buf = b""
            with conn:
                while data := conn.recv(65536):
                    frames, buf = rfc5424.unframe(buf + data)
                    with self.got:
                        self.frames += frames
                        self.got.notify_all()

    def wait(self, n: int, timeout: float = 10) -> list[bytes]:
        with self.got:
            assert self.got.wait_for(lambda: len(self.frames) >= n, timeout), self.frames
            return list(self.frames)

    def close(self) -> None:
        self.sock.close()


def test_the_sender_delivers_in_order_and_counts():
    c = Collector()
    counters = ExportCounters()
    sink = SyslogSink(Target("127.0.0.1", c.port, False), counters, hostname="h")
    try:
        for i in range(5):
            sink.on_audit("request", {"decision": "allow", "n": i})
        frames = c.wait(5)
        assert [split(f)[2]["n"] for f in frames] == [0, 1, 2, 3, 4]
        deadline = time.monotonic() + 5  # counted just after the bytes went out
        while counters.value("syslog", dropped=False) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counters.value("syslog", dropped=False) == 5
        assert counters.value("syslog") == 0
    finally:
        sink.close()
        c.close()


def test_a_collector_that_is_down_costs_queued_messages_not_the_caller():
    # nothing listens: the caller never waits, the queue takes what it can, the rest is counted
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counters = ExportCounters()
    sink = SyslogSink(Target("127.0.0.1", port, False), counters, queue_max=3)
    for i in range(10):
        sink.on_audit("request", {"n": i})
    # at most 3 queued and 1 being retried by the sender: at least 6 dropped at once
    assert counters.value("syslog") >= 6
    # the collector comes up: what was kept is delivered after the backoff
    c = Collector(socket.create_server(("127.0.0.1", port)))
    try:
        frames = c.wait(3)
        assert all(split(f)[2]["event"] == "request" for f in frames)
    finally:
        sink.close()
        c.close()


def test_the_ca_option_is_for_tls_only(tmp_path):
    with pytest.raises(ValueError, match="tcp\\+tls"):
        SyslogSink(Target("127.0.0.1", 1, False), ExportCounters(), ca=tmp_path / "ca.pem")


def test_the_message_follows_the_audit_format():
    """`--audit-format ocsf`: the MSG is the OCSF event (valid against the schema); the
    structured data and the header stay the same."""
    from tests.support.ocsf_schema import check

    fields = {"decision": "deny", "code": "no_rule", "identity": "agent", "method": "GET",
              "scheme": "https", "host": "x.test", "port": 443, "path": "/p"}
    plain = rfc5424.message("request", fields, hostname="gw", procid="1", at=AT)
    ocsf = rfc5424.message("request", fields, hostname="gw", procid="1", at=AT,
                           audit_format="ocsf")
    head, _, body = ocsf.decode().partition("\ufeff")
    assert head == plain.decode().partition("\ufeff")[0]
    event = json.loads(body)
    check(event)
    assert event["class_uid"] == 4002 and event["unmapped"]["path"] == "/p"
    assert "class_uid" not in json.loads(plain.decode().partition("\ufeff")[2])
