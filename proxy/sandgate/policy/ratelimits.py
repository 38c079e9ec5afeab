"""Compile an identity's `limits:` and a secret's `budget:` (file format -> model types).

Shape and types are checked by the schema (pydantic); the meaning is checked here, each
problem reported at its field with a fix. A broken entry compiles to nothing (the caller treats
the identity or secret as broken, so the policy does not load).
"""

from __future__ import annotations

import math

from sandgate.policy.model import IdentityLimits, SecretBudget
from sandgate.policy.schema import BudgetSpec, LimitsSpec, Loc, Report
from sandgate.tokens import parse_ttl


def compile_limits(spec: LimitsSpec, loc: Loc, report: Report) -> IdentityLimits | None:
    ok = True
    if spec.rps is not None and not (math.isfinite(spec.rps) and spec.rps > 0):
        report((*loc, "rps"), f"rps must be a number above 0, not {spec.rps!r}",
               "e.g. `rps: 5` (five requests a second) or `rps: 0.5` (one every two seconds); "
               "leave it out for no rate limit")
        ok = False
    if spec.burst is not None and spec.burst < 1:
        report((*loc, "burst"), f"burst must be at least 1, not {spec.burst!r}",
               "the number of requests that may come at once, e.g. `burst: 10`")
        ok = False
    if spec.max_connections is not None and spec.max_connections < 1:
        report((*loc, "max_connections"),
               f"max_connections must be at least 1, not {spec.max_connections!r}",
               "e.g. `max_connections: 64`; leave it out to use --max-connections-per-identity")
        ok = False
    if not ok:
        return None
    return IdentityLimits(rps=float(spec.rps) if spec.rps is not None else None,
                          burst=spec.burst, max_connections=spec.max_connections)


def compile_budget(spec: BudgetSpec, loc: Loc, report: Report) -> SecretBudget | None:
    ok = True
    if spec.calls < 1:
        report((*loc, "calls"), f"calls must be at least 1, not {spec.calls!r}",
               "e.g. `budget: {calls: 1000, per: 1h}`")
        ok = False
    per: float | None = None
    if isinstance(spec.per, int):
        if spec.per < 1:
            report((*loc, "per"), f"per must be at least 1 second, not {spec.per!r}",
                   "write a window like 30s, 15m, 1h or 1d")
            ok = False
        else:
            per = float(spec.per)
    else:
        try:
            per = float(parse_ttl(spec.per))
        except ValueError as e:
            report((*loc, "per"), str(e), "write a window like 30s, 15m, 1h or 1d")
            ok = False
    if not ok or per is None:
        return None
    return SecretBudget(calls=spec.calls, per=per)
