"""A failed audit write refuses what follows (fail closed), unless --audit-best-effort."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import HERE, curl, split_status, start_proxy, stop_proxy

pytestmark = pytest.mark.integration


def _vault_env(vault) -> dict[str, str]:
    return {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}


def test_full_disk_audit_refuses_requests(tmp_path, vault, upstream, pki):
    """Bounds: one proxy writing its audit to /dev/full (every write: no space); 2 requests."""
    p = start_proxy(tmp_path, HERE / "policies", _vault_env(vault), pki, "--audit", "/dev/full")
    try:
        before = len(upstream.seen)
        for _ in range(2):
            r = curl(p, "bash-tool", "https://upstream.test/docs/audit-full")
            body, status = split_status(r.stdout)
            assert status == 503, r.stdout + r.stderr
            assert json.loads(body)["code"] == "audit_unavailable"
        assert len(upstream.seen) == before  # nothing was forwarded unaudited
        assert "audit failed" in p.logs()
    finally:
        stop_proxy(p)


def test_best_effort_keeps_forwarding(tmp_path, vault, upstream, pki):
    """Bounds: one proxy, /dev/full audit, --audit-best-effort; 1 request."""
    p = start_proxy(tmp_path, HERE / "policies", _vault_env(vault), pki, "--audit", "/dev/full",
                    "--audit-best-effort")
    try:
        before = len(upstream.seen)
        r = curl(p, "bash-tool", "https://upstream.test/docs/audit-best-effort")
        assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
        assert len(upstream.seen) == before + 1
    finally:
        stop_proxy(p)
