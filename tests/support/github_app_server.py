"""A GitHub-App-shaped token endpoint on loopback TLS (aiohttp, in a thread): it verifies the
app's JWT with the app's PUBLIC key (PyJWT, RS256, issuer = app id, at most ten minutes),
mints installation tokens restricted as asked, revokes them on DELETE /installation/token, and
serves GET /repos/OWNER/REPO/contents/... only to a live token for that repository (answering
with the token it got: a reflecting upstream)."""

from __future__ import annotations

import datetime as dt
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import jwt
from aiohttp import web

from tests.support.aioserve import ThreadedApp


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"message": message}, status=status)


@dataclass
class Issued:
    token: str
    repositories: list[str] | None
    permissions: dict[str, str] | None
    revoked: bool = False


@dataclass
class GitHubApp:
    host: str
    port: int
    cert: str
    key: str
    app_id: int
    installation_id: int
    public_key: str  # PEM
    expires_in: int = 3600
    issued: list[Issued] = field(default_factory=list)
    rejected_jwts: int = 0
    served: int = 0
    # a leaky upstream: more for the contents answer to say (JSON), or a text/plain answer
    also: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    _server: ThreadedApp | None = None

    def _live(self, request: web.Request) -> Issued | None:
        auth = request.headers.get("authorization", "")
        scheme, _, tok = auth.partition(" ")
        if scheme.lower() not in ("token", "bearer"):
            return None
        return next((i for i in self.issued if i.token == tok and not i.revoked), None)

    async def _mint(self, request: web.Request) -> web.Response:
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            self.rejected_jwts += 1
            return _error("A JSON web token could not be decoded", 401)
        try:
            claims = jwt.decode(auth[7:], self.public_key, algorithms=["RS256"],
                                issuer=str(self.app_id), options={"require": ["iat", "exp",
                                                                             "iss"]})
        except jwt.PyJWTError:
            self.rejected_jwts += 1
            return _error("A JSON web token could not be decoded", 401)
        if claims["exp"] - claims["iat"] > 600:
            self.rejected_jwts += 1
            return _error("'Expiration time' claim is too far", 401)
        if int(request.match_info["id"]) != self.installation_id:
            return _error("Not Found", 404)
        body: dict[str, Any] = json.loads(await request.read() or b"{}")
        tok = f"test-installation-token-{secrets.token_hex(8)}"
        self.issued.append(Issued(tok, body.get("repositories"), body.get("permissions")))
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.expires_in)
        return web.json_response({"token": tok, "expires_at": expires.strftime(
            "%Y-%m-%dT%H:%M:%SZ"), "permissions": body.get("permissions") or {}}, status=201)

    async def _revoke(self, request: web.Request) -> web.Response:
        live = self._live(request)
        if live is None:
            return _error("Bad credentials", 401)
        live.revoked = True
        return web.Response(status=204)

    async def _contents(self, request: web.Request) -> web.Response:
        live = self._live(request)
        if live is None:
            return _error("Bad credentials", 401)
        repo = request.match_info["repo"]
        if live.repositories is not None and repo not in live.repositories:
            return _error("Not Found", 404)
        self.served += 1
        if self.text is not None:
            return web.Response(text=self.text, content_type="text/plain")
        return web.json_response({"token": live.token, "permissions": live.permissions,
                                  **self.also})

    def start(self) -> GitHubApp:
        app = web.Application()
        app.router.add_post("/app/installations/{id}/access_tokens", self._mint)
        app.router.add_delete("/installation/token", self._revoke)
        app.router.add_get("/repos/{owner}/{repo}/contents/{path:.*}", self._contents)
        self._server = ThreadedApp(app, self.host, self.port, self.cert, self.key)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
