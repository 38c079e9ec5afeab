"""The sandgate CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandgate import tokens
from sandgate.confdir import token_key

ROOT = Path(__file__).parents[2]
SANDGATE = [sys.executable, "-m", "sandgate.cli"]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SANDGATE, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


def test_check_shipped_policies_passes():
    r = run("check", "policies")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout


def test_check_broken_policy_names_file_line_field(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n      - name: r\n        hosts: ['*']\n")
    r = run("check", str(tmp_path))
    assert r.returncode == 1
    assert "bad.yaml:6" in r.stderr
    assert "hosts" in r.stderr


def test_check_failing_fixture_exits_nonzero(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: [example.com], methods: [GET]}\n"
        "tests:\n  - {identity: a, request: POST https://example.com/, expect: allow}\n")
    r = run("check", str(tmp_path))
    assert r.returncode == 1
    assert "FAIL" in r.stdout and "1 failed" in r.stdout


def test_explain_names_rule_and_secret_not_value():
    r = run("explain", "--policies", "policies", "--identity", "coding-agent", "POST",
            "https://api.anthropic.com/v1/messages")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["decision"] == "allow"
    assert doc["rule"]
    assert any("anthropic" in line for line in doc["inject"])
    r = run("explain", "--policies", "policies", "--identity", "bash-tool", "POST",
            "https://api.anthropic.com/v1/messages")
    assert r.returncode == 1
    assert json.loads(r.stdout)["decision"] == "deny"


def test_token_issue_prints_only_a_verifiable_token(tmp_path):
    r = run("token", "issue", "--confdir", str(tmp_path), "--identity", "bash-tool",
            "--ttl", "15m")
    assert r.returncode == 0, r.stderr
    tok = r.stdout.strip()
    assert r.stdout == tok + "\n"
    claims = tokens.verify_token(token_key(tmp_path), tok)
    assert claims.identity == "bash-tool"


@pytest.mark.parametrize("ttl", ["", "0s", "1x", "-1h", "1.5h"])
def test_token_issue_bad_ttl(tmp_path, ttl):
    r = run("token", "issue", "--confdir", str(tmp_path), "--identity", "a", "--ttl", ttl)
    assert r.returncode != 0
    assert r.stdout == ""


def test_ca_prints_only_pem_and_is_stable(tmp_path):
    a = run("ca", "--confdir", str(tmp_path))
    b = run("ca", "--confdir", str(tmp_path))
    assert a.returncode == 0
    assert a.stdout.startswith("-----BEGIN CERTIFICATE-----")
    assert a.stdout.rstrip().endswith("-----END CERTIFICATE-----")
    assert "PRIVATE KEY" not in a.stdout
    assert a.stdout == b.stdout


def test_schema_is_json_schema():
    r = run("schema")
    doc = json.loads(r.stdout)
    assert "properties" in doc and "version" in doc["properties"]


def test_run_refuses_broken_policy(tmp_path):
    (tmp_path / "p.yaml").write_text("version: v1\nidentities: {a: {rules: [{name: r}]}}\n")
    r = subprocess.run([*SANDGATE, "run", "--policies", str(tmp_path), "--confdir",
                        str(tmp_path / "c"), "--listen", "127.0.0.1:18999"], capture_output=True,
                       text=True, timeout=60, env={"VAULT_ADDR": "http://127.0.0.1:9",
                                                   "VAULT_TOKEN": "x", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1
    assert "p.yaml" in r.stderr and "hosts" in r.stderr


def test_bad_listen_and_resolve_are_specific(tmp_path):
    r = run("run", "--policies", "policies", "--listen", "nope")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = run("run", "--policies", "policies", "--resolve", "a.example=not-an-ip")
    assert r.returncode == 2 and "not an IP address" in r.stderr
