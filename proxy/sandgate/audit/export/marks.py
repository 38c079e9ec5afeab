"""Instants the stages mark on a flow's record (FlowRecord.marks, time.time_ns()), read by the
span export (sandgate.audit.export.otel) for the durations of a request's parts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandgate.stages.flow import FlowRecord

VAULT_START = "vault_start"  # s50_inject: the rule's secrets are being read
VAULT_END = "vault_end"  # ...and are all there
FORWARDED = "forwarded"  # s60_dial: judged, pinned, handed to mitmproxy to dial and send


def mark(rec: FlowRecord, name: str) -> None:
    rec.marks[name] = time.time_ns()
