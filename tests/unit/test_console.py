"""The web console without a proxy: the ring of recent decisions, sessions and CSRF, the
refusals chart, the explain arguments of an event, and the pages of a real console app over a
real loaded policy (aiohttp's test server; the browser tests are tests/integration)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from hypothesis import given
from hypothesis import strategies as st

from sandgate.admin.access import AdminUser, Authenticator, token_digest
from sandgate.admin.listener import build_app
from sandgate.admin.process import AdminState
from sandgate.approvals.votes import VoteError
from sandgate.audit.events import AuditLog
from sandgate.console import auth, chart
from sandgate.console.app import CSP, mount
from sandgate.console.approvals import vote_from_form
from sandgate.console.ring import (
    BUCKET_SECONDS,
    EventRing,
    Filter,
    attach,
    is_refusal,
    merge_events,
    merge_refusals,
)
from sandgate.console.source import LocalSource, explain_args
from sandgate.explain.answer import explain_name, explain_request
from sandgate.metrics import Metrics
from sandgate.policy import live

pytestmark = pytest.mark.unit

POLICY = """version: v1
identities:
  agent:
    rules:
      - name: docs
        hosts: [docs.example.com]
        methods: [GET]
      - name: no-admin
        action: deny
        hosts: [docs.example.com]
        paths: [/admin/**]
  tools:
    rules:
      - name: mcp
        hosts: [mcp.example.com]
        methods: [POST]
"""


def _ev(**kw: Any) -> dict[str, Any]:
    base = {"identity": "agent", "sandbox": None, "method": "GET", "scheme": "https",
            "host": "docs.example.com", "port": 443, "path": "/a", "rule": "docs",
            "decision": "allow", "code": None, "reason": "allowed"}
    return {**base, **kw}


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ the ring


def test_ring_keeps_the_newest_decisions_only():
    ring = EventRing(capacity=3, prefix="w1-")
    for i in range(5):
        ring.on_audit("request", _ev(path=f"/{i}"))
    ring.on_audit("policy", {"outcome": "ok"})  # not a decision
    ring.on_audit("lease", {"action": "mint"})
    got = ring.events()
    assert [e["path"] for e in got] == ["/4", "/3", "/2"]
    assert [e["id"] for e in got] == ["w1-5", "w1-4", "w1-3"]
    assert ring.get("w1-3")["path"] == "/2" and ring.get("w1-1") is None
    assert ring.events(limit=1)[0]["path"] == "/4"


def test_ring_copies_what_it_keeps():
    ring = EventRing()
    secrets = ["anthropic@1"]
    ring.on_audit("request", _ev(secrets=secrets))
    secrets.append("changed-later@2")
    assert ring.events()[0]["secrets"] == ["anthropic@1"]
    import ipaddress

    from sandgate.errors import Code

    rpc = [{"method": "tools/call", "tool": "t"}]
    ring.on_audit("request", _ev(code=Code.NO_RULE, dialed=ipaddress.ip_address("10.0.0.1"),
                                 rpc=rpc, redactions=("a", "b")))
    rpc[0]["tool"] = "changed"
    ev = ring.events()[0]
    assert type(ev["code"]) is str and ev["code"] == "no_rule"
    assert ev["dialed"] == "10.0.0.1" and ev["redactions"] == ["a", "b"]
    assert ev["rpc"] == [{"method": "tools/call", "tool": "t"}]


def test_filters():
    ring = EventRing()
    ring.on_audit("request", _ev(identity="agent", sandbox="sb-1", host="api.github.com"))
    ring.on_audit("request", _ev(identity="tools", host="mcp.example.com", decision="deny",
                                 code="no_rule",
                                 rpc=[{"kind": "request", "method": "tools/call",
                                       "tool": "create_issue", "decision": "deny"}]))
    ring.on_audit("connect", _ev(identity="agent", host="docs.example.com", method="CONNECT"))
    paths = lambda **q: [e["host"] for e in ring.events(Filter.from_query(q))]  # noqa: E731
    assert paths(identity="agent") == ["docs.example.com", "api.github.com"]
    assert paths(sandbox="sb-1") == ["api.github.com"]
    assert paths(code="no_rule") == ["mcp.example.com"]
    assert paths(host="GITHUB") == ["api.github.com"]  # a substring, any case
    assert paths(tool="issue") == ["mcp.example.com"]
    assert paths(decision="deny") == ["mcp.example.com"]
    assert paths(identity="agent", code="no_rule") == []
    assert Filter.from_query({"identity": " agent ", "x": "y"}).query() == {"identity": "agent"}


def test_refusals_are_counted_once_per_request_in_bounded_buckets():
    clock = Clock()
    ring = EventRing(buckets=4, clock=clock)
    deny = _ev(decision="deny", code="no_rule")
    ring.on_audit("request", deny)
    ring.on_audit("connect", deny)  # the tunnel's refusal answers the request: counted there
    ring.on_audit("request", _ev(decision="report", code="no_rule"))  # forwarded
    ring.on_audit("request", _ev())
    ring.on_audit("limit", {"code": "too_many_connections", "reason": "x", "client": "c"})
    ring.on_audit("websocket", _ev(decision="deny", code="exfiltration"))
    ring.on_audit("dns", {"identity": "agent", "host": "x.test", "decision": "deny",
                          "code": "no_rule"})
    assert [c for _, c in ring.refusals()] == [
        {"no_rule": 2, "too_many_connections": 1, "exfiltration": 1}]
    for _ in range(6):
        clock.t += BUCKET_SECONDS
        ring.on_audit("request", deny)
    assert len(ring.refusals()) == 4  # the oldest buckets are gone
    assert is_refusal("request", deny) and not is_refusal("connect", deny)


def test_merge_events_and_refusals():
    a = [{"id": "w0-2", "ts": 5.0}, {"id": "w0-1", "ts": 1.0}]
    b = [{"id": "w1-1", "ts": 3.0}]
    assert [e["id"] for e in merge_events([a, b])] == ["w0-2", "w1-1", "w0-1"]
    assert [e["id"] for e in merge_events([a, b], limit=2)] == ["w0-2", "w1-1"]
    assert merge_refusals([[(30, {"no_rule": 1})], [(15, {"x": 2}), (30, {"no_rule": 2})]]) == \
        [(15, {"x": 2}), (30, {"no_rule": 3})]


def test_attach_feeds_from_the_audit_log(tmp_path):
    with AuditLog(tmp_path / "audit.jsonl") as log:
        ring = attach(log, 2, lambda: "v1")
        log.emit("request", **_ev())
    (ev,) = ring.events()
    assert ev["id"] == "w2-1" and ev["policy_version"] == "v1" and ev["event"] == "request"
    assert ev["time"].endswith("Z")


# ------------------------------------------------------------------ sessions and CSRF


def test_sessions_are_macd_expire_and_are_bounded():
    clock = Clock(100.0)
    s = auth.Sessions(ttl=60, clock=clock)
    cookie, sess = s.create("admin", "admin")
    assert s.find(cookie) is sess
    sid, _, mac = cookie.partition(".")
    assert s.find(sid) is None and s.find(f"{sid}.{'0' * len(mac)}") is None
    assert s.find(f"{sid}x.{mac}") is None and s.find("") is None and s.find(None) is None
    assert auth.Sessions().find(cookie) is None  # another process's key
    clock.t += 61
    assert s.find(cookie) is None
    cookie, _ = s.create("admin", "viewer")
    s.drop(cookie)
    assert s.find(cookie) is None
    first, _ = s.create("a", "viewer")
    for _ in range(auth.MAX_SESSIONS):
        s.create("b", "viewer")
    assert s.find(first) is None  # the oldest went first
    with pytest.raises(ValueError, match="unknown role"):
        s.create("a", "root")


def test_login_nonce_and_csrf_tokens():
    clock = Clock(100.0)
    s = auth.Sessions(clock=clock)
    nonce, mac = s.login_nonce()
    assert s.login_ok(nonce, mac) and not s.login_ok(nonce, mac + "0")
    assert not s.login_ok(None, mac) and not s.login_ok(nonce + "x", mac)
    clock.t += auth.LOGIN_TTL + 1
    assert not s.login_ok(nonce, mac)
    _, sess = s.create("admin", "admin")
    assert auth.csrf_ok(sess, sess.csrf) and not auth.csrf_ok(sess, "") \
        and not auth.csrf_ok(sess, sess.csrf[:-1])


@pytest.mark.parametrize(("headers", "ok"), [
    ({}, True),  # neither: the CSRF token decides
    ({"Origin": "http://console.test:9"}, True),
    ({"Origin": "http://evil.test:9"}, False),
    ({"Origin": "https://console.test:9"}, False),
    ({"Sec-Fetch-Site": "same-origin"}, True),
    ({"Sec-Fetch-Site": "none"}, True),
    ({"Sec-Fetch-Site": "same-site"}, False),
    ({"Sec-Fetch-Site": "cross-site", "Origin": "http://console.test:9"}, False),
    ({"Origin": "null", "Sec-Fetch-Site": "same-origin"}, True),  # no-referrer form POSTs
    ({"Origin": "null"}, False),
])
def test_same_origin(headers, ok):
    req = make_mocked_request("POST", "/console/logout",
                              headers={"Host": "console.test:9", **headers})
    assert auth.same_origin(req) is ok


def test_who_and_roles():
    req = make_mocked_request("GET", "/console/")
    assert auth.who(req) == ("", "")  # no session, no user: a role that may do nothing
    assert not auth.can_decide("")
    _, session = auth.Sessions().create("ana", "viewer")
    req[auth.SESSION_KEY] = session
    assert auth.who(req) == ("ana", "viewer")
    assert not auth.can_decide("viewer") and auth.can_decide("approver") \
        and auth.can_decide("admin")
    check = Authenticator("tok", (AdminUser("ana", "viewer", token_digest("ana-tok")),))
    assert auth.identify("tok", check) == ("admin", "admin")
    assert auth.identify("ana-tok", check) == ("ana", "viewer")
    assert auth.identify("tok2", check) is None and auth.identify("", check) is None


# ------------------------------------------------------------------ the chart


def test_chart_stacks_refusals_by_code_in_their_slots():
    now = 1_700_000_000.0
    last = int(now // BUCKET_SECONDS) * BUCKET_SECONDS
    series = [(last - 10 * BUCKET_SECONDS, {"no_rule": 3, "denied_by_rule": 1}),
              (last, {"no_rule": 1}),
              (last - 10_000 * BUCKET_SECONDS, {"rate_limited": 50})]  # too old: not shown
    c = chart.build(series, now=now)
    assert c.total == 5 and [(code, n) for code, _, n in c.legend] == \
        [("no_rule", 4), ("denied_by_rule", 1)]
    first, second = [b for b in c.bars if b.code == "no_rule"]
    assert first.x < second.x and second.x > c.plot[0] + c.plot[2] * 0.99
    stack = [b for b in c.bars if b.x == first.x]
    assert sum(b.h for b in stack) == pytest.approx(4 * c.plot[3] / c.yticks[-1][1])
    assert chart.colour("no_rule") == chart.colour("no_rule") != chart.colour("denied_by_rule")
    assert chart.build([], now=now).bars == []


@given(st.lists(st.tuples(st.integers(0, 300), st.dictionaries(
    st.sampled_from(["no_rule", "rate_limited", "x"]), st.integers(1, 10_000), min_size=1)),
    max_size=30))
def test_chart_bars_stay_inside_the_plot(buckets):
    now = 1_700_000_000.0
    last = int(now // BUCKET_SECONDS) * BUCKET_SECONDS
    c = chart.build([(last - k * BUCKET_SECONDS, counts) for k, counts in buckets], now=now)
    px, py, pw, ph = c.plot
    for b in c.bars:
        assert px <= b.x and b.x + b.w <= px + pw + 1
        assert py - 0.02 <= b.y and b.y + b.h <= py + ph + 0.02  # rounded to 0.01


# ------------------------------------------------------------------ explain arguments


def test_explain_args_of_events():
    assert explain_args(_ev(path="/a?q=REDACTED", sandbox="sb-1")) == {
        "identity": "agent", "method": "GET", "url": "https://docs.example.com:443/a?q=REDACTED",
        "sandbox": "sb-1"}
    assert explain_args(_ev(method="CONNECT", path=None))["url"] == "docs.example.com:443"
    assert explain_args(_ev(host="::1", port=8443))["url"] == "https://[::1]:8443/a"
    gw = explain_args(_ev(gateway="/anthropic", path="/v1/messages"))
    assert gw["gateway"] is True and gw["url"] == "/anthropic/v1/messages"
    call = explain_args(_ev(rpc=[{"method": "tools/call", "tool": "search"},
                                 {"method": "tools/call", "tool": "other"}]))
    assert call["mcp_tool"] == "search"
    assert explain_args(_ev(rpc=[{"method": "ping"}]))["rpc_method"] == "ping"
    ws = explain_args({**_ev(rpc=[{"method": "eth_call"}]), "event": "websocket"})
    assert ws["websocket"] is True and ws["rpc_method"] == "eth_call"
    assert explain_args(_ev(code="upgrade_refused"))["websocket"] is True
    assert "websocket" not in explain_args(_ev())
    assert explain_args({"event": "dns", "identity": "agent", "host": "docs.example.com",
                         "qtype": "AAAA", "decision": "allow"}) == \
        {"identity": "agent", "dns": "docs.example.com", "type": "AAAA"}
    assert "no identity" in explain_args(_ev(identity=None, reason="no token"))
    assert "records no request" in explain_args({"identity": "agent", "code": "x"})


# ------------------------------------------------------------------ the app


class FakeApproval:
    def __init__(self, **kw: Any) -> None:
        self.d = {"id": "ap_1", "identity": "agent", "sandbox": "sb-1", "method": "POST",
                  "url": "https://docs.example.com/x", "host": "docs.example.com",
                  "tool": None, "rule": "r", "rule_source": "p.yaml:3", "body_sha256": "ab" * 32,
                  "body_size": 2, "headers_sha256": "cd" * 32,
                  "headers": [["x-target-env", "<production>"],
                              ["authorization", "Bearer [PLACEHOLDER:gh]"]],
                  "headers_injected": ["x-api-key"],
                  "created": 0.0, "expires": 9e9, "mode": "hold",
                  "require_approvers": 1, "approvers": None,
                  "remember": ["request", "sandbox"], "max_remember_ttl": 3600,
                  "reason": "<b>why</b>", "state": "pending", "votes": [], "scope": None,
                  "approved_by": [], **kw}

    def as_dict(self) -> dict[str, Any]:
        return dict(self.d)


class FakeApprovals:
    """What the console asks of sandgate.approvals.service.Approvals."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def pending(self) -> list[FakeApproval]:
        return [FakeApproval()]

    async def get(self, approval_id: str) -> FakeApproval | None:
        return FakeApproval(state="approved") if approval_id == "ap_1" else None

    async def decide(self, approval_id: str, user: str, verdict: str, scope: object,
                     note: str | None) -> FakeApproval:
        self.calls.append((approval_id, user, verdict, scope, note))
        if approval_id != "ap_1":
            raise VoteError(404, "not_found", f"no approval {approval_id}")
        return FakeApproval(state="approved")


async def _console(tmp_path: Path) -> tuple[TestClient[Any, Any], EventRing, AdminState]:
    d = tmp_path / "policies"
    d.mkdir()
    (d / "p.yaml").write_text(POLICY)
    lp = live.LivePolicy(d, live.load(d))
    ring = EventRing()
    state = AdminState(live=lp, broker=None,  # type: ignore[arg-type]
                       metrics=Metrics(lambda: lp.policy), token_key=b"k" * 32,
                       admin_token="tok", listener_up=lambda: True, draining=lambda: False,
                       recent=ring, approvals=FakeApprovals())  # type: ignore[arg-type]
    app = build_app(state)
    mount(app, LocalSource(state, ring), "tok",
          (AdminUser("vic", "viewer", token_digest("vic-tok")),
           AdminUser("alice", "approver", token_digest("alice-tok"))))
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, ring, state


async def _login(c: TestClient[Any, Any], token: str = "tok") -> str:
    page = await (await c.get("/console/login")).text()
    mac = re.search(r'name="login" value="([^"]+)"', page)
    assert mac
    r = await c.post("/console/login", data={"login": mac.group(1), "token": token},
                     allow_redirects=False)
    assert r.status == 303 and r.headers["Location"] == "/console/"
    page = await (await c.get("/console/")).text()
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m
    return m.group(1)


async def test_pages_escape_what_sandboxes_send_and_explain_with_the_decision_function(
        tmp_path):
    c, ring, state = await _console(tmp_path)
    try:
        await _login(c)
        evil = "/a/<script>alert(1)</script>?x=\"><img src=x onerror=alert(2)>"
        ring.on_audit("request", _ev(path=evil, host="docs.example.com"))
        ring.on_audit("request", _ev(path="/admin/x", rule="no-admin", decision="deny",
                                     code="denied_by_rule"))
        for path in ("/console/decisions", "/console/decisions/rows", "/console/decisions/1"):
            r = await c.get(path)
            text = await r.text()
            assert r.status == 200, text
            assert "<script>alert" not in text and "<img src=x" not in text
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        page = await (await c.get("/console/decisions/2")).text()
        out, _ = explain_request(state.live.policy, "agent", "GET",
                                 "https://docs.example.com:443/admin/x")
        assert out["rule"] == "no-admin" and out["code"] == "denied_by_rule"
        assert f"<tr><th>rule</th><td>{out['rule']}</td></tr>" in page
        assert out["reason"].replace("'", "&#39;") in page
        ring.on_audit("dns", {"identity": "agent", "host": "docs.example.com", "qtype": "A",
                              "decision": "allow", "rule": "docs", "rcode": "NOERROR"})
        page = await (await c.get("/console/decisions/3")).text()
        out, _ = explain_name(state.live.policy, "agent", "docs.example.com", "A")
        assert out["decision"] == "resolve"
        assert "<tr><th>decision</th><td>resolve</td></tr>" in page
        assert "the DNS lookup <code>A docs.example.com</code>" in page
        r = await c.get("/console/decisions/999")
        assert r.status == 404
        rows = await (await c.get("/console/decisions/rows?code=denied_by_rule")).text()
        assert rows.count('data-id="') == 1 and 'hx-get="/console/decisions/rows?code=' \
            'denied_by_rule"' in rows
    finally:
        await c.close()


async def test_pages_headers_and_roles(tmp_path):
    c, _ring, _ = await _console(tmp_path)
    try:
        r = await c.get("/console", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/console/"
        r = await c.get("/console/reach", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/console/login"
        r = await c.get("/console/decisions/rows", headers={"HX-Request": "true"},
                        allow_redirects=False)
        assert r.headers["HX-Redirect"] == "/console/login"  # an expired session's poll
        assert r.headers["Content-Security-Policy"] == CSP
        csrf = await _login(c)
        for path in ("/console/", "/console/decisions", "/console/refusals",
                     "/console/refusals/chart", "/console/reach", "/console/reach?q=admin",
                     "/console/static/htmx.min.js", "/console/static/console.css"):
            r = await c.get(path)
            assert r.status == 200, path
            assert r.headers["Content-Security-Policy"] == CSP
            assert r.headers["Cache-Control"] == "no-store"
        reach = await (await c.get("/console/reach?q=no-admin")).text()
        assert 'id="reach-agent"' in reach and 'id="reach-tools"' not in reach
        r = await c.get("/console/static/NOTICE.md")
        assert r.status == 404  # only the assets
        r = await c.get("/console/static/..%2f..%2fapp.py")
        assert r.status == 404
        assert (await c.post("/console/logout", data={})).status == 403
        r = await c.post("/console/logout", data={"csrf": csrf}, allow_redirects=False)
        assert r.status == 303
        assert (await c.get("/console/", allow_redirects=False)).status == 303
        # the admin API keeps its token check
        assert (await c.get("/v1/policy")).status == 401
    finally:
        await c.close()


def test_every_template_and_asset_is_package_data():
    """The wheel carries what the console serves: pyproject's package-data globs cover every
    file of templates/ and static/."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["sandgate.console"]
    pkg = root / "proxy" / "sandgate" / "console"
    files = [p.relative_to(pkg).as_posix() for d in ("templates", "static")
             for p in (pkg / d).iterdir() if p.is_file()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), files


def test_vote_from_form():
    assert vote_from_form({"decision": "deny", "scope": "identity", "ttl": "5"}) == \
        {"decision": "deny"}  # a deny takes no scope
    assert vote_from_form({"decision": "approve"}) == \
        {"decision": "approve", "scope": {"kind": "request"}}
    assert vote_from_form({"decision": "approve", "scope": "sandbox", "ttl": "600",
                           "note": " ok "}) == \
        {"decision": "approve", "scope": {"kind": "sandbox", "ttl": 600}, "note": "ok"}
    for bad in ({}, {"decision": "maybe"}, {"decision": "approve", "scope": "forever"},
                {"decision": "approve", "scope": "identity", "ttl": "-1"},
                {"decision": "approve", "scope": "identity"}):
        with pytest.raises(ValueError):
            vote_from_form(bad)


async def test_approvals_viewer_reads_approver_decides_as_herself(tmp_path):
    c, _, state = await _console(tmp_path)
    svc = state.approvals
    try:
        csrf = await _login(c, "vic-tok")
        page = await (await c.get("/console/approvals")).text()
        assert 'id="ap-ap_1"' in page and "&lt;b&gt;why&lt;/b&gt;" in page
        # the headers the approval binds, escaped; the injected one by name only
        assert "<code>x-target-env</code></td><td><code>&lt;production&gt;</code>" in page
        assert "Bearer [PLACEHOLDER:gh]" in page and "<code>cdcdcdcdcdcdcdcd</code>" in page
        assert "<code>x-api-key</code></td><td class=\"meta\">injected by Sandgate" in page
        assert "button" not in page.split('id="ap-ap_1"')[1]  # no form for a viewer
        r = await c.post("/console/approvals/ap_1", data={"csrf": csrf, "decision": "approve"})
        assert r.status == 403 and "cannot decide" in await r.text()
        assert svc.calls == []  # type: ignore[union-attr]
        c.session.cookie_jar.clear()
        csrf = await _login(c, "alice-tok")
        page = await (await c.get("/console/approvals")).text()
        assert 'value="sandbox"' in page and 'value="identity"' not in page  # the rule's
        r = await c.post("/console/approvals/ap_1", allow_redirects=False,
                         data={"csrf": csrf, "decision": "approve", "scope": "sandbox",
                               "ttl": "600", "user": "mallory"})
        assert r.status == 303 and r.headers["Location"] == "/console/approvals/ap_1"
        assert svc.calls == [  # type: ignore[union-attr]
            ("ap_1", "alice", "approve", {"kind": "sandbox", "ttl": 600}, None)]
        r = await c.post("/console/approvals/ap_9", data={"csrf": csrf, "decision": "deny"})
        assert r.status == 404 and "no approval ap_9" in await r.text()
        r = await c.post("/console/approvals/ap_1", data={"decision": "deny"})
        assert r.status == 403  # no CSRF token
        assert len(svc.calls) == 2  # type: ignore[union-attr]
        detail = await (await c.get("/console/approvals/ap_1")).text()
        assert 'id="state">approved<' in detail
        assert "<code>x-target-env</code></td><td><code>&lt;production&gt;</code>" in detail
        assert (await c.get("/console/approvals/nope")).status == 404
        overview = await (await c.get("/console/")).text()
        assert 'id="pending">1<' in overview
    finally:
        await c.close()


def test_cookies_are_secure_over_tls():
    import ssl

    from aiohttp import web

    for tls, secure in ((ssl.create_default_context(), True), (None, False)):
        resp = web.Response()
        auth.set_cookie(resp, make_mocked_request("GET", "/console/", sslcontext=tls),
                        auth.COOKIE, "v", 60)
        line = resp.cookies[auth.COOKIE].output()
        assert "HttpOnly" in line and "SameSite=Strict" in line and "Path=/console/" in line
        assert ("Secure" in line) is secure


# ------------------------------------------------------------------ the spend view


async def test_spend_page_shows_each_budget_window_its_limits_in_flight_and_models(tmp_path):
    """The spend view: per budget and identity or sandbox, what the window counted against
    each limit, what is in flight, the settled spend per model (the process's own windows:
    the proxy's SpendWindows, reserved and settled as s37_llm does)."""
    from sandgate.llm.spend import Amounts, SpendWindows, budget_key
    from sandgate.policy.model import Budget, Source

    windows = SpendWindows()
    day = Budget("day", 86400, "identity", Source("p.yaml", 1), output_tokens=1000,
                 cost_usd=2.5)
    box = Budget("box", 3600, "sandbox", Source("p.yaml", 2), input_tokens=50_000)
    r1 = windows.reserve(budget_key(day, "agent"), day, "agent", Amounts(300, 400, 7000),
                         identity="agent", model="claude-sonnet-*")
    windows.settle(r1, Amounts(120, 80, 1500))
    windows.reserve(budget_key(day, "agent"), day, "agent", Amounts(200, 100, 2000),
                    identity="agent", model="claude-sonnet-*")  # in flight
    r3 = windows.reserve(budget_key(box, "sb:1"), box, "sb:1", Amounts(900, 10, 0),
                         identity="agent", model="gpt-4o-mini*")
    windows.settle(r3, Amounts(700, 5, 0))

    async def open_windows() -> list[Any]:
        return windows.views()

    client, _, state = await _console(tmp_path)
    state.spend_windows = open_windows
    async with client as c:
        await _login(c)
        page = await (await c.get("/console/spend")).text()
        sections = page.split('<section class="identity spend-window">')[1:]
        day_part = next(x for x in sections if "day: identity agent" in x)
        box_part = next(x for x in sections if "box: sandbox sb:1" in x)
        # output: 80 settled + 100 in flight, of 1000; cost 0.0015 + 0.002 of 2.5
        assert re.search(r"<td>output tokens</td><td>1000</td><td>180</td><td>100</td>"
                         r"<td>18%</td>", day_part)
        assert re.search(r"<td>cost USD</td><td>2.5</td><td>0.0035</td><td>0.002</td>",
                         day_part)
        assert re.search(r"<td>input tokens</td><td>-</td><td>320</td><td>200</td><td></td>",
                         day_part)
        assert re.search(r"<td>claude-sonnet-\*</td><td>120</td><td>80</td><td>0.0015</td>",
                         day_part)
        assert "counted by this process" in day_part
        assert re.search(r"<td>input tokens</td><td>50000</td><td>700</td><td>0</td>"
                         r"<td>1%</td>", box_part)
        assert "<td>gpt-4o-mini*</td><td>700</td><td>5</td>" in box_part
        # the filter
        page = await (await c.get("/console/spend?q=gpt-4o")).text()
        assert "box: sandbox sb:1" in page and "day: identity agent" not in page
        assert 'href="/console/spend" class="on"' in page


async def test_spend_page_says_when_the_state_cannot_be_read(tmp_path):
    from sandgate.errors import StateUnavailable

    async def down() -> list[Any]:
        raise StateUnavailable("Sandgate's shared state (redis://x) did not answer")

    client, _, state = await _console(tmp_path)
    state.spend_windows = down
    async with client as c:
        await _login(c)
        r = await c.get("/console/spend")
        assert "did not answer" in await r.text()


async def test_workers_spend_merges_fleet_windows_once_and_keeps_each_workers_own():
    import json as _json

    from sandgate.console.source import WorkersSource

    def window(who: str, shared: bool) -> dict[str, Any]:
        return {"budget": "day", "scope": "identity", "who": who, "identity": who,
                "per": 60, "ends_in": 5, "limits": {"output_tokens": 10}, "used": {},
                "reserved": {}, "models": {}, "shared": shared}

    class Sup:
        async def ask_all(self, method: str, path: str) -> list[tuple[int, bytes, Any]]:
            assert path == "/worker/console/spend"
            return [(200, _json.dumps({"windows": [window("a", True), window("b", False)]})
                     .encode(), None),
                    (200, _json.dumps({"windows": [window("a", True), window("b", False)]})
                     .encode(), None),
                    (503, b"{}", None)]

    got = await WorkersSource(Sup()).spend()  # type: ignore[arg-type]
    assert [(w["who"], w.get("worker")) for w in got] == [("a", None), ("b", 1), ("b", 2)]
