"""The admin listener (`sandgate run --admin HOST:PORT`): health, readiness, metrics, policy.

aiohttp, in the same event loop as mitmproxy. Every endpoint but `/healthz` (and what
`--admin-open` names: `/readyz`, `/metrics`) needs `Authorization: Bearer <token>` (compared in
constant time). Nothing here answers with a secret
value: explanations name secrets, proxy tokens are issued only for identities of the loaded
policy and only with a capped TTL.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from sandgate.admin import access as admin_auth
from sandgate.admin.access import AdminUser, needs
from sandgate.admin.login import Audit, FailureLimit
from sandgate.approvals import api as approvals_api
from sandgate.approvals.service import Approvals
from sandgate.console.ring import EventRing
from sandgate.explain.inputs import explain_input, parse_input
from sandgate.metrics import CONTENT_TYPE, Metrics
from sandgate.policy.live import LivePolicy
from sandgate.secrets.scope import SAFE_ID
from sandgate.secrets.vault import SecretBroker
from sandgate.tokens import issue_token, parse_ttl

if TYPE_CHECKING:
    from sandgate.state.fleet import Fleet

log = logging.getLogger("sandgate.admin")

DEFAULT_TOKEN_TTL = 3600
DEFAULT_MAX_TOKEN_TTL = 24 * 3600
MAX_BODY = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class AdminState:
    live: LivePolicy
    broker: SecretBroker
    metrics: Metrics
    token_key: bytes
    admin_token: str
    listener_up: Callable[[], bool]
    draining: Callable[[], bool]
    max_token_ttl: int = DEFAULT_MAX_TOKEN_TTL
    # writes an audit event (event, **fields); tokens issued here are audited (never the token)
    audit: Callable[..., None] | None = None
    # the proxy's --resolve pins: explain shows the address step exactly as the proxy runs it
    resolve: Mapping[str, str] = field(default_factory=dict)
    # --admin-open: paths served without the token (kubelet probes and Prometheus carry none);
    # only these two can be opened, and neither answers with anything secret
    open_paths: frozenset[str] = frozenset()
    # --admin-users: named users with roles (the admin token is the user `admin`)
    users: tuple[AdminUser, ...] = ()
    # a worker's control socket: the front's forwarded user (sandgate.admin.access) is trusted
    trust_forwarded: bool = False
    # `action: ask`: the approvals this process holds or decides (sandgate.approvals)
    approvals: Approvals | None = None
    # --state: sandbox ends and reloads reach every replica; /readyz shows the fleet's state
    fleet: Fleet | None = None
    # the recent decisions the web console shows (fed by the audit stream: runner.py)
    recent: EventRing | None = None
    # wrong tokens per source, shared by the admin API and the console's login (admin_login)
    login_limit: FailureLimit = field(default_factory=FailureLimit)


OPENABLE = admin_auth.OPENABLE


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body, indent=2) + "\n",
                        content_type="application/json")


def _error(status: int, code: str, reason: str) -> web.Response:
    return _json(status, {"error": code, "reason": reason})


def needs_vault(state: AdminState) -> bool:
    return any(r.secrets for ident in state.live.policy.identities.values()
               for r in ident.rules)


def auth_middleware(admin_token: str, open_paths: frozenset[str],
                    users: tuple[AdminUser, ...] = (), trust_forwarded: bool = False,
                    audit: Audit | None = None, limit: FailureLimit | None = None
                    ) -> Middleware:
    """The admin check of every admin listener (this one and the workers' front): users and
    roles, sandgate.admin.access."""
    return admin_auth.auth_middleware(admin_token, open_paths, users, trust_forwarded,
                                      audit, limit)


def policy_doc(state: AdminState) -> dict[str, Any]:
    """The `/v1/policy` answer (also the web console's overview)."""
    cur = state.live.current
    p = cur.policy
    return {
        "version": cur.version,
        "loaded_at": cur.loaded_at,
        "loaded_at_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cur.loaded_at)),
        "directory": str(state.live.directory),
        "files": list(cur.files),
        "identities": {
            name: {"mode": ident.mode,
                   "rules": [{"name": r.name, "action": r.verb,
                              "hosts": [h.text for h in r.hosts],
                              "secrets": sorted(r.secrets),
                              "passthrough": r.passthrough} for r in ident.rules]}
            for name, ident in sorted(p.identities.items())},
        "secrets": sorted(p.secrets),
        "last_reload": state.live.last.as_dict() if state.live.last else None,
    }


def build_app(state: AdminState) -> web.Application:
    auth = auth_middleware(state.admin_token, state.open_paths, state.users,
                           state.trust_forwarded, state.audit, state.login_limit)

    async def healthz(_: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reasons: list[str] = []
        if state.draining():
            reasons.append("shutting down: not accepting new connections")
        elif not state.listener_up():
            reasons.append("the proxy listener is not up")
        if needs_vault(state):
            problem = await state.broker.check()
            if problem is not None:
                reasons.append(f"vault: {problem}")
        body: dict[str, Any] = {"ready": not reasons, "reasons": reasons,
                                "policy_version": state.live.current.version}
        if state.fleet is not None:
            fleet = body["fleet"] = state.fleet.agreement()
            if not fleet["available"] and state.fleet.cfg.fail == "closed":
                reasons.append("shared state unavailable (--state-fail closed)")
                body["ready"] = False
        if state.live.problems:
            # the last reload failed: the previous policy keeps serving, so still ready
            body["policy_reload_problems"] = list(state.live.problems)
        return _json(200 if not reasons else 503, body)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def policy(_: web.Request) -> web.Response:
        return _json(200, policy_doc(state))

    async def reload(_: web.Request) -> web.Response:
        out = await state.live.reload("api")
        if state.fleet is not None and out.outcome != "error":  # every replica reloads too
            await state.fleet.announce_reload(out.version)
        return _json(200 if out.outcome != "error" else 422, out.as_dict())

    async def _body(request: web.Request) -> dict[str, Any]:
        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=len(raw))
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            raise ValueError("the body is not JSON") from None
        if not isinstance(doc, dict):
            raise ValueError("the body must be a JSON object")
        return doc

    def _str(doc: dict[str, Any], key: str, required: bool = True) -> str | None:
        v = doc.get(key)
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v:
            raise ValueError(f"`{key}` must be a non-empty string")
        return v

    @needs("viewer")  # read-only: a viewer may ask what the policy says
    async def explain_(request: web.Request) -> web.Response:
        try:
            doc = await _body(request)
            # the fields of an `explain --batch` JSON line, but no body_file (a proxy's file)
            inp = parse_input(doc, files=False)
            out, _allowed = explain_input(state.live.policy, inp, state.resolve)
        except ValueError as e:
            return _error(400, "bad_request", str(e))
        return _json(200, out)

    async def tokens(request: web.Request) -> web.Response:
        try:
            doc = await _body(request)
            identity = _str(doc, "identity")
            sandbox = _str(doc, "sandbox", required=False)
            ttl_raw = doc.get("ttl")
            if ttl_raw is None:
                ttl = min(DEFAULT_TOKEN_TTL, state.max_token_ttl)
            elif isinstance(ttl_raw, int) and not isinstance(ttl_raw, bool):
                if ttl_raw <= 0:
                    raise ValueError("`ttl` must be positive")
                ttl = ttl_raw
            elif isinstance(ttl_raw, str):
                ttl = parse_ttl(ttl_raw)
            else:
                raise ValueError("`ttl` must be seconds or a duration like 15m, 1h")
        except ValueError as e:
            return _error(400, "bad_request", str(e))
        assert identity is not None
        if identity not in state.live.policy.identities:
            return _error(404, "unknown_identity",
                          f"identity {identity!r} is not defined in the loaded policy")
        if ttl > state.max_token_ttl:
            return _error(400, "ttl_too_long", f"ttl {ttl}s is over the cap of "
                          f"{state.max_token_ttl}s (--admin-max-token-ttl)")
        token = issue_token(state.token_key, identity, sandbox, ttl)
        if state.audit is not None:
            state.audit("token", identity=identity, sandbox=sandbox, ttl=ttl,
                        issued_by="admin_api")
        log.info("issued a proxy token for identity %s (sandbox %s, ttl %ss) via the admin API",
                 identity, sandbox, ttl)
        return _json(200, {"token": token, "identity": identity, "sandbox": sandbox,
                           "ttl": ttl, "expires_at": int(time.time()) + ttl})

    async def end_sandbox(request: web.Request) -> web.Response:
        """A fleet controller says a sandbox has ended: revoke its dynamic secrets now."""
        sandbox = request.match_info["sandbox"]
        if not SAFE_ID.fullmatch(sandbox):
            return _error(400, "bad_request", "the sandbox id must be letters, digits, '.', "
                          "'_', '@' and '-'")
        shared = None
        if state.fleet is not None:  # ended for the fleet first: others revoke meanwhile
            shared = await state.fleet.end_sandbox(sandbox, "admin_api")
        counts = await state.broker.end_sandbox(sandbox, "admin_api")
        log.info("sandbox %s ended via the admin API: %d lease(s) revoked, %d pending",
                 sandbox, counts["revoked"], counts["pending"])
        # 202 while a revocation is still being retried (Vault down): it is not done yet
        extra = {} if shared is None else {"fleet": shared}
        return _json(200 if not counts["pending"] else 202,
                     {"sandbox": sandbox, **counts, **extra})

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/policy", policy)
    app.router.add_post("/v1/reload", reload)
    app.router.add_post("/v1/explain", explain_)
    app.router.add_post("/v1/tokens", tokens)
    app.router.add_delete("/v1/sandboxes/{sandbox}", end_sandbox)
    approvals_api.register(app, state.approvals, state.trust_forwarded)  # /v1/approvals
    return app


async def start_admin(state: AdminState, host: str, port: int) -> web.AppRunner:
    from sandgate.console.app import mount
    from sandgate.console.source import LocalSource

    app = build_app(state)
    mount(app, LocalSource(state, state.recent), state.admin_token, state.users,  # web console
          audit=state.audit, limit=state.login_limit)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("sandgate: admin listener at %s:%d", host, port)
    return runner
