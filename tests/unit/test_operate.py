"""Pure parts of running for months: live reload, report mode, metrics labels, admin API."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sandgate.admin.listener import build_app
from sandgate.admin.process import AdminState
from sandgate.audit import events as A
from sandgate.decision import decide, decide_connect, reported
from sandgate.explain.answer import explain
from sandgate.metrics import Metrics
from sandgate.policy import live
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.request import parse_url
from sandgate.runner.config import same_address
from sandgate.tokens import verify_token

pytestmark = pytest.mark.unit

BASE = """\
version: v1
secrets:
  k: {vault: secret/data/k, field: v}
  old: {vault: secret/data/old, field: v}
identities:
  agent:
    rules:
      - {name: api, hosts: [api.example.com], inject: {headers: {x-key: "{{ secrets.k }}"}}}
      - {name: legacy, hosts: [old.example.com], inject: {headers: {x-key: "{{ secrets.old }}"}}}
  watcher:
    mode: report
    rules:
      - {name: docs, hosts: [docs.example.com], methods: [GET]}
      - {name: no-admin, action: deny, hosts: [docs.example.com], paths: ["/admin/**"]}
"""


def _dir(tmp_path: Path, text: str = BASE) -> Path:
    d = tmp_path / "p"
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.yaml").write_text(text)
    return d


# ------------------------------------------------------------------ report mode


def test_mode_defaults_to_enforce_and_report_is_read(tmp_path):
    p = load_policy_dir(_dir(tmp_path))
    assert p.identities["agent"].mode == "enforce"
    assert p.identities["watcher"].mode == "report"


def test_bad_mode_is_a_located_error(tmp_path):
    d = _dir(tmp_path, BASE.replace("mode: report", "mode: audit"))
    with pytest.raises(PolicyError) as e:
        load_policy_dir(d)
    assert "a.yaml:11: identities.watcher.mode" in str(e.value)


@pytest.mark.parametrize(("identity", "method", "url", "expect"), [
    ("watcher", "GET", "https://docs.example.com/x", False),  # allowed: nothing to report
    ("watcher", "POST", "https://docs.example.com/x", True),  # no_rule
    ("watcher", "GET", "https://docs.example.com/admin/a", True),  # denied_by_rule
    ("watcher", "GET", "https://elsewhere.example/", True),  # no_rule
    ("agent", "GET", "https://elsewhere.example/", False),  # enforce
    ("nobody", "GET", "https://docs.example.com/x", False),  # unknown identity: never
])
def test_reported(tmp_path, identity, method, url, expect):
    p = load_policy_dir(_dir(tmp_path))
    assert reported(p, identity, decide(p, identity, parse_url(method, url))) is expect


def test_reported_connect(tmp_path):
    p = load_policy_dir(_dir(tmp_path))
    d = decide_connect(p, "watcher", "elsewhere.example", 443)
    assert not d.allowed and reported(p, "watcher", d)


def test_explain_says_report(tmp_path):
    p = load_policy_dir(_dir(tmp_path))
    out, allowed = explain(p, "watcher", "POST", "https://docs.example.com/x")
    assert not allowed and out["decision"] == "report" and out["mode"] == "report"
    out, allowed = explain(p, "agent", "GET", "https://api.example.com/")
    assert allowed and out["inject"] == ["header x-key: from secret(s) k"] and "mode" not in out


# ------------------------------------------------------------------ live reload


class FakeBroker:
    def __init__(self) -> None:
        self.secrets: list[set[str]] = []

    def update_secrets(self, secrets: Any) -> None:
        self.secrets.append(set(secrets))


async def test_reload_swaps_only_a_good_policy(tmp_path):
    d = _dir(tmp_path)
    lp = live.LivePolicy(d, live.load(d))
    broker = FakeBroker()
    outcomes: list[live.ReloadOutcome] = []
    lp.on_swap.append(lambda new: broker.update_secrets(new.policy.secrets))
    lp.on_outcome.append(outcomes.append)
    v0 = lp.current.version

    assert (await lp.reload("api")).outcome == "unchanged"
    (d / "a.yaml").write_text(BASE.replace("hosts: [old.example.com]", "hostz: [x]"))
    bad = await lp.reload("signal")
    assert bad.outcome == "error" and bad.version == v0 and lp.current.version == v0
    assert any("a.yaml:" in p and "hostz" in p and "Fix:" in p for p in bad.problems)
    assert lp.problems == bad.problems and broker.secrets == []

    # drop the `old` secret and its rule
    text = BASE.replace("  old: {vault: secret/data/old, field: v}\n", "")
    text = "\n".join(ln for ln in text.splitlines() if "legacy" not in ln) + "\n"
    (d / "a.yaml").write_text(text)
    ok = await lp.reload("file")
    assert ok.outcome == "ok" and ok.previous == v0 and lp.current.version == ok.version != v0
    assert broker.secrets == [{"k"}] and lp.problems == ()
    assert [o.outcome for o in outcomes] == ["unchanged", "error", "ok"]


async def test_watcher_reloads_after_a_change_settles(tmp_path):
    d = _dir(tmp_path)
    lp = live.LivePolicy(d, live.load(d))
    seen: list[str] = []
    lp.on_outcome.append(lambda o: seen.append(o.outcome))
    task = asyncio.create_task(lp.watch(0.05))
    try:
        await asyncio.sleep(0.2)
        assert seen == []  # nothing changed
        (d / "b.yaml").write_text("version: v1\nidentities:\n  other: {rules: []}\n")
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.02)
        assert seen == ["ok"] and "other" in lp.policy.identities
        await asyncio.sleep(0.3)
        assert seen == ["ok"]  # a broken or good file is tried once per change, not per poll
    finally:
        task.cancel()


def test_content_hash_follows_content_not_mtime(tmp_path):
    d = _dir(tmp_path)
    h = live.content_hash(live.policy_files(d))
    (d / "a.yaml").write_text(BASE)
    assert live.content_hash(live.policy_files(d)) == h
    (d / "a.yaml").write_text(BASE + "\n")
    assert live.content_hash(live.policy_files(d)) != h


# ------------------------------------------------------------------ metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_labels_are_bounded_by_the_policy(tmp_path):
    p = load_policy_dir(_dir(tmp_path))
    m = Metrics(lambda: p)
    m.on_audit("request", {A.IDENTITY: "agent", A.RULE: "api", A.DECISION: "allow",
                           A.CODE: None, A.UPSTREAM_STATUS: 201, A.DURATION_MS: 12.5,
                           A.SECRETS: ["k@3"], A.EXFIL: [], A.REDACTIONS: 2})
    m.on_audit("request", {A.IDENTITY: "sk-live-abc/evil?q=1", A.RULE: "/path?x",
                           A.DECISION: "deny", A.CODE: "no_rule",
                           A.EXFIL: ["k:value:header", "canary:agent:raw:body",
                                     "s3cr3t:raw:body"]})
    m.on_audit("connect", {A.DECISION: "report", A.CODE: "no_rule"})
    m.secret_cache("k", hit=False)
    m.secret_fetch("nonsense/path", "ok")
    s = _samples(m)
    assert s[("sandgate_requests_total", (("code", "none"), ("decision", "allow"),
                                          ("identity", "agent"), ("rule", "api")))] == 1
    assert s[("sandgate_requests_total", (("code", "no_rule"), ("decision", "deny"),
                                          ("identity", "unknown"), ("rule", "unknown")))] == 1
    assert s[("sandgate_upstream_responses_total", (("status_class", "2xx"),))] == 1
    assert s[("sandgate_injections_total", (("secret", "k"),))] == 1
    assert s[("sandgate_exfiltration_attempts_total", (("secret", "k"),))] == 1
    assert s[("sandgate_exfiltration_attempts_total", (("secret", "canary"),))] == 1
    assert s[("sandgate_exfiltration_attempts_total", (("secret", "unknown"),))] == 1
    assert s[("sandgate_redactions_total", ())] == 2
    assert s[("sandgate_connects_total", (("code", "no_rule"), ("decision", "report")))] == 1
    assert s[("sandgate_secret_cache_misses_total", (("secret", "k"),))] == 1
    assert s[("sandgate_secret_fetches_total", (("outcome", "ok"), ("secret", "unknown")))] == 1
    assert s[("sandgate_request_duration_seconds_count", (("decision", "allow"),))] == 1
    text = m.render().decode()
    assert "sk-live" not in text and "s3cr3t" not in text and "/path" not in text


def test_policy_info_names_only_the_serving_version(tmp_path):
    p = load_policy_dir(_dir(tmp_path))
    m = Metrics(lambda: p)
    m.policy_swapped("aaaa", 1.0)
    m.policy_swapped("bbbb", 2.0)
    m.reload_outcome("error", "file", 3.0)
    s = _samples(m)
    assert [k for k in s if k[0] == "sandgate_policy_info"] == [
        ("sandgate_policy_info", (("version", "bbbb"),))]
    assert s[("sandgate_policy_reloads_total", (("outcome", "error"), ("trigger", "file")))] == 1
    assert s[("sandgate_policy_last_reload_timestamp_seconds", (("outcome", "error"),))] == 3.0


def test_audit_listener_sees_every_event_and_never_breaks_it(tmp_path):
    import io

    buf = io.StringIO()
    log = A.AuditLog(buf)
    seen: list[str] = []

    def boom(event: str, fields: dict[str, Any]) -> None:
        seen.append(event)
        raise RuntimeError("metric broke")

    log.add_listener(boom)
    log.emit("request", identity="a")
    log.emit("policy", outcome="ok")
    assert seen == ["request", "policy"] and len(buf.getvalue().splitlines()) == 2


# ------------------------------------------------------------------ admin app (no proxy)


class StubBroker:
    def __init__(self, problem: str | None = None) -> None:
        self.problem = problem

    async def check(self) -> str | None:
        return self.problem


async def _client(tmp_path: Path, **kw: Any) -> TestClient[Any, Any]:
    d = _dir(tmp_path)
    lp = live.LivePolicy(d, live.load(d))
    state = AdminState(live=lp, broker=kw.get("broker", StubBroker()),  # type: ignore[arg-type]
                       metrics=Metrics(lambda: lp.policy), token_key=b"k" * 32,
                       admin_token="tok", listener_up=lambda: kw.get("up", True),
                       draining=lambda: kw.get("draining", False),
                       open_paths=kw.get("open_paths", frozenset()))
    client = TestClient(TestServer(build_app(state)))
    await client.start_server()
    return client


H = {"Authorization": "Bearer tok"}


async def test_admin_auth_and_readiness(tmp_path):
    c = await _client(tmp_path)
    try:
        assert (await c.get("/healthz")).status == 200
        r = await c.get("/readyz")
        assert r.status == 401 and (await r.json())["error"] == "unauthorized"
        assert (await c.get("/readyz", headers={"Authorization": "tok"})).status == 401
        assert (await c.get("/nothing-here")).status == 401
        r = await c.get("/readyz", headers=H)
        assert r.status == 200 and (await r.json())["ready"] is True
    finally:
        await c.close()
    c = await _client(tmp_path / "x", broker=StubBroker("Vault is unreachable"), up=False)
    try:
        r = await c.get("/readyz", headers=H)
        body = await r.json()
        assert r.status == 503
        assert body["reasons"] == ["the proxy listener is not up", "vault: Vault is unreachable"]
    finally:
        await c.close()


async def test_admin_open_paths_serve_probes_and_scrapers_without_the_token(tmp_path):
    c = await _client(tmp_path, open_paths=frozenset({"/readyz", "/metrics"}))
    try:
        r = await c.get("/readyz")
        assert r.status == 200 and (await r.json())["ready"] is True
        r = await c.get("/metrics")
        assert r.status == 200 and b"sandgate_info" in await r.read()
        # everything else still needs the token: policy, tokens, reload, explain
        assert (await c.get("/v1/policy")).status == 401
        assert (await c.post("/v1/tokens", json={"identity": "agent"})).status == 401
        assert (await c.post("/v1/reload")).status == 401
        assert (await c.get("/readyz/../v1/policy")).status == 401
    finally:
        await c.close()


async def test_admin_open_paths_are_a_closed_set(tmp_path):
    with pytest.raises(ValueError, match="cannot be served without a token"):
        await _client(tmp_path, open_paths=frozenset({"/v1/tokens"}))


def test_instance_names_every_audit_line_and_the_info_metric(tmp_path):
    import io
    import json

    out = io.StringIO()
    log = A.AuditLog(out, instance="sandgate-7f9c")
    log.emit("request", identity="agent")
    log.emit("shutdown")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [list(x)[:3] for x in lines] == [["time", "event", "instance"]] * 2
    assert {x["instance"] for x in lines} == {"sandgate-7f9c"}
    d = _dir(tmp_path)
    lp = live.LivePolicy(d, live.load(d))
    text = Metrics(lambda: lp.policy, instance="sandgate-7f9c").render().decode()
    (info,) = [f for f in text_string_to_metric_families(text) if f.name == "sandgate_info"]
    assert info.samples[0].labels["instance"] == "sandgate-7f9c"
    assert info.samples[0].value == 1


async def test_admin_tokens(tmp_path):
    c = await _client(tmp_path)
    try:
        r = await c.post("/v1/tokens", headers=H, json={"identity": "agent", "ttl": 60})
        doc = await r.json()
        assert r.status == 200 and doc["ttl"] == 60
        claims = verify_token(b"k" * 32, doc["token"])
        assert claims.identity == "agent" and claims.expires_at <= time.time() + 61
        r = await c.post("/v1/tokens", headers=H, json={"identity": "agent", "ttl": "25h"})
        assert r.status == 400
        r = await c.post("/v1/tokens", headers=H, json={"identity": "ghost"})
        assert r.status == 404
        r = await c.post("/v1/tokens", headers=H, data=b"not json")
        assert r.status == 400
    finally:
        await c.close()


def test_same_address():
    assert same_address(("127.0.0.1", 8080), ("127.0.0.1", 8080))
    assert same_address(("0.0.0.0", 8080), ("127.0.0.1", 8080))
    assert not same_address(("127.0.0.1", 8081), ("127.0.0.1", 8080))
    assert not same_address(("127.0.0.2", 8080), ("127.0.0.1", 8080))


def test_remembered_label_children_count_like_labels(tmp_path, monkeypatch):
    import sandgate.metrics as M

    p = load_policy_dir(_dir(tmp_path))
    m = Metrics(lambda: p)
    event = {A.IDENTITY: "agent", A.RULE: "api", A.DECISION: "allow", A.CODE: None,
             A.UPSTREAM_STATUS: 200, A.DURATION_MS: 1.0, A.SECRETS: ["k@1"]}
    for _ in range(3):
        m.on_audit("request", event)
        m.secret_cache("k", hit=True)
    s = _samples(m)
    assert s[("sandgate_requests_total", (("code", "none"), ("decision", "allow"),
                                          ("identity", "agent"), ("rule", "api")))] == 3
    assert s[("sandgate_injections_total", (("secret", "k"),))] == 3
    assert s[("sandgate_secret_cache_hits_total", (("secret", "k"),))] == 3
    assert s[("sandgate_request_duration_seconds_count", (("decision", "allow"),))] == 3
    # bounded: past the limit children are looked up each time, and still counted
    monkeypatch.setattr(M, "_MAX_CHILDREN", len(m._children))
    m.on_audit("request", {**event, A.UPSTREAM_STATUS: 404})
    m.on_audit("request", {**event, A.UPSTREAM_STATUS: 404})
    assert len(m._children) == M._MAX_CHILDREN
    assert _samples(m)[("sandgate_upstream_responses_total", (("status_class", "4xx"),))] == 2
