"""Announce a new approval request to the rule's webhook (a policy's `webhooks:`).

Sent by Sandgate itself, straight to the receiver (never through a sandbox's policy), with TLS
verified. Two body formats: `slack` (a Slack-compatible incoming-webhook message: `text` and
`blocks`) and `json` (Sandgate's own: {"event": "approval_requested", "approval": {...}}). With
`secret:`, each post is signed: `X-Sandgate-Timestamp: UNIX` and
`X-Sandgate-Signature: sha256=HEX`, HMAC-SHA256 under the secret's value of
`TIMESTAMP + "." + BODY` (so a receiver rejects old or altered posts). A failure is logged and
audited (`approval` event, action `webhook_failed`) and never delays the held request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from sandgate.approvals.votes import Approval
from sandgate.policy.model import Policy, Webhook
from sandgate.secrets.vault import SecretBroker

log = logging.getLogger("sandgate.approvals")

TIMEOUT = 10.0
SIGNATURE_HEADER = "X-Sandgate-Signature"
TIMESTAMP_HEADER = "X-Sandgate-Timestamp"


def sign(key: bytes, timestamp: str, body: bytes) -> str:
    """The X-Sandgate-Signature value of a post."""
    mac = hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(key: bytes, timestamp: str, body: bytes, signature: str,
           max_age: float = 300, now: float | None = None) -> bool:
    """What a receiver checks (and the tests): the signature, and a recent timestamp."""
    if not timestamp.isdigit() or abs((now or time.time()) - int(timestamp)) > max_age:
        return False
    return hmac.compare_digest(sign(key, timestamp, body), signature)


SLACK_FIELD_MAX = 1900  # Slack refuses a section field over 2000 characters


def _summary(a: Approval) -> str:
    who = a.identity + (f" (sandbox {a.sandbox})" if a.sandbox else "")
    tool = f", tool {a.tool}" if a.tool else ""
    need = f"; needs {a.require_approvers} approvers" if a.require_approvers > 1 else ""
    return (f"Sandgate approval {a.id}: {who} asks {a.method} {a.url} (rule {a.rule}{tool}, "
            f"body {a.body_size} bytes, {len(a.headers)} headers){need}. "
            f"Decide: sandgate approvals approve {a.id}")


def _slack_escape(text: str) -> str:
    """The sandbox chose these headers: no Slack mention or link of its making (`<!channel>`,
    `<https://...|Approve>`) is read as markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def headers_text(a: Approval, limit: int = SLACK_FIELD_MAX) -> str:
    """The approval's headers (already scrubbed) one per line, and the injected ones by name;
    cut at `limit` characters, saying so (the admin API shows them all)."""
    lines = [f"{_slack_escape(n)}: {_slack_escape(v)}" for n, v in a.headers] or ["(none)"]
    lines += [f"{n}: [injected by Sandgate]" for n in a.headers_injected]
    lines.append(f"sha256 {a.headers_sha256[:16]}...")
    text = "\n".join(lines)
    if len(text) > limit:
        text = text[:limit] + f"\n... (cut: `sandgate approvals show {a.id}` shows them all)"
    return text


def body_for(hook: Webhook, a: Approval) -> dict[str, Any]:
    if hook.format == "json":
        return {"event": "approval_requested", "approval": a.as_dict()}
    text = _summary(a)
    fields = [("Identity", a.identity), ("Sandbox", a.sandbox or "-"),
              ("Request", f"{a.method} {a.url}"), ("Rule", a.rule), ("Tool", a.tool or "-"),
              ("Body", f"{a.body_size} bytes, sha256 {a.body_sha256[:16]}..."),
              ("Headers", headers_text(a))]
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*Approval {a.id}*"}},
            {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{v}"}
                                           for k, v in fields]},
            {"type": "context", "elements": [{"type": "mrkdwn", "text":
                                              f"`sandgate approvals approve {a.id}`"}]},
        ],
    }


class WebhookSender:
    def __init__(self, broker: SecretBroker | None, audit: Callable[..., None] | None = None,
                 ssl: Any = True) -> None:
        self.broker = broker
        self.audit = audit
        self.ssl = ssl  # True: the system's CA bundle (tests pass their own context)

    async def notify(self, policy: Policy, a: Approval) -> None:
        """Post the approval to its rule's webhook, if any; never raises."""
        rule = _rule(policy, a)
        name = rule.ask.webhook if rule is not None and rule.ask is not None else None
        hook = policy.webhooks.get(name) if name is not None else None
        if hook is None:
            return
        try:
            status = await self._post(hook, a)
            if status >= 300:
                raise OSError(f"the receiver answered {status}")
        except Exception as e:
            why = f"{type(e).__name__}: {e}"[:300]
            log.warning("sandgate: webhook %s for approval %s failed: %s", hook.name, a.id, why)
            if self.audit is not None:
                try:
                    self.audit("approval", action="webhook_failed", approval=a.id,
                               webhook=hook.name, error=why)
                except Exception:
                    log.exception("sandgate: audit of a webhook failure failed")
            return
        if self.audit is not None:
            self.audit("approval", action="webhook_sent", approval=a.id, webhook=hook.name,
                       status=status)

    async def _post(self, hook: Webhook, a: Approval) -> int:
        body = json.dumps(body_for(hook, a), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "sandgate"}
        if hook.secret is not None:
            if self.broker is None:
                raise OSError("no Vault to read the signing secret from")
            key = (await self.broker.get(hook.secret)).value.encode()
            ts = str(int(time.time()))
            headers[TIMESTAMP_HEADER] = ts
            headers[SIGNATURE_HEADER] = sign(key, ts, body)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s, \
                s.post(hook.url, data=body, headers=headers, ssl=self.ssl,
                       allow_redirects=False) as r:
            return r.status


def _rule(policy: Policy, a: Approval) -> Any:
    ident = policy.identities.get(a.identity)
    return next((r for r in ident.rules if r.name == a.rule), None) if ident else None
