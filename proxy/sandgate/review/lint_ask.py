"""`sandgate lint` on `action: ask` rules and `webhooks:` (sandgate.policy.ask).

When several rules match, deny wins over ask and ask over allow (sandgate.decision), so:

- an ask rule whose every request a deny rule matches never asks;
- an allow rule whose every request an ask rule matches never decides alone: its requests are
  always held (and get the ask rule's credentials, not its own);
- a hold longer than the proxy's default --idle-timeout (300 s) is cut by it: the client's
  connection is closed while it waits;
- a webhook no ask rule names is never posted to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sandgate.limits import DEFAULT_IDLE_TIMEOUT
from sandgate.policy.model import Policy
from sandgate.policy.overlap import covers

Loc = tuple[str | int, ...]


def ask_findings(policy: Policy,
                 finding: Callable[[str, str, Loc, str, str], Any]) -> list[Any]:
    out: list[Any] = []
    named: set[str] = set()
    for ident in policy.identities.values():
        asks = [r for r in ident.rules if r.ask is not None]
        for r in asks:
            assert r.ask is not None
            if r.ask.webhook is not None:
                named.add(r.ask.webhook)
            where = r.where or ("identities", ident.name)
            deny = next((d for d in ident.rules if d.action == "deny" and covers(d, r)), None)
            if deny is not None:
                out.append(finding("ask-never-asks",
                    r.source.file, where, f"ask rule '{r.name}' never asks: deny rule "
                    f"'{deny.name}' matches every request it matches (deny wins over ask)",
                    f"remove rule '{r.name}', or narrow deny rule '{deny.name}'"))
            if r.ask.mode == "hold" and r.ask.timeout > DEFAULT_IDLE_TIMEOUT:
                out.append(finding("ask-hold-timeout",
                    r.source.file, (*where, "approval", "timeout"),
                    f"ask rule '{r.name}' holds a request up to {r.ask.timeout}s, longer than "
                    f"the proxy's default --idle-timeout of {DEFAULT_IDLE_TIMEOUT:g}s (and "
                    "most SDK timeouts): the connection may be closed while it waits",
                    "use `mode: async` for long waits (202, then the identical request "
                    "passes), or raise --idle-timeout and the clients' timeouts"))
        for a in ident.rules:
            if a.action != "allow" or a.ask is not None or a.passthrough:
                continue
            hider = next((r for r in asks if covers(r, a)), None)
            if hider is not None:
                out.append(finding("ask-hides-allow",
                    a.source.file, a.where or ("identities", ident.name),
                    f"allow rule '{a.name}' never decides alone: ask rule '{hider.name}' "
                    "matches every request it matches (ask wins over allow), so its "
                    "requests are always held for approval",
                    f"narrow ask rule '{hider.name}' (methods, paths) to what needs a human, "
                    f"or remove rule '{a.name}'"))
    for name, hook in policy.webhooks.items():
        if name not in named:
            out.append(finding("unused-webhook", hook.source.file, ("webhooks", name),
                               f"webhook '{name}' is not named by any ask rule",
                               "name it in an ask rule's `approval: {webhook: ...}`, or "
                               "remove it"))
    return out
