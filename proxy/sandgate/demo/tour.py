"""What `sandgate demo` shows, through a running demo stack: the agent's call with the key
injected, the bash tool refused, a reflected key scrubbed, and `explain` for the same requests.

Requests go the way a sandbox's would: a CONNECT to Sandgate with the proxy token, TLS to
Sandgate's CA, the placeholder as the API key. No secret value is ever printed: keys appear as
fingerprints, and a value found in anything the sandbox received fails the demo.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandgate import confdir
from sandgate.demo.stack import API_HOST, DEMO_SECRET, Stack
from sandgate.demo.upstream import REFLECT_HEADER, fingerprint
from sandgate.errors import InternalError
from sandgate.secrets.devserver import DEMO_SECRETS
from sandgate.tokens import issue_token

PLACEHOLDER = "sandgate-placeholder-anthropic"
PATH = "/v1/messages"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    audit: dict[str, Any]

    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.body)
        return doc


class DemoFailed(InternalError):
    """The stack did not behave as the demo shows it (a bug, or a broken installation)."""


def _audit_event(audit: Path, identity: str, seen: int, timeout: float = 10) -> dict[str, Any]:
    """The `request` event of the next request of `identity` (the audit's line `seen` on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = audit.read_text().splitlines() if audit.exists() else []
        for line in lines[seen:]:
            ev: dict[str, Any] = json.loads(line)
            if ev.get("event") == "request" and ev.get("identity") == identity \
                    and ev.get("path") == PATH:
                return ev
        time.sleep(0.05)
    raise DemoFailed(f"no audit event for {identity}'s request within {timeout:.0f}s")


def _call(stack: Stack, identity: str, body: dict[str, Any]) -> Answer:
    key = confdir.token_key(confdir.ensure_confdir(stack.confdir))
    token = issue_token(key, identity, None, 600)
    ctx = ssl.create_default_context(cafile=str(confdir.ensure_ca(stack.confdir)))
    auth = base64.b64encode(f"{identity}:{token}".encode()).decode()
    seen = len(stack.audit.read_text().splitlines()) if stack.audit.exists() else 0
    conn = http.client.HTTPSConnection(*stack.proxy, context=ctx, timeout=30)
    try:
        conn.set_tunnel(API_HOST, stack.api_port, headers={"Proxy-Authorization": f"Basic {auth}"})
        conn.request("POST", PATH, json.dumps(body).encode(),
                     headers={"x-api-key": PLACEHOLDER, "content-type": "application/json"})
        resp = conn.getresponse()
        answer = Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read(),
                        {})
    finally:
        conn.close()
    answer.audit = _audit_event(stack.audit, identity, seen)
    return answer


def _no_leak(answer: Answer, value: str) -> None:
    seen = json.dumps(answer.headers) + answer.body.decode(errors="replace")
    if value in seen:  # never printed: only said
        raise DemoFailed("the secret value reached the sandbox")


def run_tour(stack: Stack, out: Callable[[str], None]) -> None:
    path, field = DEMO_SECRET
    value = DEMO_SECRETS[path][field]
    fp = fingerprint(value)
    url = f"{stack.api_url}{PATH}"
    out(f"  OpenBao dev server  {stack.vault.addr}   secret/{path} {field} = {fp} (a demo value)")
    out(f"  stand-in LLM API    {stack.api_url}   on 127.0.0.1, answers with what it received")
    out(f"  Sandgate            {stack.proxy[0]}:{stack.proxy[1]}   policy "
        f"{stack.policies / 'demo.yaml'}")
    out("")

    out(f"1. coding-agent POST {url}   x-api-key: {PLACEHOLDER}")
    a = _call(stack, "coding-agent", {"model": "demo", "messages": []})
    _no_leak(a, value)
    got = a.json().get("received_key") if a.status == 200 else None
    if got != fp:
        raise DemoFailed(f"expected 200 with the key {fp} injected, got {a.status} {got}")
    out(f"   -> {a.status}: the API received x-api-key {got} (the Vault secret), injected by "
        f"rule '{a.audit.get('rule')}'; the sandbox only ever held the placeholder")

    out(f"2. bash-tool    POST {url}   (code the agent generated)")
    b = _call(stack, "bash-tool", {"model": "demo", "messages": []})
    _no_leak(b, value)
    if b.status != 403:
        raise DemoFailed(f"expected the bash tool to be refused, got {b.status}")
    refusal = b.json()
    out(f"   -> {b.status} {refusal.get('code')}: {refusal.get('reason')}")

    out(f"3. coding-agent POST {url}   {{\"echo\": true}}: the API reflects the key it got")
    c = _call(stack, "coding-agent", {"echo": True})
    _no_leak(c, value)
    shown = c.json().get("echo", {}).get("x-api-key")
    out(f"   -> {c.status}: the sandbox got {REFLECT_HEADER}: {c.headers.get(REFLECT_HEADER)} and "
        f"\"x-api-key\": \"{shown}\" in the body; redactions in the audit event: "
        f"{c.audit.get('redactions')}")

    out(f"4. sandgate explain POST {url}, for each identity:")
    from sandgate.explain.answer import explain
    from sandgate.policy.loader import load_policy_dir

    policy = load_policy_dir(stack.policies)
    for identity in ("coding-agent", "bash-tool"):
        e, _ = explain(policy, identity, "POST", url, stack.resolve)
        if e["decision"] == "allow":
            verdict = (f"allow by rule '{e['rule']}' ({Path(e['rule_source']).name}); "
                       f"inject {'; '.join(e.get('inject', []))}; {e['address']}")
        else:
            verdict = f"{e['decision']} {e['code']}: {e['reason']}"
        out(f"   {identity}: {verdict}")
