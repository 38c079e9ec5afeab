"""`action: ask` rules and `webhooks:`: their file form compiled and checked (sandgate.approvals
holds and decides the requests; sandgate.decision says "ask").

Checked here: the timeout and remember ttl are durations within their bounds, two-person rules
can be met by the approvers named, an ask rule cannot pass through (a tunnel cannot be held), and
`approval:` appears only on ask rules. The webhook names and secrets are checked once the files
are merged (sandgate.policy.loader), like every other cross-file name.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from sandgate.policy.model import (
    MAX_ASYNC_TIMEOUT,
    MAX_HOLD_TIMEOUT,
    MAX_REMEMBER_TTL,
    AskPolicy,
    Source,
    Webhook,
)
from sandgate.policy.schema import ApprovalSpec, RuleSpec, WebhookSpec
from sandgate.tokens import parse_ttl

Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]

# the `approval:` keys a rule may also carry itself, as the issue spells them
SHORTHANDS = ("timeout", "require_approvers")
USER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def duration(value: int | str, loc: Loc, rep: Report, what: str) -> int | None:
    """Seconds from an integer or a 30s/15m/1h/7d duration; reported (None) when invalid."""
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int):
        if value >= 1:
            return value
        rep(loc, f"{what} must be at least 1 second, not {value}", "write e.g. 120 or 2m")
        return None
    try:
        return parse_ttl(value)
    except ValueError as e:
        rep(loc, f"{what}: {e}", "write seconds (e.g. 120) or a duration such as 30s, 2m, 1h")
        return None


def compile_ask(rs: RuleSpec, loc: Loc, rep: Report) -> AskPolicy | None:
    """The rule's AskPolicy (None for allow/deny rules, or when reported)."""
    # rule-level shorthands of `approval:` keys (`timeout: 5m`, `require_approvers: 2`)
    short = {k: v for k in SHORTHANDS if (v := getattr(rs, k)) is not None}
    if rs.action != "ask":
        for key in ("approval", *short):
            if getattr(rs, key) is not None:
                rep((*loc, key), f"`{key}:` only applies to `action: ask` rules, and "
                    f"rule '{rs.name}' is `action: {rs.action}`",
                    f"write `action: ask` to hold its requests for approval, or remove "
                    f"`{key}:`")
        return None
    if rs.passthrough:
        rep((*loc, "passthrough"), "an ask rule cannot be passthrough: a tunnel passed through "
            "unseen has no request to hold for approval",
            "drop passthrough (requests are then inspected and held)")
    spec = rs.approval or ApprovalSpec()
    aloc = (*loc, "approval")
    ok = True
    for key in short:
        if rs.approval is not None and key in rs.approval.model_fields_set:
            rep((*loc, key), f"`{key}` is given twice: on the rule and under `approval:`",
                f"keep one of them (`approval.{key}` or the rule's `{key}`)")
            ok = False
    spec = spec.model_copy(update=short)
    # errors point at the key the file has: the rule's shorthand or the one under approval:
    where = {k: (*loc, k) if k in short else (*aloc, k) for k in SHORTHANDS}
    timeout = duration(spec.timeout, where["timeout"], rep, "`timeout`")
    cap = MAX_HOLD_TIMEOUT if spec.mode == "hold" else MAX_ASYNC_TIMEOUT
    if timeout is not None and timeout > cap:
        rep(where["timeout"], f"`timeout` of {timeout}s is over the {cap}s a request may "
            f"wait in mode {spec.mode}",
            "use mode async for long waits (the client gets 202 and retries)"
            if spec.mode == "hold" else f"use at most {cap}s (7d)")
        ok = False
    ttl = duration(spec.max_remember_ttl, (*aloc, "max_remember_ttl"), rep,
                   "`max_remember_ttl`")
    if ttl is not None and ttl > MAX_REMEMBER_TTL:
        rep((*aloc, "max_remember_ttl"), f"`max_remember_ttl` of {ttl}s is over "
            f"{MAX_REMEMBER_TTL}s (30d)", "use at most 30d")
        ok = False
    approvers: tuple[str, ...] | None = None
    if spec.approvers is not None:
        for j, name in enumerate(spec.approvers):
            if not USER_NAME_RE.fullmatch(name):
                rep((*aloc, "approvers", j), f"approver {name!r} is not a valid user name",
                    "use the names of --admin-users (letters, digits, '.', '_', '@', '-')")
                ok = False
        approvers = tuple(sorted(set(spec.approvers)))
        if len(approvers) < spec.require_approvers:
            rep(where["require_approvers"], f"`require_approvers: {spec.require_approvers}` "
                f"cannot be met by the {len(approvers)} distinct approver(s) named",
                "name at least as many approvers, or lower require_approvers")
            ok = False
    if timeout is None or ttl is None or not ok:
        return None
    remember = tuple(dict.fromkeys(spec.remember))
    return AskPolicy(timeout=timeout,
                     require_approvers=spec.require_approvers, approvers=approvers,
                     mode=spec.mode, remember=remember, max_remember_ttl=ttl,
                     webhook=spec.webhook)


def ask_fields(ask: AskPolicy) -> dict[str, object]:
    """What explain says of an ask rule's approval: who, how many, how long, what mode."""
    return {"mode": ask.mode, "timeout": ask.timeout,
            "require_approvers": ask.require_approvers,
            "approvers": list(ask.approvers) if ask.approvers is not None else "any approver",
            "remember": list(ask.remember), "max_remember_ttl": ask.max_remember_ttl,
            "webhook": ask.webhook,
            "held": "nothing is sent upstream and no secret is read until approved"
            if ask.mode == "hold" else "answered 202 until approved; then the identical "
            "request passes"}


def compile_webhook(name: str, spec: WebhookSpec, loc: Loc, src: Source,
                    rep: Report) -> Webhook | None:
    """A `webhooks:` entry. The URL is https, or http to a loopback address only (a receiver
    on the same host); it carries no credentials in its userinfo."""
    if not USER_NAME_RE.fullmatch(name):
        rep(loc, f"webhook name {name!r} is not a valid name",
            "use letters, digits, '.', '_' and '-', starting with a letter or digit")
        return None
    try:
        u = urlsplit(spec.url)
        host = u.hostname
        u.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as e:
        rep((*loc, "url"), f"webhook URL is not valid: {e}", "write https://HOST/PATH")
        return None
    if u.scheme not in ("https", "http") or not host:
        rep((*loc, "url"), "webhook URL must be an absolute https:// URL",
            "write https://HOST/PATH, e.g. a Slack incoming webhook URL")
        return None
    if u.username is not None or u.password is not None:
        rep((*loc, "url"), "webhook URL must not carry a user name or password",
            "sign the posts with `secret:` instead")
        return None
    if u.scheme == "http" and not _loopback(host):
        rep((*loc, "url"), "webhook URL must be https (http only to a loopback address)",
            "use the receiver's https:// URL")
        return None
    return Webhook(name=name, url=spec.url, format=spec.format, secret=spec.secret, source=src)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
