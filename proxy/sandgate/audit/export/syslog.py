"""`--audit-syslog tcp://HOST:PORT` / `tcp+tls://HOST:PORT`: every audit event, also as an RFC
5424 message to a syslog collector, octet-counted (RFC 6587; RFC 5425 over TLS).

An AuditLog listener formats the event and puts it on a bounded queue; one thread sends. The
request never waits for the collector: a full queue drops the new message (counted), a broken
connection is dialled again with a doubling backoff while messages queue. The message being sent
when a connection breaks is sent again on the next one (a collector may see it twice, never
half of it). The audit file is written before any of this and does not depend on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import ssl
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sandgate.audit.export import rfc5424
from sandgate.audit.export.counters import ExportCounters

log = logging.getLogger("sandgate")

SINK = "syslog"
SCHEMES = ("tcp", "tcp+tls")
QUEUE_MAX = 10_000
BACKOFF_FIRST = 0.2
BACKOFF_MAX = 30.0
SEND_TIMEOUT = 10.0  # a collector that takes no bytes for this long is dialled again


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    tls: bool

    def __str__(self) -> str:
        return f"{'tcp+tls' if self.tls else 'tcp'}://{self.host}:{self.port}"


def parse_target(url: str) -> Target:
    """tcp://HOST:PORT or tcp+tls://HOST:PORT (an IPv6 host in brackets). ValueError says
    what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--audit-syslog {url!r}: give tcp://HOST:PORT or tcp+tls://HOST:PORT "
                         "(UDP is not offered: it loses messages silently)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or port == 0:
        raise ValueError(f"--audit-syslog {url!r}: needs a host and a port")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"--audit-syslog {url!r}: only scheme, host and port are read")
    return Target(parts.hostname, port, parts.scheme == "tcp+tls")


def tls_context(ca: Path | None) -> ssl.SSLContext:
    """Verify the collector's certificate and name: against `ca` when given, else the
    system's trust store."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class SyslogSink:
    """The sender: `on_audit` is the AuditLog listener, `close` flushes for a moment."""

    def __init__(self, target: Target, counters: ExportCounters, *, ca: Path | None = None,
                 queue_max: int = QUEUE_MAX, hostname: str | None = None,
                 instance: str | None = None, audit_format: str = "json") -> None:
        if ca is not None and not target.tls:
            raise ValueError("--audit-syslog-ca is for tcp+tls:// collectors")
        self.target = target
        self._counters = counters
        self._ctx = tls_context(ca) if target.tls else None
        self._queue: queue.Queue[bytes | None] = queue.Queue(queue_max)
        self._hostname = hostname or socket.gethostname()
        self._procid = str(os.getpid())
        self._instance = instance
        self._format = audit_format  # the MSG follows --audit-format
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="sandgate-syslog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the request side

    def on_audit(self, event: str, fields: dict[str, Any]) -> None:
        """Queue one event; never blocks (a full queue drops it, counted)."""
        extra = {"instance": self._instance} if self._instance is not None else {}
        msg = rfc5424.message(event, {**extra, **fields}, hostname=self._hostname,
                              procid=self._procid, at=datetime.now(UTC),
                              audit_format=self._format)
        try:
            self._queue.put_nowait(rfc5424.frame(msg))
        except queue.Full:
            self._counters.dropped(SINK)

    # ------------------------------------------------------------------ the sender thread

    def _run(self) -> None:
        backoff = BACKOFF_FIRST
        pending: bytes | None = None
        while True:
            if pending is None:
                pending = self._queue.get()
                if pending is None:
                    break  # close()
            try:
                sock = self._connected()
                sock.sendall(pending)
            except (OSError, ssl.SSLError) as e:
                self._drop_connection()
                log.warning("sandgate: syslog collector %s: %s; retrying in %.1f s",
                            self.target, type(e).__name__, backoff)
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            self._counters.sent(SINK)
            pending = None
            backoff = BACKOFF_FIRST
        self._drop_connection()

    def _connected(self) -> socket.socket:
        sock = self._sock
        if sock is not None and _closed_by_peer(sock):
            self._drop_connection()
            sock = None
        if sock is None:
            raw = socket.create_connection((self.target.host, self.target.port),
                                           timeout=SEND_TIMEOUT)
            try:
                sock = (self._ctx.wrap_socket(raw, server_hostname=self.target.host)
                        if self._ctx is not None else raw)
            except BaseException:
                raw.close()
                raise
            self._sock = sock
        return sock

    def _drop_connection(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self, wait: float = 2.0) -> None:
        """Send what is queued for at most `wait` seconds, then stop."""
        try:
            self._queue.put(None, timeout=wait)
        except queue.Full:
            pass
        self._thread.join(wait)
        self._stop.set()
        self._thread.join(1.0)
        dropped = self._queue.qsize()
        if dropped:
            self._counters.dropped(SINK, dropped)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Has the collector closed the connection? A write to a closed one would vanish unseen.
    A collector sends nothing but TLS records (a TLS 1.3 session ticket), which a
    non-blocking read consumes; end of stream or an error means the connection is over."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        sock.setblocking(False)
        try:
            return sock.recv(1) == b""
        finally:
            sock.settimeout(SEND_TIMEOUT)
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except (OSError, ValueError):
        return True
