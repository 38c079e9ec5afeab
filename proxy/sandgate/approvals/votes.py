"""Approval requests, votes and remembered grants: plain data, and the pure rules for a vote.

An `Approval` says who asks for what and why (identity, sandbox, method, redacted URL, tool,
rule, the body's sha256 and size, the forwarded headers scrubbed and their sha256: see
approvals/bound_headers.py), never a secret or the body itself. Votes come from
authenticated admin users (sandgate.admin.access): a user's name counts once, one deny refuses, and
`require_approvers` distinct approvals approve. What an approval is remembered for is its
`Scope`; a remembered approval is a `Grant`, matched by rule, identity, (scope sandbox) the
sandbox and the forwarded headers' digest. Everything here is JSON-serialisable
(`as_dict`/`from_dict`) so a store can keep it in Redis and the admin API can show it as it is.
"""

from __future__ import annotations

import hashlib
import secrets as _secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from sandgate.errors import InvalidInput
from sandgate.policy.model import ApprovalScope

State = Literal["pending", "approved", "denied", "timeout", "used", "withdrawn"]
Verdict = Literal["approve", "deny"]
SCOPE_ORDER: dict[str, int] = {"request": 0, "sandbox": 1, "identity": 2}


class VoteError(InvalidInput):
    """A vote that cannot be taken; `status` is the admin API's answer (400, 403, 404, 409)."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Scope:
    """What an approval is remembered for: this request only, or every request the rule matches
    from the caller's sandbox / identity with the same forwarded headers for `ttl` seconds."""

    kind: ApprovalScope = "request"
    ttl: int | None = None  # seconds; None for kind request

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ttl": self.ttl}


def parse_scope(raw: object, ask: AskPolicyView, has_sandbox: bool) -> Scope:
    """A vote's `scope` ({"kind": ..., "ttl": SECONDS}, or absent: request) checked against
    the rule: only the kinds it lists in `remember`, a ttl within its max_remember_ttl."""
    if raw is None:
        raw = {"kind": "request"}
    if isinstance(raw, str):
        raw = {"kind": raw}
    if not isinstance(raw, dict):
        raise VoteError(400, "bad_request", "`scope` must be an object {kind, ttl}")
    unknown = set(raw) - {"kind", "ttl"}
    if unknown:
        raise VoteError(400, "bad_request", f"`scope` has unknown key(s) {sorted(unknown)}: "
                        "it takes kind and ttl")
    kind = raw.get("kind", "request")
    if kind not in SCOPE_ORDER:
        raise VoteError(400, "bad_request", f"scope kind {kind!r} is not one of request, "
                        "sandbox, identity")
    if kind not in ask.remember:
        raise VoteError(400, "scope_not_allowed", f"rule '{ask.rule}' lets a decision be "
                        f"remembered for {', '.join(ask.remember)} only, not {kind}")
    if kind == "sandbox" and not has_sandbox:
        raise VoteError(400, "scope_not_allowed", "the caller has no sandbox id: remember the "
                        "decision for the request or the identity")
    ttl = raw.get("ttl")
    if kind == "request":
        if ttl is not None:
            raise VoteError(400, "bad_request", "a `request` scope takes no ttl")
        return Scope("request")
    if ttl is None:
        ttl = min(3600, ask.max_remember_ttl)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1:
        raise VoteError(400, "bad_request", "`ttl` must be a whole number of seconds, at least 1")
    if ttl > ask.max_remember_ttl:
        raise VoteError(400, "ttl_too_long", f"ttl {ttl}s is over rule '{ask.rule}''s "
                        f"max_remember_ttl of {ask.max_remember_ttl}s")
    return Scope(kind, ttl)


@dataclass(frozen=True, slots=True)
class Vote:
    approver: str  # the authenticated admin user, never a name from a request body
    verdict: Verdict
    at: float
    scope: Scope
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"approver": self.approver, "decision": self.verdict, "at": self.at,
                "scope": self.scope.as_dict(), "note": self.note}


@dataclass(frozen=True, slots=True)
class AskPolicyView:
    """What a vote is checked against: the rule's approval settings, copied into the approval
    (a policy reload while it waits does not change what was asked)."""

    rule: str
    require_approvers: int
    approvers: tuple[str, ...] | None
    remember: tuple[ApprovalScope, ...]
    max_remember_ttl: int


@dataclass(frozen=True, slots=True)
class Approval:
    """One approval request. Fields are what approvers see (GET /v1/approvals) and what the
    webhook posts; nothing here is secret."""

    id: str
    identity: str
    sandbox: str | None
    method: str
    url: str  # the request's URL with secret-bearing query values redacted (as the audit does)
    host: str
    tool: str | None  # the MCP tool (or JSON-RPC method) its body calls, if any
    rule: str
    rule_source: str
    body_sha256: str
    body_size: int
    # the forwarded headers the sandbox sent (approvals/bound_headers.py): their digest, what
    # approvers see of them (scrubbed), and the names Sandgate injects credentials into
    headers_sha256: str
    headers: tuple[tuple[str, str], ...]
    headers_injected: tuple[str, ...]
    created: float
    expires: float  # past it: timeout
    mode: Literal["hold", "async"]
    require_approvers: int
    approvers: tuple[str, ...] | None
    remember: tuple[ApprovalScope, ...]
    max_remember_ttl: int
    # identity, sandbox, method, full URL, body and headers digests hashed together: the
    # async mode's "identical request" (the full URL is never stored, only this digest)
    fingerprint: str
    reason: str = ""  # why it is asked: the rule's description, or the decision's reason
    state: State = "pending"
    votes: tuple[Vote, ...] = ()
    scope: Scope | None = None  # once approved: what it is remembered for
    decided_at: float | None = None
    replica: str | None = None  # the Sandgate instance holding the request

    @property
    def policy(self) -> AskPolicyView:
        return AskPolicyView(self.rule, self.require_approvers, self.approvers, self.remember,
                             self.max_remember_ttl)

    @property
    def approved_by(self) -> tuple[str, ...]:
        return tuple(v.approver for v in self.votes if v.verdict == "approve")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["votes"] = [v.as_dict() for v in self.votes]
        d["scope"] = self.scope.as_dict() if self.scope else None
        d["approvers"] = list(self.approvers) if self.approvers is not None else None
        d["remember"] = list(self.remember)
        d["approved_by"] = list(self.approved_by)
        d["headers"] = [list(h) for h in self.headers]
        d["headers_injected"] = list(self.headers_injected)
        d["binds"] = self.binds
        return d

    @property
    def binds(self) -> dict[str, Any]:
        """What the approval lets through: while pending, and scope request, this one request
        (its method, URL, body and headers); scope sandbox / identity, the rule's requests from
        that caller with the same forwarded headers, until the grant expires."""
        kind = self.scope.kind if self.scope is not None else "request"
        if kind == "request":
            return {"kind": "request", "identity": self.identity, "sandbox": self.sandbox,
                    "method": self.method, "url": self.url, "body_sha256": self.body_sha256,
                    "headers_sha256": self.headers_sha256}
        assert self.scope is not None
        until = (self.decided_at + self.scope.ttl
                 if self.decided_at is not None and self.scope.ttl is not None else None)
        return {"kind": kind, "rule": self.rule, "identity": self.identity,
                "sandbox": self.sandbox if kind == "sandbox" else None,
                "headers_sha256": self.headers_sha256, "until": until}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Approval:
        d = dict(d)
        d.pop("approved_by", None)
        d.pop("binds", None)
        # stored before headers were bound: a digest no request has, so nothing matches it
        d.setdefault("headers_sha256", "")
        d["headers"] = tuple((str(n), str(v)) for n, v in d.get("headers", ()))
        d["headers_injected"] = tuple(d.get("headers_injected", ()))
        d["votes"] = tuple(Vote(v["approver"], v["decision"], v["at"], Scope(**v["scope"]),
                                v.get("note")) for v in d.get("votes", ()))
        d["scope"] = Scope(**d["scope"]) if d.get("scope") else None
        d["approvers"] = tuple(d["approvers"]) if d.get("approvers") is not None else None
        d["remember"] = tuple(d["remember"])
        return cls(**d)


def new_id() -> str:
    """An approval id: unguessable (a sandbox that learns one cannot decide it anyway)."""
    return "ap_" + _secrets.token_urlsafe(12)


def fingerprint(identity: str, sandbox: str | None, method: str, url: str,
                body_sha256: str, headers_sha256: str) -> str:
    h = hashlib.sha256()
    for part in (identity, sandbox or "", method.upper(), url, body_sha256, headers_sha256):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


def vote(a: Approval, user: str, verdict: Verdict, scope: Scope, note: str | None,
         now: float) -> Approval:
    """The approval after `user`'s vote; raises VoteError when it cannot be taken. A user who
    already approved is counted once; a deny from any allowed approver refuses."""
    if a.state != "pending":
        raise VoteError(409, "already_decided", f"approval {a.id} is {a.state}")
    if now >= a.expires:
        raise VoteError(409, "already_decided", f"approval {a.id} timed out")
    if a.approvers is not None and user not in a.approvers:
        raise VoteError(403, "not_an_approver", f"user {user!r} is not one of the approvers "
                        f"rule '{a.rule}' names")
    if verdict == "deny":
        v = Vote(user, "deny", now, Scope("request"), note)
        return replace(a, votes=(*a.votes, v), state="denied", decided_at=now)
    if user in a.approved_by:
        return a  # one user approving twice counts once
    v = Vote(user, "approve", now, scope, note)
    votes = (*a.votes, v)
    approvals = [x for x in votes if x.verdict == "approve"]
    if len(approvals) < a.require_approvers:
        return replace(a, votes=votes)
    # The narrowest scope any approver chose, and the shortest ttl.
    kinds = sorted((x.scope for x in approvals), key=lambda s: SCOPE_ORDER[s.kind])
    kind = kinds[0].kind
    ttls = [x.scope.ttl for x in approvals if x.scope.ttl is not None]
    eff = Scope(kind, min(ttls) if kind != "request" and ttls else None)
    return replace(a, votes=votes, state="approved", scope=eff, decided_at=now)


@dataclass(frozen=True, slots=True)
class Grant:
    """A remembered approval: every request rule `rule` matches from `identity` (and, scope
    sandbox, from `sandbox`) with the forwarded headers of digest `headers_sha256` (those of
    the approved request) passes without asking until `expires`."""

    rule: str
    identity: str
    sandbox: str | None  # None: scope identity
    headers_sha256: str
    expires: float
    approval: str  # the approval it came from
    approvers: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        return grant_key(self.rule, self.identity, self.sandbox, self.headers_sha256)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["approvers"] = list(self.approvers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Grant:
        return cls(d["rule"], d["identity"], d.get("sandbox"), str(d.get("headers_sha256", "")),
                   float(d["expires"]), d["approval"], tuple(d.get("approvers", ())))


def grant_key(rule: str, identity: str, sandbox: str | None, headers_sha256: str) -> str:
    """Rule names, identities and sandbox ids use no '|' (sandgate.policy, secrets/scope.py);
    the headers digest is hex."""
    return f"{identity}|{rule}|{sandbox if sandbox is not None else '*'}|{headers_sha256}"


def grant_for(a: Approval) -> Grant | None:
    """The grant an approved approval leaves behind (None for scope request)."""
    if a.state != "approved" or a.scope is None or a.scope.kind == "request":
        return None
    assert a.scope.ttl is not None and a.decided_at is not None
    return Grant(a.rule, a.identity, a.sandbox if a.scope.kind == "sandbox" else None,
                 a.headers_sha256, a.decided_at + a.scope.ttl, a.id, a.approved_by)
