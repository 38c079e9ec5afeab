"""Is the fleet's state reachable? One flag per process, flipped by failures and heartbeats.

While it is down no request waits on Redis: budget-bearing requests are refused at once
(503 state_unavailable), rates and connection counts fall back to this process's own counting
(or are refused with `--state-fail closed`). The heartbeat (sandgate.state.fleet) probes every
second and brings it back: recovery needs no restart. Each outage is logged once when it starts
and once when it ends, audited (`state` events) and shown by the `sandgate_state_available`
gauge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("sandgate.state")


class StateHealth:
    def __init__(self, where: str) -> None:
        self.where = where  # the redacted URL, for logs
        self.available = True
        self.since = time.time()
        self.last_error: str | None = None
        # called with the new availability on each change (metrics, audit, reconciliation)
        self.listeners: list[Callable[[bool], None]] = []

    def down(self, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else (type(error).__name__ + (
            f": {error}" if str(error) and "password" not in str(error).lower() else ""))
        self.last_error = detail
        if not self.available:
            return
        self.available = False
        self.since = time.time()
        log.warning("sandgate: shared state %s unavailable (%s): budgets refused (503 "
                    "state_unavailable) until it is back", self.where, detail)
        self._tell(False)

    def up(self) -> None:
        if self.available:
            return
        self.available = True
        log.warning("sandgate: shared state %s is back after %.1fs", self.where,
                    time.time() - self.since)
        self.since = time.time()
        self.last_error = None
        self._tell(True)

    def _tell(self, available: bool) -> None:
        for fn in list(self.listeners):
            try:
                fn(available)
            except Exception:
                log.exception("sandgate: state listener failed")
