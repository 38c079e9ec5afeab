"""The sandgate CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandgate import tokens
from sandgate.confdir import token_key
from tests.support.cli import run_cli

ROOT = Path(__file__).parents[2]
SANDGATE = [sys.executable, "-m", "sandgate.cli"]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd)


def test_check_shipped_policies_passes():
    # the real entry point, once, as a separate process
    r = subprocess.run([*SANDGATE, "check", "policies"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
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


# --- check / explain / lint / token say what the proxy does ----------------------------------

ADDR = ("version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: ip, hosts: [10.0.0.5, wiki.corp.example], methods: [GET]}\n")


def test_check_lists_files_read_and_skipped(tmp_path):
    (tmp_path / "Main.YAML").write_text(ADDR)
    (tmp_path / "new.yaml.new").write_text("version: v1\n")
    (tmp_path / "old.yml~").write_text("version: v1\n")
    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "t.yaml").write_text("version: v1\n")
    r = run("check", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert f"read {tmp_path / 'Main.YAML'}" in out
    for name in ("new.yaml.new", "old.yml~", "team"):
        assert f"skipped {tmp_path / name}" in out, out
    assert "subfolder" in out


def test_check_fails_an_allow_fixture_the_proxy_refuses_for_its_address(tmp_path):
    (tmp_path / "p.yaml").write_text(
        ADDR + "tests:\n  - {identity: a, request: GET https://10.0.0.5/, expect: allow}\n")
    r = run("check", str(tmp_path))
    assert r.returncode == 1 and "internal_address" in r.stdout, r.stdout


def test_check_resolve_option(tmp_path):
    (tmp_path / "p.yaml").write_text(
        ADDR + "tests:\n  - {identity: a, request: GET https://wiki.corp.example/, "
        "expect: deny, code: internal_address}\n")
    assert run("check", str(tmp_path)).returncode == 1
    r = run("check", str(tmp_path), "--resolve", "wiki.corp.example=192.168.4.4")
    assert r.returncode == 0, r.stdout
    r = run("check", str(tmp_path), "--resolve", "wiki.corp.example=nope")
    assert r.returncode == 2 and "not an IP address" in r.stderr


def test_explain_shows_the_address_verdict(tmp_path):
    (tmp_path / "p.yaml").write_text(ADDR)
    r = run("explain", "--policies", str(tmp_path), "--identity", "a", "GET",
            "https://10.0.0.5/")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["decision"] == "deny"
    assert doc["code"] == "internal_address" and doc["rule"] == "ip"
    assert "10.0.0.5" in doc["address"]
    r = run("explain", "--policies", str(tmp_path), "--identity", "a", "GET",
            "https://wiki.corp.example/")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["address"] == "address not checked: resolved at request time"
    r = run("explain", "--policies", str(tmp_path), "--identity", "a", "--resolve",
            "wiki.corp.example=172.16.0.1", "GET", "https://wiki.corp.example/")
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == "internal_address"


def test_explain_connect(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: db, hosts: [db.example.com], ports: [5432], passthrough: true}\n")
    r = run("explain", "--policies", str(tmp_path), "--identity", "a", "CONNECT",
            "db.example.com:5432")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["rule"] == "db" and doc["passthrough"] is True


def test_check_format_github_and_json(tmp_path):
    (tmp_path / "p.yaml").write_text(
        ADDR + "tests:\n  - {identity: a, request: GET https://10.0.0.5/, expect: allow}\n")
    r = run("check", "--format", "github", str(tmp_path))
    assert r.returncode == 1
    assert f"::error file={tmp_path / 'p.yaml'},line=7::" in r.stdout, r.stdout
    r = run("check", "--format", "json", str(tmp_path))
    doc = json.loads(r.stdout)
    assert doc["failed"] == 1 and doc["fixtures"][0]["code"] == "internal_address"
    (tmp_path / "p.yaml").write_text("version: v1\nidentities: {a: {rules: [{name: r}]}}\n")
    r = run("check", "--format", "json", str(tmp_path))
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["problems"][0]["severity"] == "error"


def test_token_issue_checks_identity_against_policies(tmp_path):
    r = run("token", "issue", "--confdir", str(tmp_path), "--policies", "policies",
            "--identity", "codign-agent")
    assert r.returncode == 1 and r.stdout == ""
    assert "codign-agent" in r.stderr and "coding-agent" in r.stderr
    r = run("token", "issue", "--confdir", str(tmp_path), "--policies", "policies",
            "--identity", "coding-agent")
    assert r.returncode == 0 and r.stdout.count(".") >= 1


def test_lint_shipped_policies_strict_clean():
    r = run("lint", "--strict", "policies")
    assert r.returncode == 0, r.stdout + r.stderr


def test_lint_formats_and_strict(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: ['*.github.io'], methods: [GET]}\n"
        "tests:\n  - {identity: a, request: GET https://x.github.io/, expect: allow}\n")
    r = run("lint", str(tmp_path))
    assert r.returncode == 0 and f"{tmp_path / 'p.yaml'}:5:" in r.stdout, r.stdout
    assert run("lint", "--strict", str(tmp_path)).returncode == 1
    r = run("lint", "--format", "github", str(tmp_path))
    assert r.stdout.startswith(f"::warning file={tmp_path / 'p.yaml'},line=5::")
    doc = json.loads(run("lint", "--format", "json", str(tmp_path)).stdout)
    assert set(doc[0]) == {"file", "line", "field", "message", "fix", "severity", "code"}
    assert doc[0]["code"] == "public-suffix-wildcard"
    (tmp_path / "p.yaml").write_text("version: v1\nidentities: {a: {rules: [{name: r}]}}\n")
    assert run("lint", str(tmp_path)).returncode == 1
