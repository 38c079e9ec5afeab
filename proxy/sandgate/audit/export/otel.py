"""`--otlp ENDPOINT`: one OpenTelemetry span per audited request and tunnel, through the SDK.

The span is built when the flow's audit event is written (s90_audit), from that event's fields
(already scrubbed of every secret value) and the instants the stages marked on the FlowRecord
(`marks`): it starts at the request's first byte and ends at its audit, with child spans for the
Vault fetch, the upstream dial and the upstream exchange. Its parent is the sandbox's
`traceparent` when it sent a valid one (sandgate.audit.export.traceparent), so the agent's
trace shows Sandgate's decision.

The SDK does the rest as its users expect: the OTLP/HTTP exporter (or gRPC with
OTEL_EXPORTER_OTLP_PROTOCOL=grpc and the `otlp-grpc` extra), OTEL_EXPORTER_OTLP_HEADERS,
_TIMEOUT, _CERTIFICATE, _COMPRESSION, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER and OTEL_BSP_* are read by it. Spans go through a BatchSpanProcessor: a
bounded queue drained by the SDK's thread, so a down or slow collector never holds a request;
what the queue cannot take, or the collector refuses, is counted in sandgate_export_dropped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceFlags, TraceState

from sandgate.audit import events as A
from sandgate.audit.export import traceparent as tp
from sandgate.audit.export.counters import ExportCounters
from sandgate.audit.export.marks import FORWARDED, VAULT_END, VAULT_START

if TYPE_CHECKING:
    from mitmproxy import http

    from sandgate.scrub.scrubber import SecretSet
    from sandgate.stages.flow import FlowRecord

log = logging.getLogger("sandgate")

SINK = "otlp"
PROTOCOLS = ("http/protobuf", "grpc")

# Audit fields with an OpenTelemetry semantic-convention name; the rest are `sandgate.<field>`
_SEMCONV = {A.METHOD: "http.request.method", A.SCHEME: "url.scheme", A.HOST: "server.address",
            A.PORT: "server.port", A.UPSTREAM_STATUS: "http.response.status_code",
            A.BYTES_IN: "http.request.body.size", A.BYTES_OUT: "http.response.body.size"}
_SKIP = frozenset({A.PATH, A.CLIENT, A.DURATION_MS})  # split below / the span's own duration


def protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf."""
    value = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if value not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r}: Sandgate exports "
                         f"{' or '.join(PROTOCOLS)}")
    return value


def env_endpoint() -> str | None:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def traces_url(endpoint: str) -> str:
    """--otlp is a base URL like OTEL_EXPORTER_OTLP_ENDPOINT: OTLP/HTTP posts to /v1/traces
    under it (a URL already ending so is kept)."""
    if endpoint.rstrip("/").endswith("/v1/traces"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


def exporter(endpoint: str | None) -> SpanExporter:
    """The SDK's OTLP exporter for `endpoint` (None: the OTEL_EXPORTER_OTLP_* variables)."""
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp {endpoint!r}: give the collector's URL, e.g. "
                         "http://127.0.0.1:4318 (OTLP/HTTP) or http://127.0.0.1:4317 (gRPC)")
    if protocol() == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ValueError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the otlp-grpc extra: "
                             "pip install 'sandgate[otlp-grpc]'") from None
        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint is not None else None)


def resource(instance: str | None) -> Resource:
    """service.name "sandgate" unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name one."""
    attrs: dict[str, str] = {}
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", "")
    if not named:
        attrs["service.name"] = "sandgate"
    if instance:
        attrs["service.instance.id"] = instance
    return Resource.create(attrs)


class _Counted(SpanExporter):
    """The exporter, counting what it sent and what the collector did not take."""

    def __init__(self, inner: SpanExporter, counters: ExportCounters) -> None:
        self._inner = inner
        self._counters = counters

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            log.exception("sandgate: OTLP export failed")
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._counters.sent(SINK, len(spans))
        else:
            self._counters.dropped(SINK, len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _Batch(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans its full queue pushes out."""

    def __init__(self, exporter: SpanExporter, counters: ExportCounters,
                 max_queue_size: int | None) -> None:
        # a batch is at most the queue (the SDK refuses a larger one; 512 is its default)
        batch = min(max_queue_size, 512) if max_queue_size is not None else None
        super().__init__(exporter, max_queue_size=max_queue_size, max_export_batch_size=batch)
        self._counters = counters

    def on_end(self, span: ReadableSpan) -> None:
        batch = getattr(self, "_batch_processor", None)
        queue = getattr(batch, "_queue", None)
        if (span.context is not None and span.context.trace_flags.sampled
                and queue is not None and queue.maxlen is not None
                and len(queue) >= queue.maxlen):
            self._counters.dropped(SINK)  # the SDK drops the oldest to take this one
        super().on_end(span)


class SpanExport:
    """Spans of audited flows, handed to a batch processor."""

    def __init__(self, span_exporter: SpanExporter, counters: ExportCounters, *,
                 instance: str | None = None, max_queue_size: int | None = None) -> None:
        self._provider = TracerProvider(resource=resource(instance))
        self._processor = _Batch(_Counted(span_exporter, counters), counters, max_queue_size)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("sandgate")

    def flow_audited(self, event: str, flow: http.HTTPFlow, rec: FlowRecord,
                     fields: Mapping[str, Any], secrets: SecretSet) -> None:
        """The span of one flow's audit event (`request` or `connect`)."""
        found = rec.trace if rec.trace is not None else tp.read(flow.request.headers)
        parent = _parent(found, secrets)
        start = _ns(flow.request.timestamp_start) or time.time_ns()
        end = max(time.time_ns(), start)
        host = fields.get(A.HOST)
        port = fields.get(A.PORT)
        method = str(fields.get(A.METHOD) or "")
        name = f"CONNECT {host}:{port}" if method == "CONNECT" else f"{method} {host}"
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                       attributes=attributes(event, fields), start_time=start)
        inside = trace.set_span_in_context(span)
        marks = rec.marks
        if VAULT_START in marks:
            child = self._tracer.start_span("vault fetch", context=inside,
                                            kind=SpanKind.INTERNAL, start_time=marks[VAULT_START],
                                            attributes={"sandgate.secrets": list(rec.secrets)})
            child.end(marks.get(VAULT_END, end))
        self._dial(flow, inside, start, end)
        if FORWARDED in marks:
            resp = flow.response
            finished = _ns(resp.timestamp_end) if resp is not None and not rec.refused else None
            child = self._tracer.start_span("upstream", context=inside, kind=SpanKind.CLIENT,
                                            start_time=marks[FORWARDED])
            if fields.get(A.UPSTREAM_STATUS) is not None:
                child.set_attribute("http.response.status_code", fields[A.UPSTREAM_STATUS])
            if fields.get(A.ERROR):
                child.set_status(Status(StatusCode.ERROR, str(fields[A.ERROR])))
            child.end(min(max(finished or end, marks[FORWARDED]), end))
        if fields.get(A.DECISION) == "deny" or fields.get(A.ERROR):
            span.set_status(Status(StatusCode.ERROR, str(fields.get(A.CODE) or "upstream error")))
        span.end(end)

    def _dial(self, flow: http.HTTPFlow, inside: Any, start: int, end: int) -> None:
        """The upstream connection, when it was opened for this flow (not a reused one)."""
        server = flow.server_conn
        began = _ns(server.timestamp_start)
        done = _ns(server.timestamp_tls_setup) or _ns(server.timestamp_tcp_setup)
        if began is None or began < start:
            return
        child = self._tracer.start_span("dial", context=inside, kind=SpanKind.CLIENT,
                                        start_time=began)
        peer = server.peername
        if peer:
            child.set_attribute("network.peer.address", str(peer[0]))
            child.set_attribute("network.peer.port", int(peer[1]))
        child.set_attribute("sandgate.tls", server.timestamp_tls_setup is not None)
        if done is None:
            child.set_status(Status(StatusCode.ERROR, "not connected"))
        child.end(min(max(done or end, began), end))

    def close(self, wait: float = 2.0) -> None:
        """Flush for at most `wait` seconds; the SDK's own shutdown (which may wait for a
        retrying exporter) goes on in the background."""
        self._processor.force_flush(int(wait * 1000))
        threading.Thread(target=self._provider.shutdown, daemon=True,
                         name="sandgate-otlp-shutdown").start()

    def force_flush(self, timeout_millis: int = 5000) -> bool:
        return self._processor.force_flush(timeout_millis)


def _ns(seconds: float | None) -> int | None:
    return int(seconds * 1e9) if seconds else None


def _parent(found: tp.TraceHeaders, secrets: SecretSet) -> Any:
    """The sandbox's span as a remote parent, or None (a new trace). Headers carrying a secret
    value (in any form the scrubber knows) are not continued: the trace id would export it."""
    for value in (*found.traceparent, *found.tracestate):
        if secrets.scrub_text(value)[1]:
            return None
    p = tp.parse(found)
    if p is None:
        return None
    try:
        state = TraceState.from_header([p.tracestate]) if p.tracestate else None
    except Exception:
        state = None
    ctx = SpanContext(p.trace_id, p.span_id, is_remote=True, trace_flags=TraceFlags(p.flags),
                      trace_state=state)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def attributes(event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The span's attributes: semantic-convention names where one fits, `sandgate.<field>`
    for the rest; lists stay lists of strings, objects become JSON text."""
    out: dict[str, Any] = {"sandgate.event": event}
    for key, value in fields.items():
        if value is None or key in _SKIP or value == [] or value == {}:
            continue
        out[_SEMCONV.get(key, f"sandgate.{key}")] = _value(value)
    path = fields.get(A.PATH)
    if isinstance(path, str):
        p, q, query = path.partition("?")
        out["url.path"] = p
        if q:
            out["url.query"] = query  # values REDACTED as in the audit file
    client = fields.get(A.CLIENT)
    if isinstance(client, str) and ":" in client:
        addr, _, cport = client.rpartition(":")
        out["client.address"] = addr
        if cport.isdigit():
            out["client.port"] = int(cport)
    return out


def _value(value: Any) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list | tuple):
        return [v if isinstance(v, str) else json.dumps(v, default=str, sort_keys=True)
                for v in value]
    return json.dumps(value, default=str, sort_keys=True)
