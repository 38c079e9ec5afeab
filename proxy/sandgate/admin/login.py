"""Logins to the admin listener (the web console's form, the admin API's Bearer token): audited,
and guessing bounded.

Every console login, failed login, logout and use of an expired session, and every admin API
request whose Bearer token matches no user, is an `admin_login` audit event (OCSF
Authentication 3002, sandgate.audit.ocsf) with the user and role when known and the source
address; never the token given, nor any part of it.

`FailureLimit` counts wrong tokens per source address and overall in a sliding window: a
source with `per_source` failures in the last `window` seconds (or everyone, once `overall`
failures were seen) is answered 429 with Retry-After, whatever token it sends, until the
oldest failure leaves the window. A success clears nothing (so a guesser gains nothing by
mixing in a token it knows). Memory is bounded: at most `max_sources` addresses are
remembered (the one that failed longest ago is forgotten first) and each keeps at most
`per_source` times; the `overall` limit still holds for the forgotten.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

EVENT = "admin_login"
PER_SOURCE = 5
OVERALL_PER_SOURCE = 20  # the overall limit, in sources' worth of failures
OVERALL = PER_SOURCE * OVERALL_PER_SOURCE
WINDOW = 60.0
MAX_SOURCES = 10_000

Audit = Callable[..., None]


@dataclass
class FailureLimit:
    """Wrong tokens per source address and overall, in a sliding window. `clock` for tests."""

    per_source: int = PER_SOURCE
    overall: int = OVERALL
    window: float = WINDOW
    max_sources: int = MAX_SOURCES
    clock: Callable[[], float] = time.monotonic
    _sources: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict, repr=False)
    _all: deque[float] = field(default_factory=deque, repr=False)

    def _prune(self, now: float) -> None:
        horizon = now - self.window
        while self._all and self._all[0] <= horizon:
            self._all.popleft()
        # the sources are in the order they last failed: the stale ones come first
        while self._sources:
            source, times = next(iter(self._sources.items()))
            if times and times[-1] > horizon:
                break
            del self._sources[source]

    def retry_after(self, source: str) -> int | None:
        """Seconds `source` must wait before its token is looked at, or None."""
        now = self.clock()
        self._prune(now)
        times = self._sources.get(source)
        if times is not None:
            while times and times[0] <= now - self.window:
                times.popleft()
            if len(times) >= self.per_source:
                return max(1, math.ceil(times[0] + self.window - now))
        if len(self._all) >= self.overall:
            return max(1, math.ceil(self._all[0] + self.window - now))
        return None

    def failed(self, source: str) -> int:
        """Count one wrong token from `source`; how many it has in the window now."""
        now = self.clock()
        self._prune(now)
        times = self._sources.pop(source, None) or deque(maxlen=self.per_source)
        times.append(now)
        self._sources[source] = times  # now the most recent
        while len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)
        self._all.append(now)
        while len(self._all) > self.overall:
            self._all.popleft()
        return len(times)

    @classmethod
    def per_minute(cls, per_source: int) -> FailureLimit:
        """`--admin-login-limit N`: N wrong tokens a minute per source, 20 N overall."""
        if per_source < 1:
            raise ValueError(f"--admin-login-limit {per_source}: give at least 1")
        return cls(per_source=per_source, overall=per_source * OVERALL_PER_SOURCE)

    def sources(self) -> int:
        return len(self._sources)


def audit_login(audit: Audit | None, action: str, *, via: str, source: str | None,
                user: str | None = None, role: str | None = None,
                reason: str | None = None, **extra: Any) -> None:
    """One `admin_login` event: action login / failed / logout / expired, via console or
    admin_api. A failed write raises (the caller fails closed: no session, an error page)."""
    if audit is None:
        return
    fields: dict[str, Any] = {"action": action, "via": via,
                              "outcome": "failed" if action == "failed" else "ok",
                              "user": user, "role": role, "source": source or None}
    if reason is not None:
        fields["reason"] = reason
    audit(EVENT, **{k: v for k, v in {**fields, **extra}.items() if v is not None})
