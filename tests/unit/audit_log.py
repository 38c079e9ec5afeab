"""Recorded audit logs for the traffic tools' tests, written exactly as the proxy writes them:
through sandgate.audit.events.AuditLog, with every field of `flow_fields` (the path through
`redact_path`)."""

from __future__ import annotations

import io
from typing import Any
from urllib.parse import urlsplit

from sandgate.audit import events as A


def fields(identity: str | None, method: str, url: str, *, decision: str = "allow",
           rule: str | None = None, code: str | None = None,
           secrets: list[str] | None = None, dialed: str | None = None,
           websocket: bool = False) -> dict[str, Any]:
    """The fields flow_fields gives one request (or, with method CONNECT and url host:port,
    one CONNECT)."""
    if method == "CONNECT":
        host, _, port = url.rpartition(":")
        scheme, path = "https", None
    else:
        parts = urlsplit(url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = str(parts.port or (443 if scheme == "https" else 80))
        path = A.redact_path(parts.path + (f"?{parts.query}" if parts.query else ""))
    return {
        A.IDENTITY: identity,
        A.SANDBOX: None,
        A.IDENTITY_SOURCE: "token" if identity else None,
        A.CLIENT: "127.0.0.1:50000",
        A.METHOD: method,
        A.SCHEME: scheme,
        A.HOST: host.strip("[]"),
        A.PORT: int(port),
        A.PATH: path,
        A.RULE: rule,
        A.DECISION: decision,
        A.CODE: code,
        A.REASON: "recorded for a test",
        A.SECRETS: secrets or [],
        A.UPSTREAM_STATUS: 200 if decision != "deny" else None,
        A.BYTES_IN: 0,
        A.BYTES_OUT: 0,
        A.DURATION_MS: 1.0,
        A.DIALED: dialed,
        A.EXFIL: None,
        A.REDACTIONS: 0,
        A.ERROR: None,
        **({A.WEBSOCKET: True} if websocket else {}),
    }


class Recorder:
    """Collects audit lines as sandgate.audit.events.AuditLog writes them."""

    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.log = A.AuditLog(self.buf)

    def request(self, identity: str | None, method: str, url: str, n: int = 1,
                **kw: Any) -> None:
        for _ in range(n):
            self.log.emit("request", **fields(identity, method, url, **kw))

    def connect(self, identity: str | None, authority: str, **kw: Any) -> None:
        self.log.emit("connect", **fields(identity, "CONNECT", authority, **kw))

    def event(self, name: str, **kw: Any) -> None:
        self.log.emit(name, **kw)

    def raw(self, line: str) -> None:
        self.buf.write(line + "\n")

    def text(self) -> str:
        return self.buf.getvalue()
