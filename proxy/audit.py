"""The audit stream: one canonical JSON object per line for every decision Sandgate makes.

Field names are the module constants below; the proxy uses only those. Values are never secret:
secrets appear as "name@version", query values are replaced by REDACTED.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TextIO

import structlog

TIME = "time"
EVENT = "event"
IDENTITY = "identity"
SANDBOX = "sandbox"
IDENTITY_SOURCE = "identity_source"
CLIENT = "client"
METHOD = "method"
SCHEME = "scheme"
HOST = "host"
PORT = "port"
PATH = "path"
RULE = "rule"
DECISION = "decision"  # "allow" / "deny"
CODE = "code"
REASON = "reason"
SECRETS = "secrets"  # list of "name@version"
UPSTREAM_STATUS = "upstream_status"
BYTES_IN = "bytes_in"
BYTES_OUT = "bytes_out"
DURATION_MS = "duration_ms"
DIALED = "dialed"  # ip:port actually dialled
EXFIL = "exfiltration"  # names of secrets / placeholders seen where they are not bound
REDACTIONS = "redactions"

REDACTED = "REDACTED"


def redact_path(path_with_query: str) -> str:
    """Keep the path and the query parameter names; replace every query value by REDACTED.

    ``/a?key=s3cr3t&x=1`` -> ``/a?key=REDACTED&x=REDACTED``. A query part without ``=`` might
    itself be a credential, so it is replaced whole; a fragment is dropped to ``#REDACTED``.
    Never raises on odd input.
    """
    if not isinstance(path_with_query, str):
        path_with_query = str(path_with_query)
    rest, hash_, fragment = path_with_query.partition("#")
    path, qmark, query = rest.partition("?")
    out = path
    if qmark:
        parts: list[str] = []
        for part in query.split("&"):
            if not part:
                parts.append(part)
                continue
            name, eq, _ = part.partition("=")
            parts.append(f"{name}={REDACTED}" if eq else REDACTED)
        out += "?" + "&".join(parts)
    if hash_:
        out += "#" + (REDACTED if fragment else "")
    return out


def _timestamp() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _canonical(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """TIME first, EVENT second, then the fields in the order given."""
    event = event_dict.pop(EVENT, None)
    event_dict.pop(TIME, None)
    return {TIME: _timestamp(), EVENT: event, **event_dict}


class AuditLog:
    """Writes audit events as JSON lines to stdout, an open text stream, or a file (appended).

    Uses a dedicated structlog logger; the global structlog configuration is left untouched.
    """

    def __init__(self, sink: TextIO | str | Path | None = None) -> None:
        self._owned: IO[str] | None = None
        stream: TextIO
        if sink is None:
            stream = sys.stdout
        elif isinstance(sink, str | Path):
            path = Path(sink)
            self._owned = open(  # closed by close()
                path, "a", buffering=1, encoding="utf-8",
                opener=lambda p, flags: os.open(p, flags, 0o600),
            )
            stream = self._owned
        else:
            stream = sink
        self._stream = stream
        self._lock = threading.Lock()
        self._closed = False
        self._log = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=[_canonical, structlog.processors.JSONRenderer(default=str)],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
            cache_logger_on_first_use=False,
        )

    def emit(self, event: str, **fields: Any) -> None:
        """Write one JSON object on one line: time, event, then `fields` as given."""
        with self._lock:
            if self._closed:
                raise ValueError("audit log is closed")
            self._log.msg(event, **fields)

    def close(self) -> None:
        """Close the file this log opened (a stream passed in, or stdout, is only flushed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owned is not None:
                self._owned.close()
            else:
                with contextlib.suppress(ValueError):  # already closed by its owner
                    self._stream.flush()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
