"""The closed set of reasons Sandgate refuses a request, each mapped to one status, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

# Response header naming the reason code. Sandgate strips it from upstream responses, so a
# sandbox can trust that only Sandgate set it.
REASON_HEADER = "X-Sandgate-Reason"


class Code(StrEnum):
    AUTH_REQUIRED = "auth_required"  # no credentials at all
    AUTH_INVALID = "auth_invalid"  # bad, expired or mismatched token; unknown source address
    UNKNOWN_IDENTITY = "unknown_identity"  # authenticated, but the policy has no such identity
    NO_RULE = "no_rule"  # deny by default: nothing allows this
    DENIED_BY_RULE = "denied_by_rule"  # an explicit deny rule matched
    BAD_REQUEST = "bad_request"  # malformed, or CONNECT / SNI / Host disagree
    NOT_TLS = "not_tls"  # a CONNECT tunnel that does not carry TLS
    INTERNAL_ADDRESS = "internal_address"  # resolves to a non-public address the rule does not name
    SELF_ADDRESS = "self_address"  # would dial the proxy itself
    UNRESOLVABLE = "unresolvable"  # DNS gave no usable answer
    EXFILTRATION = "exfiltration"  # a placeholder or secret value sent where it is not bound
    UNSAFE_INJECTION = "unsafe_injection"  # injection asked for over unverified TLS / bad value
    SECRET_UNAVAILABLE = "secret_unavailable"  # Vault down, secret missing, auth to Vault failed
    POLICY_UNAVAILABLE = "policy_unavailable"  # no valid policy loaded
    INTERNAL_ERROR = "internal_error"  # an exception inside Sandgate: fail closed


STATUS: dict[Code, int] = {
    Code.AUTH_REQUIRED: 407,
    Code.AUTH_INVALID: 407,
    Code.UNKNOWN_IDENTITY: 403,
    Code.NO_RULE: 403,
    Code.DENIED_BY_RULE: 403,
    Code.BAD_REQUEST: 400,
    Code.NOT_TLS: 403,
    Code.INTERNAL_ADDRESS: 403,
    Code.SELF_ADDRESS: 403,
    Code.UNRESOLVABLE: 502,
    Code.EXFILTRATION: 403,
    Code.UNSAFE_INJECTION: 502,
    Code.SECRET_UNAVAILABLE: 503,
    Code.POLICY_UNAVAILABLE: 503,
    Code.INTERNAL_ERROR: 503,
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal as the sandbox sees it. Every text here must be free of secret values."""

    code: Code
    reason: str
    identity: str | None = None
    target: str | None = None
    hint: str | None = None

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def body(self) -> bytes:
        doc = {
            "error": "sandgate_refused",
            "code": str(self.code),
            "status": self.status,
            "identity": self.identity,
            "target": self.target,
            "reason": self.reason,
            "hint": self.hint,
        }
        return (json.dumps(doc, indent=1) + "\n").encode()

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", REASON_HEADER: str(self.code)}
        if self.status == 407:
            h["Proxy-Authenticate"] = 'Basic realm="sandgate"'
        return h
