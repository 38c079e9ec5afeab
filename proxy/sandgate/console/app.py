"""The web console: server-rendered pages under /console/ of the admin listener.

Mounted by `sandgate.admin.listener.build_app` (one process) and
`sandgate.workers.admin_front.build_front` (`--workers N`, where the supervisor asks the
workers: sandgate.console.source). The admin token check lets /console/ through to this app,
which has its own login (sandgate.console.auth): a browser cannot send the Bearer header.

Every answer carries a strict Content-Security-Policy (no inline script or style anywhere: the
pages use only the vendored htmx and console.css from /console/static/), nosniff,
no-referrer and no-store. Nothing here changes state but login, logout and (with the approvals
API) deciding an approval, each a POST checked for its CSRF token and origin. No page shows
more than the audit log holds: no secret value, query values redacted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from sandgate.admin.access import AdminUser, Authenticator
from sandgate.admin.login import Audit, FailureLimit, audit_login
from sandgate.console import PREFIX, auth, chart
from sandgate.console.approvals import ApprovalsPage
from sandgate.console.ring import MAX_LIMIT, Filter, tools
from sandgate.console.source import Source, SourceError, explain_args
from sandgate.errors import Code

log = logging.getLogger("sandgate.console")

ROWS = 200  # decisions shown (the ring keeps more; the filter narrows them)
MAX_FORM = 16 * 1024
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon"}
_PUBLIC = ("/login", "/static/")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def static_files() -> dict[str, tuple[bytes, str]]:
    """The vendored assets, read once from the package (NOTICE.md says what each is)."""
    out: dict[str, tuple[bytes, str]] = {}
    for entry in (resources.files("sandgate.console") / "static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if suffix in _TYPES:
            out[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return out


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("sandgate.console", "templates"),
                             autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["hms"] = lambda iso: str(iso or "")[11:19]
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=False, default=str)
    env.filters["tools"] = lambda ev: ", ".join(tools(ev))
    env.filters["qs"] = lambda d: urlencode(d)
    env.filters["ago"] = ago
    env.filters["until"] = until
    return env


def ago(ts: float) -> str:
    s = max(0, int(time.time() - float(ts)))
    return f"{s // 60}m {s % 60}s ago" if s >= 60 else f"{s}s ago"


def until(ts: float) -> str:
    s = int(float(ts) - time.time())
    if s <= 0:
        return "now"
    return f"in {s // 60}m {s % 60}s" if s >= 60 else f"in {s}s"


def _since(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + f"{m}m {s}s"


@dataclass
class Console:
    source: Source
    check: Authenticator  # the admin listener's users (--admin-users) and admin token
    sessions: auth.Sessions = field(default_factory=auth.Sessions)
    env: jinja2.Environment = field(default_factory=templates)
    assets: dict[str, tuple[bytes, str]] = field(default_factory=static_files)
    audit: Audit | None = None  # logins, failures, logouts, expiries (sandgate.admin.login)
    limit: FailureLimit = field(default_factory=FailureLimit)  # wrong tokens per source

    # ------------------------------------------------------------------ rendering

    def page(self, request: web.Request, name: str, status: int = 200,
             **context: Any) -> web.Response:
        session: auth.Session | None = request.get(auth.SESSION_KEY)
        user, role = auth.who(request) if session is not None else ("", "")
        text = self.env.get_template(name).render(
            user=user, role=role, csrf=session.csrf if session else "",
            can_decide=auth.can_decide(role) if session else False, **context)
        return web.Response(status=status, text=text, content_type="text/html",
                            charset="utf-8")

    def error(self, request: web.Request, status: int, title: str, reason: str) -> web.Response:
        return self.page(request, "error.html", status=status, title=title, reason=reason,
                         nav="")

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await self._guard(request, handler)
        except web.HTTPException as e:
            response = self.error(request, e.status, e.reason, e.reason)
        except SourceError as e:
            response = self.error(request, 503, "Unavailable", str(e))
        except Exception:  # a page that fails says so, with the same headers
            log.exception("sandgate: console: %s %s failed", request.method, request.path)
            response = self.error(request, 500, "Internal error", "the page could not be "
                                  "made; the proxy's log says why")
        for k, v in SECURITY_HEADERS.items():
            response.headers[k] = v
        return response

    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rel = request.path[len(PREFIX):]
        if rel.startswith(_PUBLIC):
            return await handler(request)
        session, expired = self.sessions.lookup(request.cookies.get(auth.COOKIE))
        if expired is not None:
            audit_login(self.audit, "expired", via="console", source=request.remote,
                        user=expired.user, role=expired.role)
        if session is None:
            if request.method in ("GET", "HEAD"):
                to = PREFIX + "/login"
                headers = {"Location": to}
                if request.headers.get("HX-Request"):
                    headers["HX-Redirect"] = to  # a poll after expiry: htmx goes to the login
                return web.Response(status=303, headers=headers)
            return self.error(request, 401, "Not logged in", "log in first")
        request[auth.SESSION_KEY] = session
        if request.method not in ("GET", "HEAD"):
            if not auth.same_origin(request):
                return self.error(request, 403, "Refused", "the request comes from another "
                                  "site (Origin / Sec-Fetch-Site)")
            form = await self._form(request)
            if not auth.csrf_ok(session, str(form.get("csrf", ""))):
                log.warning("sandgate: console: a %s %s without a valid CSRF token refused",
                            request.method, request.path)
                return self.error(request, 403, "Refused", "missing or wrong CSRF token: "
                                  "reload the page and try again")
        return await handler(request)

    async def _form(self, request: web.Request) -> Mapping[str, Any]:
        if (request.content_length or 0) > MAX_FORM:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_FORM,
                                                actual_size=request.content_length or 0)
        return await request.post()

    # ------------------------------------------------------------------ login

    async def login_form(self, request: web.Request, problem: str = "",
                         status: int = 200) -> web.Response:
        nonce, mac = self.sessions.login_nonce()
        response = self.page(request, "login.html", status=status, nav="", login=mac,
                             problem=problem)
        auth.set_cookie(response, request, auth.LOGIN_COOKIE, nonce, auth.LOGIN_TTL)
        return response

    async def login_get(self, request: web.Request) -> web.Response:
        return await self.login_form(request)

    async def login_post(self, request: web.Request) -> web.StreamResponse:
        if not auth.same_origin(request):
            return await self.login_form(request, "refused: the form came from another site",
                                         403)
        form = await self._form(request)
        if not self.sessions.login_ok(request.cookies.get(auth.LOGIN_COOKIE),
                                      str(form.get("login", ""))):
            return await self.login_form(request, "the login form expired: try again", 403)
        source = request.remote or "local"
        wait = self.limit.retry_after(source)
        if wait is not None:  # before the token is looked at: guessing stays bounded
            response = await self.login_form(request, "too many wrong tokens from your "
                                             f"address: try again in {wait} s", 429)
            response.headers["Retry-After"] = str(wait)
            return response
        found = auth.identify(str(form.get("token", "")), self.check)
        if found is None:
            log.warning("sandgate: console: a login with a wrong token from %s",
                        request.remote)
            audit_login(self.audit, "failed", via="console", source=source,
                        reason="a token of no user", failures=self.limit.failed(source))
            return await self.login_form(request, "wrong token", 401)
        user, role = found
        audit_login(self.audit, "login", via="console", source=source, user=user, role=role)
        cookie, _ = self.sessions.create(user, role)
        log.info("sandgate: console: %s logged in (role %s) from %s", user, role,
                 request.remote)
        response = web.Response(status=303, headers={"Location": PREFIX + "/"})
        auth.set_cookie(response, request, auth.COOKIE, cookie, int(self.sessions.ttl))
        auth.clear_cookie(response, request, auth.LOGIN_COOKIE)
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        gone = self.sessions.drop(request.cookies.get(auth.COOKIE))
        if gone is not None:
            audit_login(self.audit, "logout", via="console", source=request.remote,
                        user=gone.user, role=gone.role)
        response = web.Response(status=303, headers={"Location": PREFIX + "/login"})
        auth.clear_cookie(response, request, auth.COOKIE)
        return response

    # ------------------------------------------------------------------ pages

    async def overview(self, request: web.Request) -> web.Response:
        ov = await self.source.overview()
        events = await self.source.events(Filter(), MAX_LIMIT)
        counts: dict[str, int] = {}
        for ev in events:
            counts[str(ev.get("decision") or ev.get("event"))] = \
                counts.get(str(ev.get("decision") or ev.get("event")), 0) + 1
        refused = sum(sum(c.values()) for _, c in await self.source.refusals())
        pending = len(await self.source.approvals())
        return self.page(request, "overview.html", nav="overview", ov=ov, pending=pending,
                         policy=ov["policy"], workers=ov.get("workers"),
                         uptime=_since(time.time() - self.source.started),
                         started=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                               time.gmtime(self.source.started)),
                         counts=sorted(counts.items()), shown=len(events), refused=refused)

    async def _decisions(self, request: web.Request) -> tuple[Filter, list[dict[str, Any]]]:
        flt = Filter.from_query(request.query)
        return flt, await self.source.events(flt, ROWS)

    async def decisions(self, request: web.Request) -> web.Response:
        flt, events = await self._decisions(request)
        ov = await self.source.overview()
        return self.page(request, "decisions.html", nav="decisions", flt=flt,
                         query=flt.query(), events=events, rows=ROWS,
                         identities=sorted(ov["policy"].get("identities") or {}),
                         codes=[str(c) for c in Code])

    async def decision_rows(self, request: web.Request) -> web.Response:
        flt, events = await self._decisions(request)
        return self.page(request, "_rows.html", query=flt.query(), events=events)

    async def decision(self, request: web.Request) -> web.Response:
        ev = await self.source.event(request.match_info["id"])
        if ev is None:
            return self.error(request, 404, "Not found", "no such decision in the recent "
                              "ones this console keeps")
        args = explain_args(ev)
        explanation: dict[str, Any] | None = None
        why = ""
        if isinstance(args, str):
            why = args
        else:
            status, explanation = await self.source.explain(args)
            if status != 200:
                why = str(explanation.get("reason") or f"explain answered {status}")
                explanation = None
        ov = await self.source.overview()
        return self.page(request, "decision.html", nav="decisions", ev=ev, args=args,
                         explanation=explanation, why=why,
                         now_version=ov["policy"].get("version"))

    async def refusals(self, request: web.Request) -> web.Response:
        c = chart.build(await self.source.refusals())
        return self.page(request, "refusals.html", nav="refusals", chart=c)

    async def refusals_chart(self, request: web.Request) -> web.Response:
        c = chart.build(await self.source.refusals())
        return self.page(request, "_chart.html", chart=c)

    async def reach(self, request: web.Request) -> web.Response:
        doc = await self.source.report()
        q = str(request.query.get("q", "")).strip()[:200]
        idents = doc.get("identities") or []
        if q:
            ql = q.lower()
            idents = [{**i, "rules": [r for r in i.get("rules") or []
                                      if ql in i["name"].lower()
                                      or any(ql in str(v).lower() for v in r.values())]}
                      for i in idents]
            idents = [i for i in idents if i["rules"]]
        base = str(doc.get("title") or "").rstrip("/") + "/"  # the policy directory
        idents = [{**i, "source": i.get("source", "").removeprefix(base),
                   "rules": [{**r, "source": str(r.get("source", "")).removeprefix(base)}
                             for r in i.get("rules") or []]} for i in idents]
        return self.page(request, "reach.html", nav="reach", doc=doc, identities=idents, q=q,
                         columns=("kind", "rule", "reach", "methods", "paths", "query",
                                  "secrets", "notes", "source"))

    async def spend(self, request: web.Request) -> web.Response:
        """The LLM budget windows open now: per budget and identity or sandbox, what the window
        has counted (settled and in flight) against each limit, and the settled spend per
        model."""
        windows = await self.source.spend()
        q = str(request.query.get("q", "")).strip()[:200]
        if q:
            ql = q.lower()
            windows = [w for w in windows if any(
                ql in str(w.get(k) or "").lower() for k in ("budget", "who", "identity"))
                or any(ql in m.lower() for m in w.get("models") or {})]
        rows = [_spend_row(w) for w in windows]
        return self.page(request, "spend.html", nav="spend", rows=rows, q=q)

    async def static(self, request: web.Request) -> web.Response:
        found = self.assets.get(request.match_info["name"])
        if found is None:
            return self.error(request, 404, "Not found", "no such file")
        body, ctype = found
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def root(self, _: web.Request) -> web.Response:
        return web.Response(status=303, headers={"Location": PREFIX + "/"})

    # ------------------------------------------------------------------ the app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware], client_max_size=MAX_FORM)
        r = app.router
        r.add_get("/", self.overview)
        r.add_get("/login", self.login_get)
        r.add_post("/login", self.login_post)
        r.add_post("/logout", self.logout)
        r.add_get("/decisions", self.decisions)
        r.add_get("/decisions/rows", self.decision_rows)
        r.add_get("/decisions/{id}", self.decision)
        r.add_get("/refusals", self.refusals)
        r.add_get("/refusals/chart", self.refusals_chart)
        r.add_get("/reach", self.reach)
        r.add_get("/spend", self.spend)
        r.add_get("/static/{name}", self.static)
        return app


def mount(app: web.Application, source: Source, admin_token: str,
          users: tuple[AdminUser, ...] = (), *, audit: Audit | None = None,
          limit: FailureLimit | None = None) -> Console:
    """Serve the console under /console/ of an admin listener's app. `audit` gets its
    logins (sandgate.admin.login); `limit` is the listener's bound on wrong tokens."""
    console = Console(source, Authenticator(admin_token, users), audit=audit,
                      limit=limit if limit is not None else FailureLimit())
    sub = console.app()
    ApprovalsPage(console).add_routes(sub)
    app.router.add_get(PREFIX, console.root)
    app.add_subapp(PREFIX + "/", sub)
    return console


_KINDS = (("input_tokens", "input tokens"), ("output_tokens", "output tokens"),
          ("cost_usd", "cost USD"))


def _spend_row(w: Mapping[str, Any]) -> dict[str, Any]:
    """One budget window as the spend page shows it: per kind the limit, what the window has
    counted (settled and in flight), what is in flight, and the share of the limit."""
    limits, used, reserved = (w.get(k) or {} for k in ("limits", "used", "reserved"))
    kinds = []
    for key, label in _KINDS:
        lim, u, r = limits.get(key), used.get(key) or 0, reserved.get(key) or 0
        kinds.append({"kind": label, "limit": "-" if lim is None else _amount(key, lim),
                      "used": _amount(key, u), "reserved": _amount(key, r),
                      "share": "" if not lim else f"{min(999, round(100 * u / lim))}%",
                      "limited": lim is not None})
    models = [{"model": m, **{k: _amount(k, a.get(k) or 0) for k, _ in _KINDS}}
              for m, a in sorted((w.get("models") or {}).items())]
    ends = float(w.get("ends_in") or 0)
    return {"budget": w.get("budget"), "scope": w.get("scope"), "who": w.get("who"),
            "identity": w.get("identity"), "per": _since(float(w.get("per") or 0)),
            "ends_in": _since(ends), "kinds": kinds, "models": models,
            "where": "fleet" if w.get("shared") else (
                f"worker {w['worker']}" if w.get("worker") else "this process")}


def _amount(key: str, value: Any) -> str:
    if key == "cost_usd":
        return f"{float(value):.6f}".rstrip("0").rstrip(".") or "0"
    return str(int(value))
