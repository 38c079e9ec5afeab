"""Values Sandgate no longer hands out but still scrubs and still catches as exfiltration.

A value leaves the secret cache when Vault rotates it (a refresh reads a new one), when its
sandbox ends (token expiry, `DELETE /v1/sandboxes/{id}`, a container's death), when a reload
drops or moves its secret, and when its lease is replaced, revoked or runs out. Leaving the
cache does not make it harmless: an upstream may still hold it and echo it, a rotated KV value
usually stays valid for a while, a revocation may still be pending. So it moves here and stays
in the scrubbing set (every response, every channel) and in the exfiltration check (every
request) for `RETIRED_WINDOW` seconds, or until its lease's end when that is later.

The flow that a value was injected into does not depend on this window: it keeps its own
values for as long as it lives (`sandgate.scrub.flowsecrets`), however long its stream runs.
The window covers the other flows: a response that echoes a value some other request was given
(an upstream's request log, a key listing) and a sandbox that replays a value it saw.

Memory is bounded: at most `RETIRED_MAX` values are kept. Past it the value closest to the end
of its window goes first, and a warning names its secret (never the value). At the defaults that
takes more than one retirement a second sustained for an hour.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("sandgate.secrets")

RETIRED_WINDOW = 3600.0
"""Seconds a retired value stays scrubbed and detected (longer when its lease ends later).

An hour: more than Sandgate's longest wait for an upstream (--upstream-read-timeout, 120 s by
default) and its idle timeout (300 s), so a response that starts at any time a request could
still be waiting for it is scrubbed of every value retired meanwhile; streams that run longer
keep their own values (see the module docstring)."""

RETIRED_MAX = 4096
"""At most this many retired values are kept (each adds some 25 forms to the automaton)."""


class Retired:
    """(name, value) -> the clock time until which it is kept. One per proxy process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 window: float = RETIRED_WINDOW, limit: int = RETIRED_MAX) -> None:
        self.clock = clock
        self.window = window
        self.limit = limit
        self._until: dict[tuple[str, str], float] = {}
        self._generation = 0
        self._next_expiry = float("inf")

    def add(self, name: str, value: str, until: float | None = None) -> None:
        """Retire `value` of secret `name` for the window, or until `until` if that is later
        (a lease's end: the credential stays valid that long if its revocation failed)."""
        if not value:
            return
        keep = max(self.clock() + self.window, until or 0.0)
        key = (name, value)
        old = self._until.get(key)
        if old is not None and old >= keep:
            return
        self._until[key] = keep
        self._next_expiry = min(self._next_expiry, keep)
        if old is None:
            self._generation += 1
            if len(self._until) > self.limit:
                self._evict()

    def _evict(self) -> None:
        key = min(self._until, key=self._until.__getitem__)
        del self._until[key]
        log.warning("sandgate: more than %d retired secret values; the oldest one of secret "
                    "'%s' is no longer scrubbed", self.limit, key[0])

    def prune(self) -> None:
        """Drop the values whose window is over."""
        now = self.clock()
        if now < self._next_expiry:
            return
        gone = [k for k, until in self._until.items() if until <= now]
        for k in gone:
            del self._until[k]
        self._next_expiry = min(self._until.values(), default=float("inf"))
        if gone:
            self._generation += 1

    @property
    def generation(self) -> int:
        """Bumps whenever the set of retired values changes (expired ones are pruned here)."""
        self.prune()
        return self._generation

    def pairs(self) -> list[tuple[str, str]]:
        """(name, value) of every value still within its window."""
        self.prune()
        return list(self._until)

    def __contains__(self, pair: object) -> bool:
        self.prune()
        return pair in self._until

    def __len__(self) -> int:
        self.prune()
        return len(self._until)
