"""Running for months: what is in flight, graceful shutdown, and the process log format.

`Lifecycle` is a small mitmproxy addon that tracks the flows in progress (a request from its head
to its last response byte, a WebSocket until it ends); `drain` stops the listener (mitmproxy's
listening sockets close, established connections stay open), waits for those flows to finish up
to a deadline, then lets the master shut down.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, TextIO

import structlog
from mitmproxy import connection, http, master

log = logging.getLogger("sandgate")


class Lifecycle:
    def __init__(self) -> None:
        self.inflight: dict[str, str] = {}  # flow id -> client connection id
        self.draining = False

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.inflight[flow.id] = flow.client_conn.id

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None:
            self.inflight.pop(flow.id, None)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self.inflight.pop(flow.id, None)

    def error(self, flow: http.HTTPFlow) -> None:
        self.inflight.pop(flow.id, None)

    def client_disconnected(self, client: connection.Client) -> None:
        for fid in [f for f, c in self.inflight.items() if c == client.id]:
            del self.inflight[fid]


def listener_up(m: master.Master) -> bool:
    ps = m.addons.get("proxyserver")
    return ps is not None and any(inst.is_running for inst in ps.servers)


def open_connections(m: master.Master) -> int:
    ps = m.addons.get("proxyserver")
    return len(ps.connections) if ps is not None else 0


async def drain(m: master.Master, lc: Lifecycle, timeout: float) -> dict[str, Any]:
    """Stop accepting, wait for in-flight flows (up to `timeout` s), then shut the master down."""
    lc.draining = True
    started = time.monotonic()
    ps = m.addons.get("proxyserver")
    if ps is not None:
        for inst in list(ps.servers):
            if inst.is_running:
                try:
                    await inst.stop()  # closes the listening sockets only
                except Exception:
                    log.exception("sandgate: stopping the listener failed")
    log.info("sandgate: draining: %d flow(s) in flight, up to %gs", len(lc.inflight), timeout)
    deadline = started + timeout
    while lc.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = len(lc.inflight)
    result = {"drained": left == 0, "unfinished": left,
              "seconds": round(time.monotonic() - started, 3)}
    if left:
        log.warning("sandgate: drain timeout: %d flow(s) still in flight are cut", left)
    m.shutdown()
    return result


# ------------------------------------------------------------------------------------ logging

def default_log_format(stream: TextIO = sys.stderr) -> str:
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


_TAGS: dict[str, Any] = {}


def tag_logs(**fields: Any) -> None:
    """Add these fields to every process log line from now on (a worker's id, with --workers)."""
    _TAGS.update(fields)


def _add_tags(_logger: Any, _method: str, event_dict: Any) -> Any:
    if _TAGS:
        event_dict.update(_TAGS)
    return event_dict


def formatter(fmt: str) -> logging.Formatter:
    """A stdlib formatter rendering every record (Sandgate's and mitmproxy's) through structlog:
    one JSON object per line, or readable key=value lines."""
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" \
        else structlog.dev.ConsoleRenderer(colors=False)
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_tags,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )


def configure_logging(fmt: str, stream: TextIO = sys.stderr) -> logging.Handler:
    """Sandgate's own records (logger "sandgate*") before mitmproxy takes over the root logger;
    returns the handler so the runner can give mitmproxy's handler the same formatter."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(fmt))
    logger = logging.getLogger("sandgate")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler
