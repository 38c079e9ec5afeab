"""The sandbox's W3C Trace Context (`traceparent`, `tracestate`): read, and kept from the upstream.

Sandgate's span of a request continues the sandbox's trace (sandgate.audit.export.otel), so the
agent's own trace shows what the proxy decided. The headers themselves are the sandbox's: they are
removed before the request is forwarded (s40_forward, with the other headers the upstream must
not get from the client) unless the allowing rule says `forward_trace_context: true`. They are
then forwarded exactly as the sandbox sent them (Sandgate's span is a sibling of the upstream's,
both children of the sandbox's span). `sandgate explain` says which.

`parse` is the W3C Trace Context level 1 grammar (section 3.2), pure and property-tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mitmproxy import http

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HEADERS = (TRACEPARENT, TRACESTATE)

# version "00" is exactly this; a later version may append "-..." (3.2.4: parse what is known)
_FIELDS = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z",
                     re.DOTALL)
_OWS = " \t"
TRACESTATE_MAX = 512  # W3C 3.3.1.1: at least 512 characters must be propagated; we keep that


@dataclass(frozen=True)
class TraceHeaders:
    """The raw values the sandbox sent (each header's values, in order)."""

    traceparent: tuple[str, ...]
    tracestate: tuple[str, ...]


@dataclass(frozen=True)
class TraceParent:
    trace_id: int
    span_id: int
    flags: int
    tracestate: str | None  # the combined tracestate, None when absent or too long

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def read(headers: http.Headers) -> TraceHeaders:
    return TraceHeaders(tuple(headers.get_all(TRACEPARENT)), tuple(headers.get_all(TRACESTATE)))


def take(headers: http.Headers, forward: bool) -> TraceHeaders:
    """The trace headers of a request about to be forwarded; removed unless `forward`."""
    found = read(headers)
    if not forward:
        for name in HEADERS:
            headers.pop(name, None)
    return found


def parse(found: TraceHeaders) -> TraceParent | None:
    """The parent a span continues, or None (absent or invalid: W3C 3.2.2.3 says start a new
    trace). Two traceparent headers are invalid; tracestate lines are joined by commas."""
    if len(found.traceparent) != 1:
        return None
    value = found.traceparent[0].strip(_OWS)
    m = _FIELDS.match(value)
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if tid == 0 or sid == 0:
        return None
    state = ",".join(v.strip(_OWS) for v in found.tracestate) or None
    if state is not None and len(state) > TRACESTATE_MAX:
        state = None
    return TraceParent(tid, sid, int(flags, 16), state)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The version-00 header of a context (the inverse of parse for valid input)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
