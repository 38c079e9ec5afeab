"""The facts about one request that a decision is made on, independent of mitmproxy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a caller asked for.

    `host` is already normalised (see proxy.policy.hosts.normalise_host); `path` is the raw
    request path without the query string: the decision normalises it itself so that every
    consumer (proxy, CLI, later tools) judges the same spelling the same way.
    """

    scheme: str  # "https" or "http"
    host: str
    port: int
    method: str  # upper case
    path: str

    @property
    def target(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}"
