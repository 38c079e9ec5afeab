"""The answer a sandbox gets when Sandgate refuses: built here, from a Code, and nowhere else."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sandgate.errors import STATUS, Code, Refused

# Response header naming the reason code. Sandgate strips it from upstream responses, so a
# sandbox can trust that only Sandgate set it.
REASON_HEADER = "X-Sandgate-Reason"
# The approval request a held or pending request belongs to (`action: ask`, approvals/).
APPROVAL_HEADER = "X-Sandgate-Approval"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal as the sandbox sees it. Every text here must be free of secret values."""

    code: Code
    reason: str
    identity: str | None = None
    target: str | None = None
    hint: str | None = None
    retry_after: int | None = None  # seconds: the Retry-After header (429)
    # Answered on the gateway listener: the caller is no proxy client, so an authentication
    # failure is a 401 with WWW-Authenticate rather than a 407.
    gateway: bool = False
    approval: str | None = None  # the approval request's id (approval_* codes)

    @classmethod
    def from_error(cls, error: Refused, identity: str | None = None,
                   target: str | None = None, gateway: bool = False) -> Refusal:
        """The one mapping from a raised refusal to the answer the sandbox sees."""
        return cls(error.code, error.reason, identity=identity, target=target, hint=error.hint,
                   retry_after=error.retry_after, gateway=gateway,
                   approval=getattr(error, "approval", None))

    @property
    def status(self) -> int:
        if self.gateway and self.code in _AUTH:
            return 401
        return STATUS[self.code]

    def body(self) -> bytes:
        return (json.dumps(self.doc(), indent=1) + "\n").encode()

    def doc(self) -> dict[str, object]:
        """The refusal as JSON (the HTTP body; `error.data.sandgate` of a JSON-RPC error)."""
        doc: dict[str, object] = {
            "error": "sandgate_refused",
            "code": str(self.code),
            "status": self.status,
            "identity": self.identity,
            "target": self.target,
            "reason": self.reason,
            "hint": self.hint,
        }
        if self.approval is not None:
            doc["approval"] = self.approval
        return doc

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", REASON_HEADER: str(self.code)}
        if self.status == 407:
            h["Proxy-Authenticate"] = 'Basic realm="sandgate"'
        elif self.status == 401:
            h["WWW-Authenticate"] = 'Bearer realm="sandgate"'
        if self.retry_after is not None:
            h["Retry-After"] = str(self.retry_after)
        if self.approval is not None:
            h[APPROVAL_HEADER] = self.approval
        return h


_AUTH = frozenset({Code.AUTH_REQUIRED, Code.AUTH_INVALID})
