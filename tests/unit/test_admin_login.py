"""Logins to the admin listener: the console's logins, failures, logouts and expired sessions
and wrong admin API tokens are audited (never the token), wrong tokens are bounded per source
(sandgate.admin.login), and the user and role are typed request keys (no aiohttp warning)."""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sandgate.admin.access import ROLE_KEY, USER_KEY, AdminUser, auth_middleware, token_digest
from sandgate.admin.listener import build_app
from sandgate.admin.login import FailureLimit
from sandgate.admin.process import AdminState
from sandgate.audit.events import AuditLog
from sandgate.audit.ocsf import to_ocsf
from sandgate.console.app import Console, mount
from sandgate.console.ring import EventRing
from sandgate.console.source import LocalSource
from sandgate.metrics import Metrics
from sandgate.policy import live

pytestmark = pytest.mark.unit

ADMIN_TOKEN = "zq-admin-fake-71"
ALICE_TOKEN = "zq-alice-fake-72"
WRONG = "zq-wrong-fake-73"
POLICY = "version: v1\nidentities:\n  agent:\n    rules:\n      - name: docs\n" \
         "        hosts: [docs.example.com]\n"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _listener(tmp_path: Path, limit: FailureLimit | None = None
                    ) -> tuple[TestClient[Any, Any], io.StringIO, Console]:
    d = tmp_path / "policies"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    lp = live.LivePolicy(d, live.load(d))
    out = io.StringIO()
    sink = AuditLog(out)
    ring = EventRing()
    state = AdminState(live=lp, broker=None,  # type: ignore[arg-type]
                       metrics=Metrics(lambda: lp.policy), token_key=b"k" * 32,
                       admin_token=ADMIN_TOKEN, listener_up=lambda: True,
                       draining=lambda: False, recent=ring, audit=sink.emit,
                       users=(AdminUser("alice", "approver", token_digest(ALICE_TOKEN)),))
    if limit is not None:
        state.login_limit = limit
    app = build_app(state)  # as start_admin does
    console = mount(app, LocalSource(state, ring), state.admin_token, state.users,
                    audit=state.audit, limit=state.login_limit)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, out, console


def _events(out: io.StringIO) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, out.getvalue().splitlines())
            if e["event"] == "admin_login"]


async def _post_login(c: TestClient[Any, Any], token: str) -> Any:
    page = await (await c.get("/console/login")).text()
    mac = re.search(r'name="login" value="([^"]+)"', page)
    assert mac
    return await c.post("/console/login", data={"login": mac.group(1), "token": token},
                        allow_redirects=False)


def _no_token_in(out: io.StringIO, *tokens: str) -> None:
    text = out.getvalue()
    for t in tokens:
        for n in range(6, len(t) + 1):  # nor any prefix a guesser could learn from
            assert t[:n] not in text, "a token (or a prefix of it) in the audit log"


async def test_console_login_failure_logout_and_expiry_are_audited(tmp_path):
    c, out, console = await _listener(tmp_path)
    try:
        r = await _post_login(c, WRONG)
        assert r.status == 401
        r = await _post_login(c, ALICE_TOKEN)
        assert r.status == 303
        page = await (await c.get("/console/")).text()
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf
        r = await c.post("/console/logout", data={"csrf": csrf.group(1)},
                         allow_redirects=False)
        assert r.status == 303
        # a session used after it expired
        assert (await _post_login(c, ADMIN_TOKEN)).status == 303
        console.sessions.clock = lambda: 9e18  # every session has expired
        r = await c.get("/console/", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/console/login"
        r = await c.get("/console/", allow_redirects=False)  # audited once, not on every use
    finally:
        await c.close()
    got = [(e["action"], e["via"], e.get("user"), e.get("role"), e["outcome"])
           for e in _events(out)]
    assert got == [("failed", "console", None, None, "failed"),
                   ("login", "console", "alice", "approver", "ok"),
                   ("logout", "console", "alice", "approver", "ok"),
                   ("login", "console", "admin", "admin", "ok"),
                   ("expired", "console", "admin", "admin", "ok")]
    assert all(e["source"] == "127.0.0.1" for e in _events(out))
    _no_token_in(out, WRONG, ALICE_TOKEN, ADMIN_TOKEN)
    ocsf = [to_ocsf(e) for e in _events(out)]  # (each also validated by the conftest)
    assert [(o["class_uid"], o["activity_name"], o.get("status")) for o in ocsf] == [
        (3002, "Logon", "Failure"), (3002, "Logon", "Success"), (3002, "Logoff", "Success"),
        (3002, "Logon", "Success"), (3002, "Logoff", "Success")]
    assert ocsf[1]["user"] == {"name": "alice", "groups": [{"name": "approver"}]}
    assert ocsf[1]["src_endpoint"]["ip"] == "127.0.0.1"


async def test_a_wrong_admin_api_token_is_audited_without_the_token(tmp_path):
    c, out, _ = await _listener(tmp_path)
    try:
        r = await c.get("/v1/policy", headers={"Authorization": f"Bearer {WRONG}"})
        assert r.status == 401
        assert (await c.get("/v1/policy")).status == 401  # no token given: nothing to audit
        r = await c.get("/v1/policy", headers={"Authorization": f"Bearer {ALICE_TOKEN}"})
        assert r.status == 200
    finally:
        await c.close()
    events = _events(out)
    assert [(e["action"], e["via"], e["source"], e["failures"]) for e in events] == [
        ("failed", "admin_api", "127.0.0.1", 1)]
    _no_token_in(out, WRONG, ALICE_TOKEN, ADMIN_TOKEN)


async def test_the_sixth_wrong_login_is_refused_even_with_the_right_token(tmp_path):
    clock = Clock()
    limit = FailureLimit(clock=clock)
    c, out, _ = await _listener(tmp_path, limit)
    try:
        for _ in range(5):
            assert (await _post_login(c, WRONG)).status == 401
        r = await _post_login(c, ADMIN_TOKEN)  # right, but the 6th try within the minute
        assert r.status == 429 and "auth" not in {k.lower() for k in r.cookies}
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert "too many wrong tokens" in await r.text()
        # the same bound holds at the admin API (one budget per source for both doors)
        r = await c.get("/v1/policy", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status == 429 and r.headers["Retry-After"]
        assert (await r.json())["error"] == "too_many_failures"
        # another source is not held back, and its success frees nobody
        assert limit.retry_after("192.0.2.7") is None
        clock.t += 61  # the failures leave the window
        assert (await _post_login(c, ADMIN_TOKEN)).status == 303
    finally:
        await c.close()
    assert [e["action"] for e in _events(out)] == ["failed"] * 5 + ["login"]


def test_the_limit_per_source_and_overall_with_bounded_memory():
    clock = Clock()
    lim = FailureLimit(per_source=5, overall=12, window=60, max_sources=3, clock=clock)
    for i in range(5):
        assert lim.retry_after("a") is None
        assert lim.failed("a") == i + 1
    assert lim.retry_after("a") == 60
    assert lim.retry_after("b") is None  # per source
    clock.t += 30
    assert lim.failed("b") == 1 and lim.retry_after("a") == 30
    assert lim.retry_after("b") is None  # a's failures do not count against b
    for s in ("c", "d", "e", "f"):
        lim.failed(s)
    assert lim.sources() <= 3  # the longest-quiet sources are forgotten first
    assert lim.retry_after("a") is None  # forgotten ...
    for s in ("g", "h"):
        lim.failed(s)  # ... but the overall count (12 in the window) holds for everyone
    assert lim.retry_after("z") is not None
    clock.t += 61
    assert lim.retry_after("z") is None and lim.sources() == 0  # stale entries go


async def test_admin_user_and_role_are_typed_request_keys_without_a_warning():
    seen: dict[str, str] = {}

    async def handler(request: web.Request) -> web.Response:
        seen["user"], seen["role"] = request[USER_KEY], request[ROLE_KEY]
        return web.Response(text="ok")

    app = web.Application(middlewares=[auth_middleware(ADMIN_TOKEN, frozenset())])
    app.router.add_get("/x", handler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NotAppKeyWarning would fail the request
        async with TestClient(TestServer(app)) as c:
            r = await c.get("/x", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert r.status == 200, await r.text()
    assert seen == {"user": "admin", "role": "admin"}
    assert isinstance(USER_KEY, web.RequestKey) and isinstance(ROLE_KEY, web.RequestKey)
