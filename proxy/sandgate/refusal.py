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
    # the LLM API the refused request called (sandgate.llm.llmcall.Api): the body then has that
    # provider's error shape, so its SDK raises its usual error with the reason
    dialect: str | None = None

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

    @property
    def challenge(self) -> bool:
        """A 407 to a request that carried no proxy credentials at all: the standard
        challenge (`Proxy-Authenticate: Basic realm="sandgate"`) that clients such as curl
        --proxy-anyauth, urllib's ProxyBasicAuthHandler, Java, .NET and Go answer by sending
        them. Credentials that were sent and are wrong are a refusal (auth_invalid)."""
        return self.code == Code.AUTH_REQUIRED and self.status == 407

    def body(self) -> bytes:
        doc = self.doc() if self.dialect is None else provider_doc(self.dialect, self)
        return (json.dumps(doc, indent=1) + "\n").encode()

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


# The error types each provider's API (and so its SDK) uses per status.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_denied", 404: "not_found", 413: "invalid_request_error",
                 429: "rate_limit_exceeded"}
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                  404: "NOT_FOUND", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
                  503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def provider_doc(dialect: str, r: Refusal) -> dict[str, object]:
    """The refusal in an LLM provider's own error shape (Anthropic, OpenAI, Gemini), with
    Sandgate's code in its message and its whole refusal under `sandgate`."""
    message = f"sandgate: {r.code}: {r.reason}" + (f" ({r.hint})" if r.hint else "")
    status = r.status
    if dialect == "anthropic":
        return {"type": "error", "error": {
            "type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
            "sandgate": r.doc()}
    if dialect == "gemini":
        return {"error": {"code": status, "message": message,
                          "status": _GOOGLE_STATUS.get(status, "INTERNAL")},
                "sandgate": r.doc()}
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                      "param": None, "code": str(r.code)}, "sandgate": r.doc()}
