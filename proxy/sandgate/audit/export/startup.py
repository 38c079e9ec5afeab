"""`sandgate run`'s export options, and the exports they start (one call each from cli/run.py
and runner/build.py)."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandgate.audit.export.counters import ExportCounters

if TYPE_CHECKING:
    from mitmproxy import http
    from prometheus_client.registry import CollectorRegistry

    from sandgate.audit.events import AuditLog
    from sandgate.audit.export.otel import SpanExport
    from sandgate.audit.export.syslog import SyslogSink
    from sandgate.scrub.scrubber import SecretSet
    from sandgate.stages.flow import FlowRecord

log = logging.getLogger("sandgate")


@dataclass(frozen=True)
class ExportConfig:
    otlp: str | None = None  # --otlp ENDPOINT (else OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)
    syslog: str | None = None  # --audit-syslog tcp[+tls]://HOST:PORT
    syslog_ca: Path | None = None  # --audit-syslog-ca FILE

    @property
    def otlp_on(self) -> bool:
        """--otlp, or the standard variables (unless the SDK is switched off by them)."""
        from sandgate.audit.export.otel import env_endpoint

        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            return False
        return self.otlp is not None or env_endpoint() is not None


def add_arguments(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group("audit export (docs/audit-export.md)")
    group.add_argument("--otlp", default=None, metavar="ENDPOINT",
                       help="send a span per request and tunnel to this OpenTelemetry "
                       "collector (OTLP/HTTP base URL, e.g. http://127.0.0.1:4318; default: env "
                       "OTEL_EXPORTER_OTLP_ENDPOINT; the other OTEL_* variables apply)")
    group.add_argument("--audit-syslog", default=None, metavar="URL",
                       help="also send every audit event to this syslog collector as RFC 5424 "
                       "(tcp://HOST:PORT or tcp+tls://HOST:PORT, octet-counted)")
    group.add_argument("--audit-syslog-ca", type=Path, default=None, metavar="FILE",
                       help="the CA that signed the tcp+tls collector's certificate (default: "
                       "the system's trust store)")


def from_args(args: argparse.Namespace) -> ExportConfig:
    """The options, checked (ValueError says what is wrong)."""
    from sandgate.audit.export import otel, syslog

    cfg = ExportConfig(otlp=args.otlp, syslog=args.audit_syslog, syslog_ca=args.audit_syslog_ca)
    if cfg.syslog is not None:
        target = syslog.parse_target(cfg.syslog)
        if cfg.syslog_ca is not None and not target.tls:
            raise ValueError("--audit-syslog-ca is for a tcp+tls:// collector")
    elif cfg.syslog_ca is not None:
        raise ValueError("--audit-syslog-ca needs --audit-syslog tcp+tls://HOST:PORT")
    if cfg.syslog_ca is not None and not cfg.syslog_ca.is_file():
        raise ValueError(f"--audit-syslog-ca {cfg.syslog_ca}: no such file")
    if cfg.otlp_on:
        otel.exporter(cfg.otlp)  # the URL and protocol are checked now, not at the first span
    return cfg


class Exports:
    """The running exports of one process."""

    def __init__(self, counters: ExportCounters, spans: SpanExport | None,
                 syslog: SyslogSink | None) -> None:
        self.counters = counters
        self.spans = spans
        self.syslog = syslog

    def flow_audited(self, event: str, flow: http.HTTPFlow, rec: FlowRecord,
                     fields: dict[str, Any], secrets: SecretSet) -> None:
        """GateConfig.flow_audited: never raises (a span must not cost a request)."""
        if self.spans is None:
            return
        try:
            self.spans.flow_audited(event, flow, rec, fields, secrets)
        except Exception:
            log.exception("sandgate: building the span of a flow failed")
            self.counters.dropped("otlp")

    def close(self) -> None:
        if self.syslog is not None:
            self.syslog.close()
        if self.spans is not None:
            self.spans.close()


def start(cfg: ExportConfig, sink: AuditLog, registry: CollectorRegistry,
          instance: str | None) -> Exports:
    """Start what `cfg` asks for: syslog listens to the audit log, spans are built by the gate
    (its flow_audited), both counted on /metrics."""
    counters = ExportCounters()
    registry.register(counters)
    spans = syslog_sink = None
    if cfg.otlp_on:
        from sandgate.audit.export.otel import SpanExport, exporter

        spans = SpanExport(exporter(cfg.otlp), counters, instance=instance)
        log.info("sandgate: spans to %s", cfg.otlp or "the OTEL_EXPORTER_OTLP_* endpoint")
    if cfg.syslog is not None:
        from sandgate.audit.export.syslog import SyslogSink, parse_target

        syslog_sink = SyslogSink(parse_target(cfg.syslog), counters, ca=cfg.syslog_ca,
                                 instance=instance, audit_format=sink.format)
        sink.add_listener(syslog_sink.on_audit)
        log.info("sandgate: audit events also to syslog %s", syslog_sink.target)
    return Exports(counters, spans, syslog_sink)
