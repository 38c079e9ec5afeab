"""Run in the provider SDK venv (.venv-providers): a recipe's output through the SDK's real call.

    python provider_sdk_calls.py PROVIDER CASE API_HOST INPUT_JSON

Starts a local API server on API_HOST (a loopback address), points the SDK's API base URL at it,
calls the SDK's create function(s) with what sandgate.providers returns, and prints one JSON
object: {"requests": [{method, path, headers, body}], "error": "..."} — the requests the SDK
actually sent, as they left its HTTP (or gRPC) transport. The server answers what the SDK needs
to reach its create request and refuses that one, so no sandbox is ever "created".
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Responder = Callable[[str, str, Any], "tuple[int, Any]"]


class ApiServer:
    """A stand-in for a provider's REST API: records each request, answers via `respond`."""

    def __init__(self, host: str, respond: Responder) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                outer.requests.append({"method": self.command, "path": self.path,
                                       "headers": {k.lower(): v for k, v in self.headers.items()},
                                       "body": body})
                status, answer = respond(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


REFUSED = (400, {"code": 400, "message": "refused by the test server (no sandbox is created)"})


def access_from(inp: dict[str, Any]) -> Any:
    from sandgate.providers import SandgateAccess

    return SandgateAccess(**inp["access"])


# --- E2B -----------------------------------------------------------------------------------


def e2b(case: str, host: str, inp: dict[str, Any]) -> dict[str, Any]:
    from e2b import Sandbox, Template

    from sandgate.providers import e2b_sandbox_kwargs, e2b_template

    def respond(method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) == ("POST", "/v3/templates"):  # a template id, then its build request
            return 202, {"templateID": "tpl-test", "buildID": "bld-test", "public": False,
                         "names": ["sandgate-test"], "tags": [], "aliases": []}
        return REFUSED

    server = ApiServer(host, respond)
    opts = {"api_key": "e2b_" + "0" * 40, "api_url": server.url, "request_timeout": 10}
    error = None
    try:
        if case == "template":
            template = e2b_template(inp["access"]["ca_pem"], base_image=inp.get("base_image"))
            Template.build(template, "sandgate-test", **opts)
        else:
            kwargs = e2b_sandbox_kwargs(access_from(inp), template=inp.get("template"), mode=case,
                                        socks5_tls=inp.get("socks5_tls", False))
            Sandbox.create(**kwargs, **opts)
    except Exception as e:  # the refusal (or a validation error, which the test reports)
        error = f"{type(e).__name__}: {e}"
    return {"requests": server.requests, "error": error}


# --- Daytona -------------------------------------------------------------------------------


def daytona(case: str, host: str, inp: dict[str, Any]) -> dict[str, Any]:
    from daytona import Daytona, DaytonaConfig

    from sandgate.providers import daytona_create_params

    server = ApiServer(host, lambda method, path, body: REFUSED)
    client = Daytona(DaytonaConfig(api_key="dtn_test", api_url=server.url))
    error = None
    try:
        if case == "gateway":
            params = daytona_create_params(access_from(inp), gateway_url=inp["gateway_url"],
                                           gateway_base_urls=inp["gateway_base_urls"])
        elif case == "snapshot":
            params = daytona_create_params(access_from(inp), snapshot="sandgate-ca")
        else:
            params = daytona_create_params(access_from(inp), image=inp.get("base_image"))
        client.create(params, timeout=10)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"requests": server.requests, "error": error}


# --- Runloop -------------------------------------------------------------------------------


def runloop(case: str, host: str, inp: dict[str, Any]) -> dict[str, Any]:
    from runloop_api_client import Runloop

    from sandgate.providers import (
        runloop_blueprint_kwargs,
        runloop_devbox_kwargs,
        runloop_network_policy_kwargs,
    )

    def respond(method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) == ("POST", "/v1/network-policies"):  # the id the next calls name
            return 200, {"id": "np_test", "name": body["name"], "create_time_ms": 0,
                         "update_time_ms": 0, "egress": {"allow_all": False,
                                                         "allow_devbox_to_devbox": False,
                                                         "allowed_hostnames": []}}
        return REFUSED

    server = ApiServer(host, respond)
    client = Runloop(bearer_token="ak_test", base_url=server.url, max_retries=0, timeout=10)
    access = access_from(inp)
    errors = []
    policy = client.network_policies.create(
        **runloop_network_policy_kwargs(access, name="sandgate-egress"))
    for call in (
        lambda: client.blueprints.create(**runloop_blueprint_kwargs(
            access.ca_pem, name="sandgate-ca", network_policy_id=policy.id)),
        lambda: client.devboxes.create(**runloop_devbox_kwargs(
            access, blueprint_name="sandgate-ca", network_policy_id=policy.id)),
    ):
        try:
            call()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"requests": server.requests, "error": "; ".join(errors) or None}


# --- Modal ---------------------------------------------------------------------------------


def modal(case: str, host: str, inp: dict[str, Any]) -> dict[str, Any]:
    """Modal speaks gRPC: a grpclib server implementing Modal's own service definition
    (modal_proto) answers the calls before SandboxCreate and refuses that one."""
    import asyncio
    import os

    from google.protobuf.json_format import MessageToDict
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError
    from grpclib.server import Server
    from modal_proto import api_grpc, api_pb2

    requests: list[dict[str, Any]] = []
    answers: dict[str, dict[str, Any]] = {
        "AppGetOrCreate": {"app_id": "ap-test"},
        "AppCreate": {"app_id": "ap-test"},
        "ImageGetOrCreate": {"image_id": "im-test",
                             "result": {"status": api_pb2.GenericResult.GENERIC_STATUS_SUCCESS}},
        "SecretGetOrCreate": {"secret_id": "st-test"},
        "EnvironmentGetOrCreate": {"environment_id": "en-test",
                                   "metadata": {"name": "main", "settings": {
                                       "image_builder_version": "2025.06"}}},
    }

    # an unsigned JWT: the client only reads its expiry (modal/_utils/auth_token_manager.py)
    claims = base64.urlsafe_b64encode(json.dumps({"exp": 4102444800}).encode()).decode()
    answers["AuthTokenGet"] = {"token": f"eyJhbGciOiJub25lIn0.{claims.rstrip('=')}.x"}
    reply_types: dict[str, Any] = {}

    def handler(name: str) -> Any:
        async def handle(self: Any, stream: Any) -> None:
            request = await stream.recv_message()
            requests.append({"method": "RPC", "path": name,
                             "body": MessageToDict(request, preserving_proto_field_name=True)})
            if name not in answers and name not in ("ClientHello", "AppHeartbeat"):
                raise GRPCError(Status.INVALID_ARGUMENT, "refused by the test server")
            answer = answers.get(name, {})
            if name == "ImageGetOrCreate":  # one id per image layer: the test follows the chain
                answer = {**answer, "image_id": f"im-{len(requests) - 1}"}
            await stream.send_message(reply_types[name](**answer))
        return handle

    names = api_grpc.ModalClientBase.__abstractmethods__
    Service = type("Service", (api_grpc.ModalClientBase,), {n: handler(n) for n in names})
    service = Service()
    for path, h in service.__mapping__().items():
        reply_types[path.rsplit("/", 1)[1]] = h.reply_type

    async def run() -> str | None:
        server = Server([service])
        await server.start(host, 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # set before modal is imported: its config reads the environment
        os.environ.update(MODAL_SERVER_URL=f"http://{host}:{port}", MODAL_TOKEN_ID="ak-test",
                          MODAL_TOKEN_SECRET="as-test")
        import modal

        from sandgate.providers import modal_sandbox_kwargs

        error = None
        try:
            app = await modal.App.lookup.aio("sandgate-test", create_if_missing=True)
            await modal.Sandbox.create.aio(app=app, **modal_sandbox_kwargs(access_from(inp)))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        server.close()
        return error

    error = asyncio.run(run())
    return {"requests": requests, "error": error}


PROVIDERS = {"e2b": e2b, "daytona": daytona, "runloop": runloop, "modal": modal}


def main() -> None:
    provider, case, host, inp = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    print(json.dumps(PROVIDERS[provider](case, host, inp)))


if __name__ == "__main__":
    main()
