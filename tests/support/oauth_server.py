"""A real OAuth 2.0 authorization server and resource server for the tests: Authlib's server
components on Flask, TLS on loopback, run as a subprocess:

    python -m tests.support.oauth_server HOST PORT CERT KEY CLIENTS_JSON

CLIENTS_JSON: {"client_id": {"secret": ..., "refresh_token": ... (optional)}}. Tokens expire
after $OAUTH_EXPIRES_IN seconds (default 3600); a refresh issues a new refresh token and revokes
the old one (rotation). GET /me (a protected resource, Authlib's ResourceProtector) answers with
the bearer token it was given (a reflecting upstream); GET /stats counts the tokens issued.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from authlib.integrations.flask_oauth2 import AuthorizationServer, ResourceProtector
from authlib.oauth2.rfc6749 import ClientMixin, TokenMixin, grants
from authlib.oauth2.rfc6750 import BearerTokenValidator
from flask import Flask, jsonify, request

EXPIRES_IN = int(os.environ.get("OAUTH_EXPIRES_IN", "3600"))


@dataclass
class Client(ClientMixin):  # type: ignore[misc]
    client_id: str
    secret: str

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str:
        return ""

    def get_allowed_scope(self, scope: str) -> str:
        return scope or ""

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return False

    def check_client_secret(self, client_secret: str) -> bool:
        return secrets.compare_digest(client_secret, self.secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return method in ("client_secret_basic", "client_secret_post")

    def check_response_type(self, response_type: str) -> bool:
        return False

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type in ("client_credentials", "refresh_token")


@dataclass
class Token(TokenMixin):  # type: ignore[misc]
    client_id: str
    access_token: str
    refresh_token: str | None
    scope: str
    issued_at: float
    expires_in: int
    revoked: bool = False

    def check_client(self, client: Client) -> bool:
        return client.client_id == self.client_id

    def get_scope(self) -> str:
        return self.scope

    def get_expires_in(self) -> int:
        return self.expires_in

    def is_expired(self) -> bool:
        return time.time() >= self.issued_at + self.expires_in

    def is_revoked(self) -> bool:
        return self.revoked


@dataclass
class Store:
    clients: dict[str, Client] = field(default_factory=dict)
    tokens: list[Token] = field(default_factory=list)
    issued: dict[str, int] = field(default_factory=dict)  # client_id -> tokens issued
    served: dict[str, int] = field(default_factory=dict)  # /TAG/me -> requests served


STORE = Store()


def query_client(client_id: str) -> Client | None:
    return STORE.clients.get(client_id)


def save_token(token: dict[str, Any], req: Any) -> None:
    cid = req.client.client_id
    STORE.issued[cid] = STORE.issued.get(cid, 0) + 1
    STORE.tokens.append(Token(cid, token["access_token"], token.get("refresh_token"),
                              token.get("scope", ""), time.time(), token["expires_in"]))


class RefreshGrant(grants.RefreshTokenGrant):  # type: ignore[misc]
    INCLUDE_NEW_REFRESH_TOKEN = True  # rotation: every refresh issues a new refresh token
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]

    def authenticate_refresh_token(self, refresh_token: str) -> Token | None:
        for t in STORE.tokens:
            if t.refresh_token == refresh_token and not t.revoked:
                return t
        return None

    def authenticate_user(self, credential: Token) -> str:
        return credential.client_id

    def revoke_old_credential(self, credential: Token) -> None:
        credential.revoked = True


class ClientCredentials(grants.ClientCredentialsGrant):  # type: ignore[misc]
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic", "client_secret_post"]


class Validator(BearerTokenValidator):  # type: ignore[misc]
    def authenticate_token(self, token_string: str) -> Token | None:
        for t in STORE.tokens:
            if t.access_token == token_string:
                return t
        return None


def make_app(clients: dict[str, dict[str, str]]) -> Flask:
    app = Flask(__name__)
    app.config["OAUTH2_TOKEN_EXPIRES_IN"] = {"client_credentials": EXPIRES_IN,
                                             "refresh_token": EXPIRES_IN}
    app.config["OAUTH2_REFRESH_TOKEN_GENERATOR"] = True  # refresh tokens issued (and rotated)
    server = AuthorizationServer(app, query_client=query_client, save_token=save_token)
    server.register_grant(ClientCredentials)
    server.register_grant(RefreshGrant)
    for cid, c in clients.items():
        STORE.clients[cid] = Client(cid, c["secret"])
        if c.get("refresh_token"):  # a refresh token issued earlier (the grant a user made)
            STORE.tokens.append(Token(cid, secrets.token_urlsafe(16), c["refresh_token"], "",
                                      time.time() - 2 * EXPIRES_IN, EXPIRES_IN))
    require = ResourceProtector()
    require.register_token_validator(Validator())

    @app.post("/oauth/token")
    def issue() -> Any:
        return server.create_token_response()

    @app.get("/<tag>/me")
    @require()
    def me(tag: str) -> Any:  # reflects the token it got: the proxy must scrub it
        STORE.served[tag] = STORE.served.get(tag, 0) + 1
        return jsonify({"token": request.headers.get("authorization", "")[7:]})

    @app.get("/stats")
    def stats() -> Any:  # for the tests: what was issued and served, and the tokens
        return jsonify({"issued": STORE.issued, "served": STORE.served,
                        "tokens": [t.access_token for t in STORE.tokens]})

    return app


if __name__ == "__main__":
    host, port, cert, key, clients = sys.argv[1:6]
    os.environ.setdefault("AUTHLIB_INSECURE_TRANSPORT", "0")
    make_app(json.loads(clients)).run(host, int(port), ssl_context=(cert, key), threaded=True)
