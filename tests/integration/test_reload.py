"""Live reload under load: good -> broken -> good by file change, SIGHUP and the API.

A client thread keeps sending allowed requests the whole time (over one keep-alive tunnel and
over fresh connections); none may fail or be refused, a broken policy never takes effect, and a
new rule works within 2 s of the file write.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.integration.admin_support import (
    OWN_IP,
    Admin,
    copy_policies,
    delta,
    own_upstream_fixture,  # noqa: F401 (the own_upstream fixture)
    start_admin_proxy,
    wait_for,
)
from tests.integration.conftest import SECRET_VALUES, stop_proxy
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

DOCS_RULE = "        paths: [/docs/**]\n"


_TOKENS: dict[tuple[int, str], str] = {}


def _session(admin: Admin, identity: str) -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    key = (admin.proxy.port, identity)
    if key not in _TOKENS:
        _TOKENS[key] = admin.proxy.token(identity)
    url = f"http://{identity}:{_TOKENS[key]}@{admin.proxy.host}:{admin.proxy.port}"
    s.proxies = {"https": url, "http": url}
    s.verify = str(admin.proxy.ca)
    return s


class Load(threading.Thread):
    """Steady allowed traffic: alternately one keep-alive tunnel and a fresh connection."""

    def __init__(self, admin: Admin) -> None:
        super().__init__(daemon=True)
        self.admin = admin
        self.stop = threading.Event()
        self.results: list[tuple[str, int | str]] = []

    def run(self) -> None:
        keep = _session(self.admin, "bash-tool")
        i = 0
        while not self.stop.is_set():
            i += 1
            path = f"/docs/load-{i}"
            try:
                if i % 2:
                    r = keep.get(f"https://upstream.test{path}", timeout=10)
                else:
                    with _session(self.admin, "bash-tool") as fresh:
                        r = fresh.get(f"https://upstream.test{path}", timeout=10)
                self.results.append((path, r.status_code))
            except requests.RequestException as e:
                self.results.append((path, f"{type(e).__name__}: {e}"))
            time.sleep(0.02)


def _probe(s: requests.Session, path: str = "/new/x") -> int:
    return s.get(f"https://upstream.test{path}", timeout=10).status_code


def _write(policies: Path, paths: str) -> float:
    f = policies / "test.yaml"
    text = f.read_text()
    start = text.index("  bash-tool:")
    head, tail = text[:start], text[start:]
    lines = [ln for ln in tail.splitlines(keepends=True)
             if "paths:" not in ln and "pathz:" not in ln]
    tail = "".join(lines).rstrip("\n") + "\n" + paths
    f.write_text(head + tail)
    return time.monotonic()


@pytest.fixture
def admin(tmp_path, vault, own_upstream, pki) -> Iterator[Admin]:
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki)
    yield a
    stop_proxy(a.proxy)
    assert_no_secret([a.proxy.logs(), a.proxy.audit_file.read_text()], SECRET_VALUES, "logs")


def test_reload_under_load(admin, own_upstream):
    policies = admin.policies
    v0 = admin.version()
    m0 = admin.metrics()
    keep = _session(admin, "bash-tool")  # a tunnel opened before every reload
    assert _probe(keep) == 403
    load = Load(admin)
    load.start()
    try:
        time.sleep(0.5)
        # 1. good, by file change: the new rule works within 2 s of the write
        t = _write(policies, "        paths: [/docs/**, /new/**]\n")
        wait_for(lambda: _probe(_session(admin, "bash-tool")) == 200, 2.0, "new rule live")
        assert time.monotonic() - t < 2.0
        assert _probe(keep) == 200  # the open tunnel's next request follows the new policy
        v1 = admin.version()
        assert v1 != v0

        # 2. broken, by file change: never takes effect, the last good one keeps serving
        (policies / "test.yaml").write_text(
            (policies / "test.yaml").read_text().replace("paths: [/docs/**, /new/**]",
                                                         "pathz: [/docs/**]"))
        ev = admin.proxy.wait_audit(lambda e: e["event"] == "policy" and
                                    e["outcome"] == "error", timeout=5)
        assert ev["version"] == v1 and ev["trigger"] == "file"
        assert any("test.yaml:" in p and "pathz" in p and "Fix:" in p for p in ev["problems"])
        assert admin.version() == v1
        status, ready = admin.get("/readyz")
        assert status == 200 and any("pathz" in p for p in ready["policy_reload_problems"])
        assert "pathz" in admin.proxy.logs()
        assert _probe(keep) == 200 and _probe(keep, "/docs/still") == 200

        # 3. good, by SIGHUP (sent before the watcher's debounce could see the write)
        _write(policies, "        paths: [/docs/**, /new/**, /sighup/**]\n")
        admin.proxy.proc.send_signal(signal.SIGHUP)
        ev = admin.proxy.wait_audit(lambda e: e["event"] == "policy" and
                                    e["trigger"] == "signal", timeout=5)
        assert ev["outcome"] == "ok" and ev["previous"] == v1
        assert _probe(keep, "/sighup/a") == 200
        v3 = ev["version"]

        # 4. broken again, then good by the API
        (policies / "test.yaml").write_text("version: v1\nidentities: [oops\n")
        admin.proxy.wait_audit(lambda e: e["event"] == "policy" and e["outcome"] == "error"
                               and e["version"] == v3, timeout=5)
        status, doc = admin.post("/v1/reload")
        assert status == 422 and doc["outcome"] == "error" and doc["version"] == v3
        assert any("YAML syntax error" in p for p in doc["problems"])
        (policies / "test.yaml").write_text(copy_text(admin, "/api/**"))
        status, doc = admin.post("/v1/reload")
        assert status == 200 and doc["outcome"] == "ok" and doc["trigger"] == "api", doc
        assert _probe(keep, "/api/x") == 200 and _probe(keep, "/sighup/a") == 403
        time.sleep(1.5)  # the watcher sees the same content: unchanged, no second swap
        assert admin.version() == doc["version"]
    finally:
        load.stop.set()
        load.join(15)

    bad = [r for r in load.results if r[1] != 200]
    assert not bad, bad[:5]
    assert len(load.results) >= 30, len(load.results)
    allowed = {r[0] for r in load.results}
    events = [e for e in admin.proxy.audit() if e["event"] == "request"
              and (e.get("path") or "").startswith("/docs/load-")]
    assert {e["path"] for e in events} == allowed
    assert all(e["decision"] == "allow" for e in events)
    m1 = admin.metrics()
    assert delta(m0, m1, "sandgate_policy_reloads_total", outcome="error") >= 3
    assert delta(m0, m1, "sandgate_policy_reloads_total", outcome="ok") >= 3
    assert m1[("sandgate_policy_last_reload_timestamp_seconds", (("outcome", "error"),))] > 0
    assert m1[("sandgate_policy_info", (("version", admin.version()),))] == 1
    assert len([k for k in m1 if k[0] == "sandgate_policy_info"]) == 1
    seen = {s.path for s in own_upstream.seen}
    assert allowed <= seen


def copy_text(admin: Admin, extra_path: str) -> str:
    from tests.integration.admin_support import policy_text

    text = policy_text()
    return text.replace("        paths: [/docs/**]\n        private_cidrs: [" + OWN_IP + "/32]",
                        f"        paths: [/docs/**, {extra_path}]\n        private_cidrs: "
                        f"[{OWN_IP}/32]")


def test_secrets_no_longer_named_leave_the_cache(tmp_path, vault, own_upstream, pki):
    """A reload that drops a secret: its cached value is forgotten (and no longer scrubbed)."""
    a = start_admin_proxy(tmp_path, copy_policies(tmp_path), vault, pki)
    try:
        s = _session(a, "coding-agent")
        assert s.post("https://api.anthropic.com/v1/messages", data="{}",
                      timeout=10).status_code == 200
        m0 = a.metrics()
        text = (a.policies / "test.yaml").read_text()
        # drop every use of the anthropic secret, and the secret itself
        kept = []
        skip = False
        for block in text.split("      - name: "):
            if "secrets.anthropic" in block:
                skip = True
                continue
            kept.append(block)
        new = "      - name: ".join(kept).replace(
            "  anthropic: {vault: secret/data/llm/anthropic, field: api_key}\n", "")
        assert skip and "anthropic}" not in new
        (a.policies / "test.yaml").write_text(new)
        status, doc = a.post("/v1/reload")
        assert status == 200 and doc["outcome"] == "ok", doc
        assert "anthropic" not in a.get("/v1/policy")[1]["secrets"]
        r = s.post("https://api.anthropic.com/v1/messages", data="{}", timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "no_rule"
        assert delta(m0, a.metrics(), "sandgate_secret_fetches_total") == 0
    finally:
        stop_proxy(a.proxy)
