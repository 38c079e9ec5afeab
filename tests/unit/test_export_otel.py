"""The sandbox's trace context (sandgate.audit.export.traceparent) and the span of a flow
(sandgate.audit.export.otel), with the SDK's in-memory exporter; the forward stage removing the
headers unless the rule says `forward_trace_context`; the export options' checks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sandgate.audit.export import otel, traceparent
from sandgate.audit.export import startup as setup
from sandgate.audit.export.counters import ExportCounters
from sandgate.audit.export.marks import FORWARDED, VAULT_END, VAULT_START
from sandgate.decision import decide
from sandgate.explain import answer as explain
from sandgate.policy.loader import load_policy_dir
from sandgate.request import parse_url
from sandgate.scrub.scrubber import SecretSet
from sandgate.stages import s40_forward
from sandgate.stages.flow import FlowRecord

pytestmark = pytest.mark.unit

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT = 0x00F067AA0BA902B7
HEADER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def th(tp: str | list[str] | None, ts: list[str] | None = None) -> traceparent.TraceHeaders:
    values = [] if tp is None else [tp] if isinstance(tp, str) else tp
    return traceparent.TraceHeaders(tuple(values), tuple(ts or ()))


# --- the W3C grammar ----------------------------------------------------------------------------

@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.integers(0, 255))
def test_a_formatted_context_parses_back(trace_id, span_id, flags):
    p = traceparent.parse(th(traceparent.format_traceparent(trace_id, span_id, flags)))
    assert p is not None and (p.trace_id, p.span_id, p.flags) == (trace_id, span_id, flags)


@pytest.mark.parametrize("bad", [
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # trace id all zero
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # parent id all zero
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  # 00 has nothing more
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short
    "",
])
def test_invalid_parents_start_a_new_trace(bad):
    assert traceparent.parse(th(bad)) is None


def test_a_later_version_is_read_as_far_as_known_and_two_headers_are_invalid():
    later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next"
    p = traceparent.parse(th(later))
    assert p is not None and p.trace_id == TRACE
    assert traceparent.parse(th([HEADER, HEADER])) is None


def test_tracestate_lines_are_joined_and_an_overlong_one_dropped():
    p = traceparent.parse(th(HEADER, ["a=1", " b=2 "]))
    assert p is not None and p.tracestate == "a=1,b=2" and p.sampled
    p = traceparent.parse(th(HEADER, ["a=" + "x" * 600]))
    assert p is not None and p.tracestate is None


@given(st.text(max_size=80))
def test_parse_never_raises(value):
    traceparent.parse(th(value, [value]))


# --- the forward stage ---------------------------------------------------------------------------

POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: plain, hosts: [a.example], private_cidrs: [127.0.0.0/8]}
      - {name: traced, hosts: [b.example], forward_trace_context: true,
         private_cidrs: [127.0.0.0/8]}
"""


@pytest.fixture
def policy(tmp_path: Path):
    d = tmp_path / "pol"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


async def forwarded(policy, host: str) -> tuple[http.Request, FlowRecord]:
    f = tflow.tflow()
    f.request.host = host
    f.request.headers["host"] = host
    f.request.headers.add("traceparent", HEADER)
    f.request.headers.add("tracestate", "v=1")
    rec = FlowRecord()
    rec.info = parse_url("GET", f"https://{host}/")
    rec.decision = decide(policy, "agent", rec.info)
    await s40_forward.prepare_head(None, f, rec)  # type: ignore[arg-type]
    return f.request, rec


async def test_the_trace_headers_stay_here_unless_the_rule_forwards_them(policy):
    req, rec = await forwarded(policy, "a.example")
    assert "traceparent" not in req.headers and "tracestate" not in req.headers
    assert rec.trace == th(HEADER, ["v=1"])  # kept for the span
    req, rec = await forwarded(policy, "b.example")
    assert req.headers["traceparent"] == HEADER and req.headers["tracestate"] == "v=1"
    assert rec.trace == th(HEADER, ["v=1"])


def test_every_spelling_and_copy_of_the_headers_is_removed():
    headers = http.Headers([(b"traceparent", b"a"), (b"TraceParent", b"b"),
                            (b"TRACESTATE", b"c"), (b"x", b"1")])
    found = traceparent.take(headers, forward=False)
    assert headers.fields == ((b"x", b"1"),)
    assert found == th(["a", "b"], ["c"]) and traceparent.parse(found) is None


def test_explain_says_what_happens_to_the_trace_context(policy):
    out, _ = explain.explain(policy, "agent", "GET", "https://a.example/")
    assert out["trace_context"] == "traceparent/tracestate removed before forwarding"
    out, _ = explain.explain(policy, "agent", "GET", "https://b.example/")
    assert "forwarded to the upstream" in out["trace_context"]


# --- the span --------------------------------------------------------------------------------

FIELDS = {"identity": "agent", "sandbox": "sb-1", "method": "POST", "scheme": "https",
          "host": "api.example", "port": 443, "path": "/v1/x?key=REDACTED", "rule": "llm",
          "decision": "allow", "code": None, "reason": "allowed", "secrets": ["openai@3"],
          "upstream_status": 200, "client": "127.0.0.1:5555", "duration_ms": 3.5,
          "redactions": 0, "rpc": [{"method": "tools/call", "tool": "t"}]}


def span_export() -> tuple[otel.SpanExport, InMemorySpanExporter, ExportCounters]:
    mem = InMemorySpanExporter()
    counters = ExportCounters()
    return otel.SpanExport(mem, counters, instance="gw-1"), mem, counters


def a_flow(headers: dict[str, str]) -> tuple[http.HTTPFlow, FlowRecord]:
    f = tflow.tflow(resp=True)
    now = time.time()
    f.request.timestamp_start = now - 0.05
    f.server_conn.timestamp_start = now - 0.04
    f.server_conn.timestamp_tcp_setup = now - 0.035
    f.server_conn.timestamp_tls_setup = now - 0.03
    f.server_conn.peername = ("127.0.0.2", 443)
    f.response.timestamp_end = now - 0.01  # type: ignore[union-attr]
    for k, v in headers.items():
        f.request.headers[k] = v
    rec = FlowRecord()
    ns = time.time_ns()
    rec.marks.update({VAULT_START: ns - 45_000_000, VAULT_END: ns - 42_000_000,
                      FORWARDED: ns - 41_000_000})
    return f, rec


def test_the_span_is_the_child_of_the_sandbox_span_with_the_parts_as_children():
    spans, mem, counters = span_export()
    f, rec = a_flow({"traceparent": HEADER, "tracestate": "v=1"})
    spans.flow_audited("request", f, rec, FIELDS, SecretSet({}))
    spans.force_flush()
    got = {s.name: s for s in mem.get_finished_spans()}
    main = got["POST api.example"]
    assert main.kind is SpanKind.SERVER
    assert main.parent is not None and main.parent.span_id == PARENT and main.parent.is_remote
    assert main.context.trace_id == TRACE
    assert main.context.trace_state.get("v") == "1"
    a = dict(main.attributes or {})
    assert a["sandgate.decision"] == "allow" and a["sandgate.identity"] == "agent"
    assert a["sandgate.sandbox"] == "sb-1" and a["sandgate.rule"] == "llm"
    assert a["sandgate.secrets"] == ("openai@3",)
    assert a["http.request.method"] == "POST" and a["server.address"] == "api.example"
    assert a["url.path"] == "/v1/x" and a["url.query"] == "key=REDACTED"
    assert a["http.response.status_code"] == 200
    assert a["client.address"] == "127.0.0.1" and a["client.port"] == 5555
    assert a["sandgate.rpc"] == ('{"method": "tools/call", "tool": "t"}',)
    assert "sandgate.code" not in a and "sandgate.duration_ms" not in a
    assert main.resource.attributes["service.name"] == "sandgate"
    assert main.resource.attributes["service.instance.id"] == "gw-1"
    for name in ("vault fetch", "dial", "upstream"):
        child = got[name]
        assert child.parent is not None and child.parent.span_id == main.context.span_id
        assert main.start_time <= child.start_time <= child.end_time <= main.end_time
    assert got["vault fetch"].end_time - got["vault fetch"].start_time == 3_000_000
    assert got["dial"].attributes["network.peer.address"] == "127.0.0.2"
    assert counters.value("otlp", dropped=False) == 4


def test_a_refusal_is_an_error_span_and_a_reused_connection_no_dial():
    spans, mem, _ = span_export()
    f, rec = a_flow({})
    f.server_conn.timestamp_start = f.request.timestamp_start - 10  # opened for an earlier flow
    rec.marks.clear()
    fields = {**FIELDS, "decision": "deny", "code": "no_rule", "upstream_status": None}
    spans.flow_audited("request", f, rec, fields, SecretSet({}))
    spans.force_flush()
    (main,) = mem.get_finished_spans()
    assert main.parent is None  # no traceparent: a trace of its own
    assert main.status.status_code is StatusCode.ERROR and main.status.description == "no_rule"


def test_a_trace_header_carrying_a_secret_is_not_continued():
    spans, mem, _ = span_export()
    key = "test-REAL-key-16"  # 16 bytes: its hex form is exactly a trace id
    secret_hex = key.encode().hex()
    f, rec = a_flow({"traceparent": f"00-{secret_hex}-00f067aa0ba902b7-01"})
    spans.flow_audited("request", f, rec, FIELDS, SecretSet({"k": key}))
    spans.force_flush()
    finished = mem.get_finished_spans()
    assert next(s for s in finished if s.name == "POST api.example").parent is None
    assert all(format(s.context.trace_id, "032x") != secret_hex for s in finished)


def test_a_full_queue_is_counted_not_waited_for():
    class Stuck(InMemorySpanExporter):
        def export(self, spans):  # a collector that never answers in time
            time.sleep(0.2)
            return super().export(spans)

    counters = ExportCounters()
    spans = otel.SpanExport(Stuck(), counters, max_queue_size=2)
    f, rec = a_flow({})
    rec.marks.clear()
    t0 = time.monotonic()
    for _ in range(50):
        spans.flow_audited("request", f, rec, FIELDS, SecretSet({}))
    assert counters.value("otlp") >= 40  # queued: 2 (+ a batch being exported)
    assert time.monotonic() - t0 < 5  # bounded, not 50 exports of 0.2 s
    spans.close(wait=0.1)


# --- options ---------------------------------------------------------------------------------

def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"otlp": None, "audit_syslog": None, "audit_syslog_ca": None,
                                 **kw})


@pytest.mark.parametrize(("kw", "words"), [
    ({"otlp": "127.0.0.1:4318"}, "give the collector's URL"),
    ({"audit_syslog": "udp://h:1"}, "UDP is not offered"),
    ({"audit_syslog_ca": Path("/x")}, "needs --audit-syslog tcp+tls"),
    ({"audit_syslog": "tcp://h:1", "audit_syslog_ca": Path("/x")}, "for a tcp+tls://"),
    ({"audit_syslog": "tcp+tls://h:1", "audit_syslog_ca": Path("/no/such")}, "no such file"),
])
def test_bad_options_say_why(kw, words, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match=words.replace("+", "\\+")):
        setup.from_args(args(**kw))


def test_the_standard_variables_turn_export_on_and_off(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not setup.from_args(args()).otlp_on
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert setup.from_args(args()).otlp_on
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not setup.from_args(args()).otlp_on
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/protobuf or grpc"):
        setup.from_args(args())


def test_otlp_is_a_base_url_like_the_standard_variable():
    assert otel.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otel.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert otel.traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_grpc_without_its_extra_says_how_to_get_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_grpc(name, *a, **kw):
        if name.startswith("opentelemetry.exporter.otlp.proto.grpc"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_grpc)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match=r"pip install 'sandgate\[otlp-grpc\]'"):
        otel.exporter("http://127.0.0.1:4317")
