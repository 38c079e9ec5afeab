"""Rule expiry: `expires:` of a rule ends a grant on review, not in the proxy.

From its day on `sandgate check` fails (the rule must be removed or renewed in a reviewed
change); in the week before, `sandgate lint` warns. The proxy keeps applying the rule: an
expiry that silently cut an agent off in production would be an outage, not a review.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sandgate.policy.model import Policy, Rule

WARN_BEFORE = timedelta(days=7)


def today_utc() -> date:
    return datetime.now(UTC).date()


@dataclass(frozen=True, slots=True)
class Expiry:
    identity: str
    rule: Rule
    expires: date
    expired: bool  # False: it expires within WARN_BEFORE

    @property
    def message(self) -> str:
        r = self.rule
        who = f" (owner {r.meta.owner})" if r.meta is not None and r.meta.owner else ""
        if self.expired:
            return (f"rule '{r.name}' of identity '{self.identity}'{who} expired on "
                    f"{self.expires.isoformat()}")
        return (f"rule '{r.name}' of identity '{self.identity}'{who} expires on "
                f"{self.expires.isoformat()}")

    @property
    def fix(self) -> str:
        return (f"remove rule '{self.rule.name}', or renew it with a later `expires:` in a "
                "reviewed change")

    def __str__(self) -> str:
        return f"{self.rule.source}: {self.message}. Fix: {self.fix}"


def expiries(policy: Policy, today: date | None = None) -> Iterator[Expiry]:
    """Every rule that has expired (today counts) or expires within WARN_BEFORE, once per
    rule (a template's rule is listed for each identity that uses it)."""
    day = today or today_utc()
    for name, ident in policy.identities.items():
        for r in ident.rules:
            when = r.meta.expires if r.meta is not None else None
            if when is not None and when - WARN_BEFORE <= day:
                yield Expiry(name, r, when, when <= day)
