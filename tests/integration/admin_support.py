"""Helpers for tests of the admin listener: a real `sandgate run --admin` and plain HTTP."""

from __future__ import annotations

import atexit
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import HERE, UPSTREAM_IP, Proxy, free_port, start_proxy
from tests.support.upstream import UpstreamServer

ADMIN_TOKEN = "test-admin-token-5c1d"
# These tests run their own TLS upstream on another loopback address, so that they do not
# compete for 127.0.0.2:443 with other suites running at the same time.
OWN_IP = "127.0.71.2"
OWN_NAMES = ("api.anthropic.com", "api.openai.com", "upstream.test", "a.upstream.test",
             "plain.test", "other.test", "tunnel.test", "nocert.test")


_OWN: list[UpstreamServer] = []


@pytest.fixture(scope="session", name="own_upstream")
def own_upstream_fixture(pki) -> Iterator[UpstreamServer]:
    # Imported into several modules, which pytest treats as separate fixtures: share one server.
    if not _OWN:
        _OWN.append(UpstreamServer(OWN_IP, 443, str(pki.cert), str(pki.key)).start())
        atexit.register(_OWN[0].stop)
    yield _OWN[0]


@dataclass
class Admin:
    proxy: Proxy
    url: str
    policies: Path

    def call(self, method: str, path: str, body: Any = None, token: str | None = ADMIN_TOKEN,
             timeout: float = 10) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        if "json" in ctype:
            return status, json.loads(raw)
        return status, raw.decode()

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.call("POST", path, body if body is not None else {}, **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = self.get("/metrics")
        assert status == 200, text
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def version(self) -> str:
        status, doc = self.get("/v1/policy")
        assert status == 200, doc
        return str(doc["version"])


def policy_text() -> str:
    """The shared test policy, pointed at OWN_IP."""
    return (HERE / "policies" / "test.yaml").read_text().replace(UPSTREAM_IP, OWN_IP)


def copy_policies(tmp: Path, extra_yaml: str | None = None) -> Path:
    d = tmp / "policies"
    d.mkdir()
    (d / "test.yaml").write_text(policy_text())
    if extra_yaml is not None:
        (d / "extra.yaml").write_text(extra_yaml)
    return d


def start_admin_proxy(tmp: Path, policies: Path, vault, pki, *extra: str) -> Admin:
    aport = free_port()
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
           "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    resolve = [f"--resolve={n}={OWN_IP}" for n in OWN_NAMES]
    p = start_proxy(tmp, policies, env, pki, *resolve, "--admin", f"127.0.0.1:{aport}", *extra)
    admin = Admin(p, f"http://127.0.0.1:{aport}", policies)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if admin.get("/healthz", token=None, timeout=2)[0] == 200:
                return admin
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"admin listener did not come up:\n{p.logs()[-3000:]}")


def wait_for(pred, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much every sample `name` whose labels include `labels` moved."""
    total = 0.0
    for (n, lbls), v in after.items():
        if n != name or not all(dict(lbls).get(k) == val for k, val in labels.items()):
            continue
        total += v - before.get((n, lbls), 0.0)
    return total
