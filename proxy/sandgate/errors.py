"""Why Sandgate refuses: the closed set of codes, the status of each, and one exception tree.

Every error Sandgate raises on purpose derives from `SandgateError`. Those that stop a request
derive from `Refused`, which carries a `Code` (never a free string: the type checker sees a typo)
and a reason and hint that are safe to show the sandbox::

    SandgateError
    ├── Refused(code, reason, hint)      a request must not go on; STATUS[code] is its status
    │   ├── IdentityError                auth_required, auth_invalid     (identity/, tokens.py)
    │   ├── BadRequest                   bad_request, not_tls, too_large  (request.py),
    │   │                                no_gateway                       (gateway.py)
    │   ├── AddressRefused               internal_address, self_address, unresolvable
    │   │                                                                 (netguard.py)
    │   ├── SecretError                  secret_unavailable               (secrets/vault.py)
    │   ├── SandboxRequired              sandbox_required                 (secrets/scope.py)
    │   ├── UnsafeValue                  unsafe_injection                 (inject.py)
    │   ├── ApprovalRefused              approval_pending, approval_denied, approval_timeout,
    │   │                                too_many_pending, approvals_full (approvals/)
    │   ├── LimitExceeded                headers_too_large, rate_limited, budget_exhausted,
    │   │                                too_many_connections (+ retry_after) (limits.py)
    │   ├── StateUnavailable             state_unavailable                (state/)
    │   └── Unresolved                   exfiltration, too_large: a secret placeholder left in
    │                                    a body                           (secrets/body.py)
    ├── PolicyError                      policy files are broken          (policy/loader.py)
    ├── InvalidInput (ValueError)        what was read from outside is not what it must be
    │   ├── CallError                    not a JSON-RPC 2.0 message        (rpc/jsonrpc.py)
    │   ├── HeaderMismatch               MCP headers disagree with the body (rpc/mcpheaders.py)
    │   ├── CallUnreadable               an LLM call's body unreadable     (llm/llmcall.py)
    │   ├── TooLarge                     a body decodes past the limit     (scrub/decoding.py)
    │   ├── VoteError (status)           an approval vote refused          (approvals/votes.py)
    │   └── TooManyModels                `llm:` globs too many to compare  (policy/llmproofs.py)
    ├── NotVerified                      a presented token or record does not verify
    │   ├── TokenError                   a proxy token                     (tokens.py)
    │   ├── SessionIdError               an MCP session id                 (rpc/mcpsession.py)
    │   └── Broken                       an audit file's hash chain        (audit/verify.py)
    │       └── Incomplete               the lines verify, the set is not whole
    ├── Unavailable                      something Sandgate asks did not answer usably
    │   ├── _VaultFailure                one Vault call, classified        (secrets/vault.py)
    │   ├── TokenFailure                 a token endpoint (OAuth2, GitHub) (secrets/tokenhttp.py)
    │   ├── StateDown                    the fleet's Redis                 (state/redis_counts.py)
    │   ├── UpstreamError                the policy DNS's resolver         (dns/resolver.py)
    │   ├── Unreadable                   another process's sockets        (identity/sockowner.py)
    │   ├── SourceError                  the workers, for the console      (console/source.py)
    │   └── ApiError                     the admin API, for the CLI        (cli/approvals.py)
    ├── SetupFailed (RuntimeError)       the host cannot be set up as asked; the message says how
    │   ├── DockerUnavailable            no Docker engine                  (sandbox/engine.py)
    │   ├── SandboxError                 a sandbox not created or usable   (sandbox/engine.py)
    │   └── CaptureError                 the capture table not installed   (capture/nftables.py)
    └── InternalError (RuntimeError)     a bug: two parts of Sandgate disagree, never a verdict
        ├── ProofError                   the prover and decide() disagree  (review/proofs.py)
        └── DemoFailed                   the demo stack misbehaved         (demo/tour.py)

Outside it, on purpose: pattern1's SplitConfigError (a ValueError) and RunnerError (a
RuntimeError), which run in the sandbox image where sandgate/pattern1 is installed alone.

A module that owns its exception subclasses one of these bases (tests/unit/test_errors.py
checks every exception class under sandgate/); the bases that were a builtin's (ValueError,
RuntimeError) still are, so every `except` that caught them still does. Where each boundary
exception is caught and what it becomes (status, exit code, log line): docs/building.md.

Policy refusals (`unknown_identity`, `no_rule`, `denied_by_rule`, `upgrade_refused`) are not
exceptions: `decide()` returns them as a Decision. The addon turns a `Refused` or a refusing
Decision into the answer a sandbox sees in one place (`sandgate.refusal.Refusal`); any other
exception inside a hook is `internal_error` (fail closed).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Code(StrEnum):
    AUTH_REQUIRED = "auth_required"  # no credentials at all
    AUTH_INVALID = "auth_invalid"  # bad, expired or mismatched token; unknown source address
    UNKNOWN_IDENTITY = "unknown_identity"  # authenticated, but the policy has no such identity
    NO_RULE = "no_rule"  # deny by default: nothing allows this
    DENIED_BY_RULE = "denied_by_rule"  # an explicit deny rule matched
    BAD_REQUEST = "bad_request"  # malformed, or CONNECT / SNI / Host disagree
    TOO_LARGE = "too_large"  # a request body over the limit
    NOT_TLS = "not_tls"  # a CONNECT tunnel (or a TLS-only gateway request) without TLS
    NO_GATEWAY = "no_gateway"  # a gateway-listener path under no `gateways:` prefix
    INTERNAL_ADDRESS = "internal_address"  # resolves to a non-public address the rule does not name
    SELF_ADDRESS = "self_address"  # would dial the proxy itself
    UNRESOLVABLE = "unresolvable"  # DNS gave no usable answer
    EXFILTRATION = "exfiltration"  # a placeholder or secret value sent where it is not bound
    UNSAFE_INJECTION = "unsafe_injection"  # injection asked for over unverified TLS / bad value
    UPSTREAM_ERROR = "upstream_error"  # the upstream failed or answered something unforwardable
    UPSTREAM_TIMEOUT = "upstream_timeout"  # the upstream did not answer in time
    SECRET_UNAVAILABLE = "secret_unavailable"  # Vault down, secret missing, auth to Vault failed
    SANDBOX_REQUIRED = "sandbox_required"  # a per-sandbox secret, and the caller has no sandbox id
    AUDIT_UNAVAILABLE = "audit_unavailable"  # the audit log cannot be written: fail closed
    INTERNAL_ERROR = "internal_error"  # an exception inside Sandgate: fail closed
    # limits (sandgate/limits.py, sandgate/mitm/guards/wirelimits.py)
    HEADERS_TOO_LARGE = "headers_too_large"  # request head over --max-header-bytes/--max-headers
    RATE_LIMITED = "rate_limited"  # the identity's requests per second (token bucket)
    BUDGET_EXHAUSTED = "budget_exhausted"  # a secret's call budget for its window is spent
    TOO_MANY_CONNECTIONS = "too_many_connections"  # per identity, or in total
    HEADER_TIMEOUT = "header_timeout"  # the request head did not arrive within --header-timeout
    IDLE_TIMEOUT = "idle_timeout"  # nothing moved on the connection for --idle-timeout
    # an unidentified connection past --first-byte-timeout, --handshake-timeout or
    # --identify-timeout (sandgate/mitm/guards/admission.py)
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    SESSION_MISMATCH = "session_mismatch"  # an MCP session id not issued to this identity
    # MCP's Mcp-Method / Mcp-Name / MCP-Protocol-Version disagree with the body (rpc/mcpheaders.py)
    HEADER_MISMATCH = "header_mismatch"
    # a protocol upgrade (WebSocket...) on a rule with mcp:/jsonrpc: and no `websocket: true`
    UPGRADE_REFUSED = "upgrade_refused"
    # `action: ask` rules (sandgate/approvals/)
    APPROVAL_PENDING = "approval_pending"  # mode async: asked; retry the identical request
    APPROVAL_DENIED = "approval_denied"  # an approver denied it
    APPROVAL_TIMEOUT = "approval_timeout"  # nobody decided within the rule's timeout
    TOO_MANY_PENDING = "too_many_pending"  # the identity has too many requests awaiting approval
    APPROVALS_FULL = "approvals_full"  # the proxy holds as many approvals as it may
    # the fleet's shared state (--state redis://) cannot be reached in time (sandgate/state/)
    STATE_UNAVAILABLE = "state_unavailable"
    # LLM calls on a rule with `llm:` (sandgate/llm/llmcall.py, sandgate/llm/spend.py)
    MODEL_NOT_ALLOWED = "model_not_allowed"  # the call's model is not in the rule's `models`
    MAX_TOKENS_OVER_CAP = "max_tokens_over_cap"  # asks for more output than `max_tokens`
    SPEND_EXHAUSTED = "spend_exhausted"  # a `budgets:` entry's tokens or cost are spent
    OWN_CREDENTIAL = "own_credential"  # a key of the sandbox's own to an API Sandgate keys


STATUS: dict[Code, int] = {
    Code.AUTH_REQUIRED: 407,
    Code.AUTH_INVALID: 407,
    Code.UNKNOWN_IDENTITY: 403,
    Code.NO_RULE: 403,
    Code.DENIED_BY_RULE: 403,
    Code.BAD_REQUEST: 400,
    Code.TOO_LARGE: 413,
    Code.NOT_TLS: 403,
    Code.NO_GATEWAY: 404,
    Code.INTERNAL_ADDRESS: 403,
    Code.SELF_ADDRESS: 403,
    Code.UNRESOLVABLE: 502,
    Code.EXFILTRATION: 403,
    Code.UNSAFE_INJECTION: 502,
    Code.UPSTREAM_ERROR: 502,
    Code.UPSTREAM_TIMEOUT: 504,
    Code.SECRET_UNAVAILABLE: 503,
    Code.SANDBOX_REQUIRED: 403,
    Code.AUDIT_UNAVAILABLE: 503,
    Code.INTERNAL_ERROR: 503,
    Code.HEADERS_TOO_LARGE: 431,
    Code.RATE_LIMITED: 429,
    Code.BUDGET_EXHAUSTED: 429,
    Code.TOO_MANY_CONNECTIONS: 429,
    Code.HEADER_TIMEOUT: 408,
    Code.IDLE_TIMEOUT: 408,  # audited only: an idle connection is closed without an answer
    Code.HANDSHAKE_TIMEOUT: 408,  # audited only: closed without an answer
    Code.SESSION_MISMATCH: 403,
    Code.HEADER_MISMATCH: 400,
    Code.UPGRADE_REFUSED: 403,
    Code.APPROVAL_PENDING: 202,
    Code.APPROVAL_DENIED: 403,
    Code.APPROVAL_TIMEOUT: 403,
    Code.TOO_MANY_PENDING: 429,
    Code.APPROVALS_FULL: 503,
    Code.STATE_UNAVAILABLE: 503,
    Code.MODEL_NOT_ALLOWED: 403,
    Code.MAX_TOKENS_OVER_CAP: 400,
    Code.SPEND_EXHAUSTED: 429,
    Code.OWN_CREDENTIAL: 403,
}


class SandgateError(Exception):
    """Base of every error Sandgate raises on purpose. Messages never contain a secret value."""


class InvalidInput(SandgateError, ValueError):
    """What was read from outside (a body, a header, a vote, a sandbox's settings) is not what it
    must be. The message is short and safe to show; it never echoes a secret."""


class NotVerified(SandgateError):
    """A presented token, session id or audit chain does not verify. The message never echoes
    the secret part."""


class Unavailable(SandgateError):
    """Something Sandgate asks (Vault, a token endpoint, the fleet's Redis, the upstream resolver,
    a worker, the admin API, /proc) did not answer usably: the caller decides, failing closed."""


class SetupFailed(SandgateError, RuntimeError):
    """The host cannot be set up as asked (Docker, nftables, a split sandbox's tool runner). The
    message says what to do about it."""


class InternalError(SandgateError, RuntimeError):
    """A bug: two parts of Sandgate disagree. Never a verdict, never shown as one."""


class Refused(SandgateError):
    """A request must not go on. `reason` and `hint` are safe to show the sandbox."""

    # The codes a subclass may carry; empty means any.
    codes: ClassVar[frozenset[Code]] = frozenset()

    # Seconds after which a retry may succeed (the Retry-After header of a 429); None: not said.
    retry_after: int | None = None

    def __init__(self, code: Code, reason: str, hint: str | None = None) -> None:
        if self.codes and code not in self.codes:
            raise TypeError(f"{type(self).__name__} cannot carry code {code!s}")
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.hint = hint

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!s}, {self.reason!r})"


class IdentityError(Refused):
    """The caller could not be identified."""

    codes = frozenset({Code.AUTH_REQUIRED, Code.AUTH_INVALID})


class BadRequest(Refused, ValueError):
    """The request is malformed, disagrees with its tunnel, or cannot be judged as sent.

    Also a ValueError: the request parser is used at load time and by the CLI too.
    """

    codes = frozenset({Code.BAD_REQUEST, Code.NOT_TLS, Code.TOO_LARGE, Code.NO_GATEWAY})


class AddressRefused(Refused):
    """The destination resolves to an address the rule may not dial, or to nothing."""

    codes = frozenset({Code.INTERNAL_ADDRESS, Code.SELF_ADDRESS, Code.UNRESOLVABLE})


class SecretError(Refused):
    """A secret could not be provided (Vault down, denied, missing, unusable value)."""

    codes = frozenset({Code.SECRET_UNAVAILABLE})

    def __init__(self, secret: str, message: str) -> None:
        super().__init__(Code.SECRET_UNAVAILABLE, message,
                         hint="nothing was sent upstream; retry later")
        self.secret = secret

    def __repr__(self) -> str:
        return f"SecretError(secret={self.secret!r}, message={str(self)!r})"


class SandboxRequired(Refused):
    """A rule needs a per-sandbox secret (a `{{ sandbox }}` path, a dynamic secret) and the
    caller has no usable sandbox id: refused before anything is read from Vault."""

    codes = frozenset({Code.SANDBOX_REQUIRED})

    def __init__(self, secret: str, message: str, hint: str | None = None) -> None:
        super().__init__(Code.SANDBOX_REQUIRED, message, hint=hint)
        self.secret = secret


class UnsafeValue(Refused):
    """A rendered credential would corrupt the request (CR, LF or NUL)."""

    codes = frozenset({Code.UNSAFE_INJECTION})

    def __init__(self, reason: str) -> None:
        super().__init__(Code.UNSAFE_INJECTION, reason)


class LimitExceeded(Refused):
    """A limit of Sandgate's own (sizes, rates, budgets, connections), not of the policy's rules.
    `retry_after` (whole seconds, rounded up) becomes the 429's Retry-After header."""

    codes = frozenset({Code.HEADERS_TOO_LARGE, Code.RATE_LIMITED, Code.BUDGET_EXHAUSTED,
                       Code.TOO_MANY_CONNECTIONS, Code.SPEND_EXHAUSTED})

    def __init__(self, code: Code, reason: str, hint: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(code, reason, hint)
        self.retry_after = retry_after


class ApprovalRefused(Refused):
    """An `action: ask` rule's request was not approved (yet): 202 pending (mode async), denied,
    timed out, or too many waiting. `approval` is the approval request's id (the body says it, so
    a client can show it to the people who decide); `retry_after` a 202's or 429's
    Retry-After."""

    codes = frozenset({Code.APPROVAL_PENDING, Code.APPROVAL_DENIED, Code.APPROVAL_TIMEOUT,
                       Code.TOO_MANY_PENDING, Code.APPROVALS_FULL})

    def __init__(self, code: Code, reason: str, hint: str | None = None,
                 approval: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(code, reason, hint)
        self.approval = approval
        self.retry_after = retry_after
class StateUnavailable(Refused):
    """The fleet's shared state (`--state redis://`) did not answer within `--state-timeout`:
    a request whose counting needs it (a secret budget; rates and connections with
    `--state-fail closed`) is not forwarded."""

    codes = frozenset({Code.STATE_UNAVAILABLE})

    def __init__(self, reason: str) -> None:
        super().__init__(Code.STATE_UNAVAILABLE, reason,
                         hint="nothing was sent upstream; retry later")
