"""The capture tables' counters as Prometheus metrics (sandgate.capture.nft_counters): parsed from a
recorded `nft -j list counters`, read at most once a second, absent (never a failed scrape)
when nft cannot be read, with one log line saying why."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sandgate.capture.nft_counters import CaptureCounters, parse

pytestmark = pytest.mark.unit

# `nft -j list counters` (nftables 1.0.6) with the table `sandgate capture` installs for the
# bridge br-sandgate0 (counts after some traffic) and an unrelated table beside it
RECORDED = """{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5",\
 "json_schema_version": 1}},\
 {"counter": {"family": "inet", "name": "captured", "table": "sandgate_capture_br_sandgate0",\
 "handle": 4, "packets": 12, "bytes": 720}},\
 {"counter": {"family": "inet", "name": "dns_allowed", "table": "sandgate_capture_br_sandgate0",\
 "handle": 5, "packets": 3, "bytes": 219}},\
 {"counter": {"family": "inet", "name": "dropped_quic", "table": "sandgate_capture_br_sandgate0",\
 "handle": 6, "packets": 0, "bytes": 0}},\
 {"counter": {"family": "inet", "name": "dropped_dns", "table": "sandgate_capture_br_sandgate0",\
 "handle": 7, "packets": 2, "bytes": 136}},\
 {"counter": {"family": "inet", "name": "dropped_tcp", "table": "sandgate_capture_br_sandgate0",\
 "handle": 8, "packets": 5, "bytes": 300}},\
 {"counter": {"family": "inet", "name": "dropped_udp", "table": "sandgate_capture_br_sandgate0",\
 "handle": 9, "packets": 1, "bytes": 29}},\
 {"counter": {"family": "inet", "name": "dropped_other", "table": "sandgate_capture_br_sandgate0",\
 "handle": 10, "packets": 0, "bytes": 0}},\
 {"counter": {"family": "ip", "name": "other", "table": "filter", "handle": 2, "packets": 99,\
 "bytes": 990}}]}"""


def scrape(collector: CaptureCounters) -> dict[tuple[str, str, str], float]:
    reg = CollectorRegistry()
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, s.labels["network"], s.labels["counter"])] = s.value
    return out


def test_parse_keeps_only_the_capture_tables() -> None:
    got = parse(RECORDED)
    assert len(got) == 7
    assert got[("br_sandgate0", "dropped_udp")] == (1, 29)
    assert got[("br_sandgate0", "captured")] == (12, 720)


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"nftables": 3}'])
def test_parse_refuses_what_is_not_nft_json(text: str) -> None:
    with pytest.raises(ValueError, match="nft -j output"):
        parse(text)


def test_metrics_from_the_recorded_output() -> None:
    got = scrape(CaptureCounters(lambda: RECORDED))
    assert got[("sandgate_capture_packets_total", "br_sandgate0", "dropped_dns")] == 2
    assert got[("sandgate_capture_bytes_total", "br_sandgate0", "dropped_tcp")] == 300
    assert {k[1] for k in got} == {"br_sandgate0"}
    assert len(got) == 14


def test_one_nft_run_per_second_whatever_the_scrapes() -> None:
    now = [100.0]
    runs: list[int] = []

    def read() -> str:
        runs.append(1)
        return RECORDED

    c = CaptureCounters(read, clock=lambda: now[0])
    for _ in range(5):
        c.reading()
    assert len(runs) == 1
    now[0] += 0.5
    c.reading()
    assert len(runs) == 1
    now[0] += 0.6
    c.reading()
    assert len(runs) == 2


def test_nft_missing_leaves_the_metric_absent_and_says_why_once(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]

    def missing() -> str:
        raise RuntimeError("nft (nftables) is not installed")

    c = CaptureCounters(missing, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sandgate.capture"):
        for _ in range(3):
            assert scrape(c) == {}
            now[0] += 2
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["capture counters not exported (sandgate_capture_*): "
                     "nft (nftables) is not installed"]


def test_a_failing_reading_after_a_good_one_drops_the_stale_values() -> None:
    now, answers = [0.0], [RECORDED]

    def read() -> str:
        if not answers:
            raise OSError("nft: Operation not permitted")
        return answers.pop()

    c = CaptureCounters(read, clock=lambda: now[0])
    assert scrape(c)
    now[0] += 2
    assert scrape(c) == {}
