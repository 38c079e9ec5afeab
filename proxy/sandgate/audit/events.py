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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from sandgate.audit.chain import CHECKPOINT, Chain, last_line_hash, render
from sandgate.audit.file import AuditFile, Rotation
from sandgate.policy.query_audit import kept_query_names

if TYPE_CHECKING:
    from mitmproxy import http

    from sandgate.audit.anchor import Anchor
    from sandgate.scrub.scrubber import SecretSet
    from sandgate.stages.flow import FlowRecord

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
# "allow" / "deny" / "report" (refused by the rules, forwarded uninjected) / "challenge" (a 407
# asking a client that sent no proxy credentials for them)
DECISION = "decision"
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
# an LLM call (sandgate.llm.spend): api, model, max_tokens, stream, usage, cost_usd, budget, notes
LLM = "llm"
# true on a request that asks to open a WebSocket (its upgrade): the messages that follow on it
# are `websocket` events
WEBSOCKET = "websocket"

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
    elif refusal is not None and refusal.challenge and listener(flow) != "socks5":
        # asked for its credentials, which such a client then sends: not a refusal (no
        # `deny` line per client start in a SIEM); the SOCKS5 listener has no challenge
        decision = "challenge"
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
        **({WEBSOCKET: True} if info is not None and info.upgrade == "websocket" else {}),
        **({INJECTED: rec.injected} if rec.injected else {}),
        **(rec.call.fields() if rec.call is not None else {}),  # JSON-RPC calls
        **({LLM: rec.llm.doc(rec.policy.prices if rec.policy is not None else ())}
           if rec.llm is not None else {}),
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
    texts = [v for key in SCRUBBED if isinstance(v := fields.get(key), str)]
    texts += [v for call in fields.get("rpc") or () for v in call.values() if isinstance(v, str)]
    llm = fields.get(LLM)
    if isinstance(llm, dict) and isinstance(llm.get("model"), str):  # the sandbox's string
        texts.append(llm["model"])
    if not secrets.scrub_text("\n".join(texts))[1]:
        return fields  # no value in their concatenation, so none in any of them: one scan
    for key in SCRUBBED:
        value = fields.get(key)
        if isinstance(value, str):
            fields[key] = secrets.scrub_text(value)[0]
    if isinstance(llm, dict) and isinstance(llm.get("model"), str):
        llm["model"] = secrets.scrub_text(llm["model"])[0]
    for call in fields.get("rpc") or ():  # method, tool and id are the sandbox's strings
        for k, v in call.items():
            if isinstance(v, str):
                call[k] = secrets.scrub_text(v)[0]
    return fields


_second: list[Any] = [None, ""]  # the last whole second formatted, and its text up to ':SS'


def _timestamp() -> str:
    """Now, as ISO 8601 UTC with milliseconds ("2026-01-02T03:04:05.678Z"); the text up to the
    seconds is formatted once per second (one call per audit event)."""
    now = time.time()
    sec = int(now)
    if _second[0] != sec:
        _second[0], _second[1] = sec, datetime.fromtimestamp(sec, UTC).strftime(
            "%Y-%m-%dT%H:%M:%S")
    return f"{_second[1]}.{int((now - sec) * 1000):03d}Z"


FORMATS = ("json", "ocsf")


class AuditLog:
    """Writes audit events as JSON lines to stdout, an open text stream, or a file (appended).

    `format` "ocsf" writes each event as an OCSF event (sandgate.audit.ocsf); `chain` adds the
    hash chain and signed checkpoints (sandgate.audit.chain); `rotation` rotates a file sink
    (sandgate.audit.file); `anchor` records each checkpoint's head in the confdir
    (sandgate.audit.anchor).
    """

    def __init__(self, sink: TextIO | str | Path | None = None, *,
                 instance: str | None = None, format: str = "json",
                 chain: Chain | None = None, rotation: Rotation | None = None,
                 anchor: Anchor | None = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"audit format {format!r}: expected one of {', '.join(FORMATS)}")
        self._owned: IO[str] | AuditFile | None = None
        self._file: AuditFile | None = None
        stream: TextIO
        if sink is None:
            stream = sys.stdout
        elif isinstance(sink, AuditFile):
            self._file = self._owned = sink
            stream = sink  # type: ignore[assignment]
        elif isinstance(sink, str | Path):
            path = Path(sink)
            if (rotation is not None and rotation.on) or chain is not None:
                self._file = self._owned = AuditFile(path, rotation)
                stream = self._file  # type: ignore[assignment]
            else:
                self._owned = open(  # closed by close()
                    path, "a", buffering=1, encoding="utf-8",
                    opener=lambda p, flags: os.open(p, flags, 0o600),
                )
                stream = self._owned
        else:
            stream = sink
        self._stream = stream
        self._format = format
        self._chain = chain
        self._anchor = anchor if chain is not None and chain.key is not None else None
        # the checkpoints' private key: a credential Sandgate holds, scrubbed like the others
        self.signing_key = chain.key if chain is not None else None
        if chain is not None and self._file is not None and chain.seq == 0:
            chain.prev = last_line_hash(self._file.path)  # runs of one file link up
        self._lock = threading.Lock()
        self._closed = False
        # False once a write failed (disk full, closed pipe), True again after one succeeds: the
        # gate refuses requests meanwhile (fail closed) unless run with --audit-best-effort.
        self.healthy = True
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        # fields of every event, right after `event`: the replica (--instance), the worker
        self._context: dict[str, Any] = {INSTANCE: instance} if instance is not None else {}
        self._stop = threading.Event()
        if chain is not None and chain.key is not None and chain.checkpoint_seconds > 0:
            threading.Thread(target=self._checkpoints, name="sandgate-audit-checkpoints",
                             daemon=True).start()

    @property
    def format(self) -> str:
        """"json" or "ocsf" (--audit-format): exporters send what the file holds."""
        return self._format

    def record(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The event as the JSON format writes it: time, event, instance (worker), fields."""
        rest = {k: v for k, v in fields.items() if k not in (TIME, EVENT)}
        return {TIME: _timestamp(), EVENT: event, **self._context, **rest}

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event on one line: time, event, then `fields` as given.

        The one point every audit event passes: `record` is the event as the JSON format
        writes it (without the chain fields); `_write` renders it (JSON or OCSF), chains,
        rotates and writes it; then the listeners (metrics, exporters) see it."""
        record = self.record(event, fields)
        with self._lock:
            if self._closed:
                raise ValueError("audit log is closed")
            try:
                self._write(record)
            except (OSError, ValueError):
                self.healthy = False
                raise
            self.healthy = True
        for listener in self._listeners:
            try:
                listener(event, fields)
            except Exception:  # a metric must never cost a request or an audit line
                _logger.exception("sandgate: audit listener failed")

    # ------------------------------------------------------------------ writing (under _lock)

    def _render(self, record: dict[str, Any]) -> dict[str, Any]:
        if self._format == "ocsf":
            from sandgate.audit.ocsf import to_ocsf

            return to_ocsf(record)
        return dict(record)  # the chain's fields go on the line, `record` stays the event

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._put(record)
            return
        with self._file.locked():
            self._put(record)

    def _rotate(self) -> None:
        """Rotate the file (under its lock): the new file's first lines say what happened."""
        assert self._file is not None
        rotated = self._file.rotate()
        self._put(self.record("rotate", {"file": self._file.path.name,
                                         "previous_file": rotated.previous,
                                         "previous_last": rotated.previous_last}), rotating=True)
        for name, last in rotated.dropped:
            self._put(self.record("retention", {"dropped_file": name, "dropped_last": last}),
                      rotating=True)

    def _put(self, record: dict[str, Any], checkpoint: bool = False,
             final: bool = False, rotating: bool = False) -> None:
        """One line: rendered, sealed into the chain, written in one write() with its newline
        (after a rotation when it would take the file past --audit-max-bytes or the file is
        older than --audit-max-age). The chain advances only once the line is written."""
        obj = self._render(record)
        line = self._seal(obj, checkpoint, final)
        if not rotating and self._file is not None and self._file.rotation.on and \
                self._file.due(len(line) + 1):
            self._rotate()
            line = self._seal(obj, checkpoint, final)  # it now follows the rotation's lines
        self._stream.write(line + "\n")
        if self._owned is None:
            self._stream.flush()  # a pipe: surface a closed reader now, not later
        chain = self._chain
        if chain is not None:
            chain.commit(line, checkpoint)
            if checkpoint and self._anchor is not None:  # the head, outside the file
                self._anchor.update(chain, self._context.get("worker"), final)
            if not checkpoint and chain.checkpoint_due():
                self._put(self.record(CHECKPOINT, {}), checkpoint=True)

    def _seal(self, obj: dict[str, Any], checkpoint: bool, final: bool) -> str:
        if self._chain is None:
            return render(obj)
        if checkpoint:
            return self._chain.sign(obj, final=final)
        return self._chain.seal(obj)

    def _checkpoints(self) -> None:
        """Sign a quiet tail within checkpoint_seconds (a busy chain is signed every N lines)."""
        assert self._chain is not None
        while not self._stop.wait(min(self._chain.checkpoint_seconds, 5.0)):
            with self._lock:
                if self._closed or not self._chain.checkpoint_due():
                    continue
                try:
                    self._checkpoint_locked()
                except (OSError, ValueError):
                    self.healthy = False
                    _logger.exception("sandgate: audit checkpoint failed")

    def _checkpoint_locked(self, final: bool = False) -> None:
        if self._file is None:
            self._put(self.record(CHECKPOINT, {}), checkpoint=True, final=final)
            return
        with self._file.locked():
            self._put(self.record(CHECKPOINT, {}), checkpoint=True, final=final)

    def add_listener(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        """Call fn(event, fields) after each event is written: the one point that sees every
        decision (metrics count from here)."""
        self._listeners.append(fn)

    def close(self) -> None:
        """Close the file this log opened (a stream passed in, or stdout, is only flushed)."""
        with self._lock:
            if self._closed:
                return
            self._stop.set()
            if self._chain is not None and self._chain.key is not None:
                with contextlib.suppress(OSError, ValueError):  # the chain ends signed
                    self._checkpoint_locked(final=True)
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
