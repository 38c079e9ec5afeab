"""The request mix of the soak tests: what each request is, what its answer must be, and the check.

Each `Case` carries its expectation: the status and X-Sandgate-Reason code, whether it may reach
the upstream, and exactly which credential (header, value) the upstream must see for it (None:
none at all). `check` compares responses and the upstreams' records by request id and returns
problems as text that never holds a secret value (fingerprints only).
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.integration.soak.conftest import IDENTITIES, LISTEN, SECRET_VALUES, placeholder
from tests.support.loadclient import Req, Res, Tunnel
from tests.support.recorder import Recorder
from tests.support.secrets import fingerprint


@dataclass
class Case:
    req: Req
    identity: str
    scheme: str
    host: str
    kind: str
    status: int
    code: str  # expected X-Sandgate-Reason ("" when the upstream answers)
    credential: tuple[str, str] | None  # (header, value) the upstream must see; None: none
    forwarded: bool


# kind -> weight; every kind of the issue: allowed with and without injection, refused by
# policy (no rule, deny rule, a placeholder where its rule does not bind it), refused by address.
WEIGHTS = {"inject": 30, "bearer": 10, "echo": 5, "open": 20, "open_http": 5,
           "denied": 6, "no_rule": 6, "exfil": 6, "inside": 6, "loop": 6}


def make_case(kind: str, identity: str, rid: str) -> Case:
    s = identity[-1]
    other = IDENTITIES[(IDENTITIES.index(identity) + 1) % len(IDENTITIES)][-1]
    key = ("x-api-key", SECRET_VALUES[f"key_{s}"])
    body = json.dumps({"model": "soak", "rid": rid}).encode()
    ph = [("x-api-key", placeholder(f"key_{s}"))]
    if kind == "inject":
        return Case(Req(rid, "POST", f"/v1/messages/{rid}", ph, body), identity, "https",
                    "api.soak.test", kind, 200, "", key, True)
    if kind == "echo":
        return Case(Req(rid, "POST", f"/echo/{rid}", ph, body), identity, "https",
                    "api.soak.test", kind, 200, "", key, True)
    if kind == "bearer":
        return Case(Req(rid, "POST", f"/v1/chat/{rid}",
                        [("authorization", f"Bearer {placeholder(f'tok_{s}')}")], body),
                    identity, "https", "bearer.soak.test", kind, 200, "",
                    ("authorization", f"Bearer {SECRET_VALUES[f'tok_{s}']}"), True)
    if kind == "open":
        return Case(Req(rid, "GET", f"/pub/{rid}"), identity, "https", "open.soak.test", kind,
                    200, "", None, True)
    if kind == "open_http":
        return Case(Req(rid, "GET", f"/pub/{rid}"), identity, "http", "open.soak.test", kind,
                    200, "", None, True)
    if kind == "denied":
        return Case(Req(rid, "POST", f"/admin/{rid}", ph, body), identity, "https",
                    "api.soak.test", kind, 403, "denied_by_rule", None, False)
    if kind == "no_rule":
        return Case(Req(rid, "GET", f"/v1/messages/{rid}", ph), identity, "https",
                    "api.soak.test", kind, 403, "no_rule", None, False)
    if kind == "exfil":
        # another identity's placeholder, smuggled in a header the rule does not inject
        return Case(Req(rid, "POST", f"/v1/messages/{rid}",
                        [*ph, ("x-note", placeholder(f"key_{other}"))], body), identity, "https",
                    "api.soak.test", kind, 403, "exfiltration", None, False)
    if kind in ("inside", "loop"):
        return Case(Req(rid, "GET", f"/x/{rid}"), identity, "https", f"{kind}.soak.test", kind,
                    403, "internal_address", None, False)
    raise ValueError(kind)


def make_mix(prefix: str, workers: int, per_worker: int, seed: int = 11) -> list[list[Case]]:
    """`workers` lists of `per_worker` cases; worker i is identity i mod 4."""
    rng = random.Random(seed)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    out = []
    for w in range(workers):
        identity = IDENTITIES[w % len(IDENTITIES)]
        out.append([make_case(k, identity, f"{prefix}-{w}-{i}")
                    for i, k in enumerate(rng.choices(kinds, weights, k=per_worker))])
    return out


def client_ssl(ca: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def run_worker(port: int, tokens: dict[str, str], ctx: ssl.SSLContext,
                     cases: Sequence[Case],
                     on_result: Callable[[Case, Res], None] | None = None,
                     stop: asyncio.Event | None = None,
                     tunnels: dict[tuple[str, str, str], Tunnel] | None = None,
                     ) -> list[tuple[Case, Res]]:
    """One client: a keep-alive tunnel per (identity, scheme, host), the cases in order.

    `tunnels` may hold some already open (see `open_tunnel`)."""
    tunnels = {} if tunnels is None else tunnels
    out = []
    try:
        for case in cases:
            if stop is not None and stop.is_set():
                break
            key = (case.identity, case.scheme, case.host)
            t = tunnels.get(key)
            if t is None:
                t = tunnels[key] = Tunnel(
                    LISTEN, port, case.identity, tokens[case.identity], case.host,
                    scheme=case.scheme, ssl_ctx=ctx)
            res = await t.send(case.req)
            out.append((case, res))
            if on_result is not None:
                on_result(case, res)
    finally:
        for t in tunnels.values():
            t.close()
    return out


async def open_tunnel(port: int, tokens: dict[str, str], ctx: ssl.SSLContext,
                      case: Case) -> dict[tuple[str, str, str], Tunnel]:
    """A tunnel for `case`'s identity and host, opened now (for `run_worker(tunnels=...)`)."""
    t = Tunnel(LISTEN, port, case.identity, tokens[case.identity], case.host,
               scheme=case.scheme, ssl_ctx=ctx)
    await t._open()
    return {(case.identity, case.scheme, case.host): t}


async def run_all(port: int, tokens: dict[str, str], ca: str,
                  mix: Sequence[Sequence[Case]]) -> list[tuple[Case, Res]]:
    ctx = client_ssl(ca)
    parts = await asyncio.gather(*(run_worker(port, tokens, ctx, cases) for cases in mix))
    return [x for part in parts for x in part]


_SECRETS = tuple(v.encode() for v in SECRET_VALUES.values())


def leaked(raw: bytes) -> list[str]:
    """Fingerprints of the secret values in `raw` (never the values)."""
    return [fingerprint(v.decode()) for v in _SECRETS if v in raw]


def check(results: Sequence[tuple[Case, Res]], upstreams: dict[str, Recorder],
          accept: Callable[[Case, Res], bool] | None = None) -> list[str]:
    """Every response is the right one; allowed requests reached the upstream with exactly the
    right credential, refused ones did not reach it; no secret in any response.

    `accept(case, res)` may excuse a result from the status check (used around an outage)."""
    problems: list[str] = []
    for case, res in results:
        rid = case.req.rid
        where = f"{rid} ({case.kind}, {case.identity})"
        seen = upstreams[case.scheme].seen.get(rid)
        if res.raw and leaked(res.raw):
            problems.append(f"{where}: secret {leaked(res.raw)} in the response")
        if res.status == 0:
            problems.append(f"{where}: no response ({res.error})")
            continue
        excused = accept is not None and accept(case, res)
        if not excused and (res.status, res.reason_code) != (case.status, case.code):
            problems.append(f"{where}: got {res.status} {res.reason_code!r}, expected "
                            f"{case.status} {case.code!r}")
            continue
        if res.status == 200:
            if seen is None:
                problems.append(f"{where}: answered 200 but never reached the upstream")
                continue
            if f'"id": "{rid}"'.encode() not in res.body:
                problems.append(f"{where}: the response belongs to another request")
            creds = seen.credentials
            if case.credential is None:
                if creds:
                    problems.append(f"{where}: upstream got credential headers {sorted(creds)}")
            else:
                header, value = case.credential
                if set(creds) != {header} or creds[header] != value:
                    got = {k: fingerprint(v) for k, v in creds.items()}
                    problems.append(f"{where}: upstream got {got}, expected {header}="
                                    f"{fingerprint(value)}")
        elif seen is not None:
            problems.append(f"{where}: refused with {res.status} but reached the upstream")
    return problems


def summary(results: Sequence[tuple[Case, Res]], seconds: float) -> str:
    lat = sorted(r.latency for _, r in results)
    n = len(lat)
    by_kind: dict[str, int] = {}
    for c, _ in results:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + 1
    return (f"{n} requests in {seconds:.1f} s = {n / seconds:.0f} req/s; latency p50 "
            f"{lat[n // 2] * 1000:.0f} ms, p99 {lat[int(n * 0.99)] * 1000:.0f} ms, max "
            f"{lat[-1] * 1000:.0f} ms; kinds {by_kind}")
