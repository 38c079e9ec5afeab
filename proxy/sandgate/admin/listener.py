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
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from sandgate.admin import access as admin_auth
from sandgate.admin.access import AdminUser
from sandgate.admin.login import Audit, FailureLimit
from sandgate.admin.process import DEFAULT_TOKEN_TTL, AdminState, policy_doc, readiness
from sandgate.admin.routes import mount as mount_routes
from sandgate.approvals import api as approvals_api
from sandgate.console.app import mount as mount_console
from sandgate.console.source import LocalSource
from sandgate.explain.inputs import explain_input, parse_input
from sandgate.metrics import CONTENT_TYPE
from sandgate.secrets.scope import SAFE_ID
from sandgate.tokens import issue_token, parse_ttl

log = logging.getLogger("sandgate.admin")

MAX_BODY = 64 * 1024

OPENABLE = admin_auth.OPENABLE


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, text=json.dumps(body, indent=2) + "\n",
                        content_type="application/json")


def _error(status: int, code: str, reason: str) -> web.Response:
    return _json(status, {"error": code, "reason": reason})


def auth_middleware(admin_token: str, open_paths: frozenset[str],
                    users: tuple[AdminUser, ...] = (), trust_forwarded: bool = False,
                    audit: Audit | None = None, limit: FailureLimit | None = None
                    ) -> Middleware:
    """The admin check of every admin listener (this one and the workers' front): users and
    roles, sandgate.admin.access."""
    return admin_auth.auth_middleware(admin_token, open_paths, users, trust_forwarded,
                                      audit, limit)


def build_app(state: AdminState) -> web.Application:
    auth = auth_middleware(state.admin_token, state.open_paths, state.users,
                           state.trust_forwarded, state.audit, state.login_limit)

    async def healthz(_: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        return _json(*await readiness(state))

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
    mount_routes(app, {
        "healthz": healthz, "readyz": readyz, "metrics": metrics, "policy": policy,
        "reload": reload, "explain": explain_, "tokens": tokens, "end_sandbox": end_sandbox,
        # /v1/approvals (with the grant copy on a worker's control socket)
        **approvals_api.handlers(state.approvals, state.trust_forwarded)})
    return app


async def start_admin(state: AdminState, host: str, port: int) -> web.AppRunner:
    app = build_app(state)
    mount_console(app, LocalSource(state, state.recent), state.admin_token,  # web console
                  state.users, audit=state.audit, limit=state.login_limit)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("sandgate: admin listener at %s:%d", host, port)
    return runner
