"""The audit stream: one canonical JSON object per line for every decision Sandgate makes.

Field names are the module constants below; the proxy uses only those. Values are never secret:
secrets appear as "name@version", query values are replaced by REDACTED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

import structlog

from sandgate.policy.query_audit import kept_query_names

if TYPE_CHECKING:
    from mitmproxy import http

    from sandgate.addons.state import FlowRecord
    from sandgate.scrub import SecretSet

_logger = logging.getLogger("sandgate")

TIME = "time"
EVENT = "event"
INSTANCE = "instance"  # the replica that wrote the line (`sandgate run --instance`)
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
DECISION = "decision"  # "allow" / "deny" / "report" (refused by the rules, forwarded uninjected)
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
ERROR = "error"  # what went wrong upstream or in transport (not a refusal)
LISTENER = "listener"  # the way in: "http" (the proxy port) or "socks5" (--socks5)
GATEWAY = "gateway"  # the gateway prefix a request came in under; absent for proxied requests
INJECTED = "injected"  # how credentials went in beyond headers ("name@v: body json: ...")

# Free-text fields a sandbox can influence (path, Host, reasons quoting them): scrubbed of every
# cached secret value before an event is written.
SCRUBBED = (PATH, HOST, REASON, ERROR)

REDACTED = "REDACTED"
KEPT_VALUE_MAX = 200  # a longer value of a kept parameter is redacted (listed values are short)


def redact_path(path_with_query: str, keep: frozenset[str] = frozenset()) -> str:
    """Keep the path and the query parameter names; replace every query value by REDACTED,
    except the values of the parameters named in `keep` (those some rule's `query:` constrains,
    so that a review of recorded traffic sees them: sandgate.policy.query_audit).

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
            name, eq, value = part.partition("=")
            kept = eq and name in keep and len(value) <= KEPT_VALUE_MAX
            parts.append(part if kept else f"{name}={REDACTED}" if eq else REDACTED)
        out += "?" + "&".join(parts)
    if hash_:
        out += "#" + (REDACTED if fragment else "")
    return out


def flow_fields(flow: http.HTTPFlow, rec: FlowRecord) -> dict[str, Any]:
    """The audit fields of one flow, from what the hooks recorded on it."""
    info = rec.info
    req = flow.request
    refusal = rec.refusal
    decision = "allow" if refusal is None and rec.decision is not None and rec.decision.allowed \
        else "deny"
    if refusal is None and rec.reported:
        decision = "report"
    code = refusal.code if refusal else (rec.decision.code if rec.decision else None)
    if flow.error and not refusal and decision == "allow":
        code = None
    reason = refusal.reason if refusal else (rec.decision.reason if rec.decision else
                                             (flow.error.msg if flow.error else "not judged"))
    client = flow.client_conn.peername
    resp = flow.response
    return {
        IDENTITY: rec.caller.identity if rec.caller else None,
        SANDBOX: rec.caller.sandbox if rec.caller else None,
        IDENTITY_SOURCE: rec.caller.source if rec.caller else None,
        CLIENT: f"{client[0]}:{client[1]}" if client else None,
        METHOD: req.method,
        SCHEME: info.scheme if info else req.scheme,
        HOST: info.host if info else req.pretty_host,
        PORT: info.port if info else req.port,
        PATH: redact_path(req.path, kept_query_names(rec.policy))
        if req.method != "CONNECT" else None,
        RULE: rec.decision.rule_name if rec.decision else None,
        DECISION: decision,
        CODE: str(code) if code else None,
        REASON: reason,
        SECRETS: rec.secrets,
        UPSTREAM_STATUS: resp.status_code if resp is not None and not rec.refused else None,
        BYTES_IN: len(req.raw_content or b""),
        BYTES_OUT: rec.bytes_out if not rec.refused else (len(resp.raw_content or b"")
                                                          if resp is not None else 0),
        DURATION_MS: round((time.monotonic() - rec.started) * 1000, 2),
        DIALED: rec.dialed,
        EXFIL: rec.exfiltration,
        REDACTIONS: rec.redactions,
        ERROR: flow.error.msg if flow.error and not refusal else None,
        LISTENER: listener(flow),
        **({GATEWAY: rec.gateway} if rec.gateway is not None else {}),
        **({INJECTED: rec.injected} if rec.injected else {}),
        **(rec.call.fields() if rec.call is not None else {}),  # JSON-RPC calls
    }


def listener(flow: http.HTTPFlow) -> str:
    """Which listener the flow's client came in through ("http" for mitmproxy's regular mode)."""
    name = flow.client_conn.proxy_mode.type_name
    return "http" if name == "regular" else name


def scrub_fields(fields: dict[str, Any], secrets: SecretSet) -> dict[str, Any]:
    """A sandbox that somehow holds a real value may put it in a path or Host: the audit line
    must not carry it on."""
    if secrets.empty:
        return fields
    for key in SCRUBBED:
        value = fields.get(key)
        if isinstance(value, str):
            fields[key] = secrets.scrub_text(value)[0]
    for call in fields.get("rpc") or ():  # method, tool and id are the sandbox's strings
        for k, v in call.items():
            if isinstance(v, str):
                call[k] = secrets.scrub_text(v)[0]
    return fields


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

    def __init__(self, sink: TextIO | str | Path | None = None, *,
                 instance: str | None = None) -> None:
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
        # False once a write failed (disk full, closed pipe), True again after one succeeds: the
        # gate refuses requests meanwhile (fail closed) unless run with --audit-best-effort.
        self.healthy = True
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._log = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=[_canonical, structlog.processors.JSONRenderer(default=str)],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
            cache_logger_on_first_use=False,
        )
        if instance is not None:
            # every line names the replica that wrote it (--instance), right after the event
            self._log = self._log.bind(**{INSTANCE: instance})

    def emit(self, event: str, **fields: Any) -> None:
        """Write one JSON object on one line: time, event, then `fields` as given."""
        with self._lock:
            if self._closed:
                raise ValueError("audit log is closed")
            try:
                self._log.msg(event, **fields)
                if self._owned is None:
                    self._stream.flush()  # a pipe: surface a closed reader now, not later
            except (OSError, ValueError):
                self.healthy = False
                raise
            self.healthy = True
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:  # a metric must never cost a request or an audit line
                _logger.exception("sandgate: audit listener failed")

    def add_listener(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        """Call fn(event, fields) after each event is written: the one point that sees every
        decision (metrics count from here)."""
        self._listeners.append(fn)

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
