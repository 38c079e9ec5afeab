"""The bounds of the policy DNS: nothing a sandbox sends is unbounded, and no source can
starve the others."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from sandgate.limits import TokenBucket

MAX_SOURCES = 4096  # rate-limit buckets kept (oldest first out)


@dataclass(frozen=True, slots=True)
class DnsLimits:
    max_query: int = 512  # bytes of one query (a question and an EDNS OPT record fit easily)
    max_ttl: int = 60  # seconds: an answer's TTL is min(upstream's, this)
    max_answers: int = 8  # records in one answer
    max_chain: int = 8  # CNAMEs Sandgate follows for one name
    rps: float = 50.0  # queries a second per source address (token bucket)
    burst: int = 100
    upstream_timeout: float = 3.0  # seconds for the upstream resolver's answer
    tcp_idle: float = 10.0  # seconds a TCP connection may wait for its next query
    tcp_queries: int = 100  # queries one TCP connection may carry
    tcp_connections: int = 256  # TCP connections open at once
    refuse: Literal["nxdomain", "refused"] = "nxdomain"  # the answer to a name no rule reaches


class SourceRates:
    """One token bucket per source address; a source past its rate is refused (counted)."""

    def __init__(self, rps: float, burst: int, max_sources: int = MAX_SOURCES) -> None:
        self.rps, self.burst, self._max = rps, burst, max_sources
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, source: str) -> bool:
        now = time.monotonic()
        bucket = self._buckets.pop(source, None)
        if bucket is None:
            bucket = TokenBucket(self.rps, self.burst, now)
        self._buckets[source] = bucket
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return bucket.take(now) == 0.0
