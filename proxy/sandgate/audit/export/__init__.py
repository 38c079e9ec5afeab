"""Copies of the audit stream for other systems: OpenTelemetry spans and syslog messages.

The audit file (sandgate.audit.events) stays the record: it is written first, and a request
waits for it (a failed write fails closed). The exports here only read what was written: each
hands its copy to a bounded queue that a background thread or the SDK's batch processor drains,
so a collector that is down or slow costs dropped copies (counted in `sandgate_export_dropped`),
never a request and never an audit line.

    traceparent.py  the sandbox's W3C trace context: read, then stripped before forwarding
    otel.py         a span per request and tunnel (--otlp, OTEL_EXPORTER_OTLP_*)
    syslog.py       RFC 5424 messages over TCP or TLS with octet counting (--audit-syslog)
    rfc5424.py      the message format (pure)
    counters.py     the dropped-copy counter, exposed on /metrics
"""
