"""The admin API's one route table (sandgate.admin.routes): both admin listeners, the single
process and the workers' front, mount every operation of it at the same method, path and role."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from sandgate.admin.access import required_role
from sandgate.admin.listener import build_app
from sandgate.admin.process import AdminState
from sandgate.admin.routes import ROUTES, mount
from sandgate.workers.admin_front import build_front

Mounted = dict[tuple[str, str], str]  # (method, path) -> the role it needs


def mounted(app: web.Application) -> Mounted:
    """Each route of the admin API in `app` (the console's pages left out), with its role."""
    out: Mounted = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if not path or not str(path).startswith(("/v1/", "/healthz", "/readyz", "/metrics")):
            continue
        if route.method == "HEAD":
            continue  # add_get's twin of each GET

        class Match:  # what the auth middleware reads: the handler of the matched route
            handler = route.handler

        class Request:
            match_info = Match()
            method = route.method

        out[(route.method, str(path))] = required_role(Request())  # type: ignore[arg-type]
    return out


def single_process(trust_forwarded: bool = False) -> web.Application:
    state = AdminState(live=None, broker=None, metrics=None,  # type: ignore[arg-type]
                       token_key=b"k" * 32, admin_token="tok", listener_up=lambda: True,
                       draining=lambda: False, trust_forwarded=trust_forwarded)
    return build_app(state)


class NoWorkers:
    n = 0
    workers: list[Any] = []


def front() -> web.Application:
    return build_front(NoWorkers(), "tok")  # type: ignore[arg-type]


def expected(*, grant: bool) -> Mounted:
    return {(r.method, r.path): r.role or ("viewer" if r.method == "GET" else "admin")
            for r in ROUTES if grant or r.op != "approval_grant"}


def test_the_single_process_mounts_the_table() -> None:
    assert mounted(single_process()) == expected(grant=False)


def test_a_workers_control_socket_adds_only_the_grant_copy() -> None:
    assert mounted(single_process(trust_forwarded=True)) == expected(grant=True)


def test_the_workers_front_mounts_the_same_table() -> None:
    assert mounted(front()) == mounted(single_process()) == expected(grant=False)


def test_roles_are_as_documented() -> None:
    roles = mounted(single_process())
    assert roles[("POST", "/v1/explain")] == "viewer"  # read-only: a viewer may ask
    assert roles[("POST", "/v1/approvals/{id}")] == "approver"
    assert roles[("POST", "/v1/tokens")] == roles[("POST", "/v1/reload")] == "admin"
    assert roles[("GET", "/v1/policy")] == "viewer"


def test_a_handler_for_no_route_is_refused() -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.Response()

    with pytest.raises(ValueError, match=r"no admin route for .*'tokenz'"):
        mount(web.Application(), {"tokenz": handler})


def test_one_handler_on_routes_of_two_roles_keeps_each_role() -> None:
    async def forward(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    mount(app, {"policy": forward, "explain": forward, "tokens": forward})
    roles = mounted(app)
    assert roles == {("GET", "/v1/policy"): "viewer", ("POST", "/v1/explain"): "viewer",
                     ("POST", "/v1/tokens"): "admin"}
