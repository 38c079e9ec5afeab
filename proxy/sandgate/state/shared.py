"""`--state`: the fleet's shared state put together for one `sandgate run` process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from sandgate.limits import Limiter
from sandgate.state import StateConfig, open_state
from sandgate.state.fleet import Fleet, process_id
from sandgate.state.health import StateHealth
from sandgate.state.redis_counts import RedisCounts


@dataclass
class SharedState:
    config: StateConfig
    health: StateHealth
    counts: RedisCounts
    fleet: Fleet


def connect(cfg: StateConfig, limiter: Limiter, instance: str, ended_ttl: int,
            audit: Callable[..., None] | None = None, *,
            version: Callable[[], str] = lambda: "",
            on_end: Callable[[str, str], Awaitable[Any]] | None = None,
            on_reload: Callable[[], Awaitable[Any]] | None = None) -> SharedState:
    """The client, the health flag, the counting and the fleet loops (not started yet:
    `shared.fleet.start()` in the running loop), the fleet with what it calls here: the served
    policy's `version`, `on_end` of a sandbox, `on_reload`. Each change of availability is an
    audit event `state` (available, url, fallback, error)."""
    r = open_state(cfg)
    health = StateHealth(cfg.url.redacted())
    process = process_id(instance)
    fleet = Fleet(cfg, r, health, process, ended_ttl, version=version, on_end=on_end,
                  on_reload=on_reload)
    counts = RedisCounts(r, cfg, limiter, health, process, fleet)
    if audit is not None:
        def tell(available: bool) -> None:
            fields: dict[str, Any] = {"available": available, "url": cfg.url.redacted(),
                                      "fallback": "refuse" if cfg.fail == "closed" else
                                      "per_process"}
            if not available:
                fields["error"] = health.last_error
            audit("state", **fields)

        health.listeners.append(tell)
    return SharedState(cfg, health, counts, fleet)


def add_metrics(shared: SharedState, registry: CollectorRegistry) -> None:
    """`sandgate_state_available` and `sandgate_fleet_policy_versions`, read at scrape time."""
    health, fleet = shared.health, shared.fleet
    Gauge("sandgate_state_available", "1 while the shared state (--state) answers, 0 "
          "during an outage (rates then per process or refused: --state-fail)",
          registry=registry).set_function(lambda: 1.0 if health.available else 0.0)
    Gauge("sandgate_fleet_policy_versions", "Distinct policy versions served by the "
          "fleet's live processes (1: they agree)", registry=registry
          ).set_function(lambda: float(len(set(fleet.versions.values()))))
