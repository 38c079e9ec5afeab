"""`query:`, `max_request_bytes`, `public: true` and templates through a real `sandgate run`.

The policy is split over two files and a template (git smart HTTP against the shared upstream,
which answers any path); the upstream is on loopback, so the git rules name its range.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.conftest import Proxy, curl, split_status, start_proxy, stop_proxy

pytestmark = pytest.mark.integration

TEMPLATES = """version: v1
templates:
  git-read:
    - name: git-refs
      hosts: [upstream.test]
      private_cidrs: [127.0.0.2/32]
      methods: [GET]
      paths: ["/*/info/refs"]
      query: {service: [git-upload-pack]}
    - name: git-fetch
      hosts: [upstream.test]
      private_cidrs: [127.0.0.2/32]
      methods: [POST]
      paths: ["/*/git-upload-pack"]
      max_request_bytes: 1k
"""
IDENTITIES = """version: v1
identities:
  agent:
    use: [git-read]
  browser:
    rules:
      - {name: web, public: true, methods: [GET]}
"""


@pytest.fixture(scope="module")
def fproxy(tmp_path_factory, upstream, pki) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("features")
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "10-templates.yaml").write_text(TEMPLATES)
    (pol / "20-identities.yaml").write_text(IDENTITIES)
    # No secrets in this policy: Vault is never asked.
    p = start_proxy(tmp, pol, {"VAULT_ADDR": "http://127.0.0.1:9", "VAULT_TOKEN": "unused"}, pki)
    p.policy_dir = pol  # type: ignore[attr-defined]
    yield p
    stop_proxy(p)


REFS = "https://upstream.test/repo.git/info/refs"


def test_query_allows_upload_pack(fproxy, upstream):
    before = len(upstream.seen)
    body, code = split_status(curl(fproxy, "agent", f"{REFS}?service=git-upload-pack").stdout)
    assert code == 200, body
    (seen,) = upstream.seen[before:]
    assert (seen.path, seen.query) == ("/repo.git/info/refs", "service=git-upload-pack")
    ev = fproxy.wait_audit(lambda e: e.get("rule") == "git-refs")
    # the audit names where the rule is written: the template, in its own file
    assert f"{fproxy.policy_dir / '10-templates.yaml'}:4" in ev["reason"]


@pytest.mark.parametrize("qs", ["service=git-receive-pack", "",
                                "service=git-upload-pack&service=git-receive-pack",
                                "service=git+upload-pack", "service=git-upload-pack;x=1"])
def test_query_refuses_everything_else(fproxy, upstream, qs):
    before = len(upstream.seen)
    url = f"{REFS}?{qs}" if qs else REFS
    body, code = split_status(curl(fproxy, "agent", url).stdout)
    assert code == 403, body
    assert json.loads(body)["code"] == "no_rule"
    assert upstream.seen[before:] == []


def test_traffic_diff_sees_a_widened_query_value(fproxy, upstream, tmp_path):
    """The audit keeps the values of parameters a rule constrains (others stay REDACTED), so
    `diff --traffic` shows a change that allows ?service=git-receive-pack."""
    from sandgate.cli import main as cli_main

    curl(fproxy, "agent", f"{REFS}?service=git-receive-pack&token=opaque-value")
    ev = fproxy.wait_audit(lambda e: e.get("code") == "no_rule"
                           and "git-receive-pack" in (e.get("path") or ""))
    assert ev["path"] == "/repo.git/info/refs?service=git-receive-pack&token=REDACTED"
    new = tmp_path / "new"
    new.mkdir()
    (new / "10-templates.yaml").write_text(TEMPLATES.replace(
        "[git-upload-pack]", "[git-upload-pack, git-receive-pack]"))
    (new / "20-identities.yaml").write_text(IDENTITIES)
    out = tmp_path / "diff.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["diff", str(fproxy.policy_dir), str(new), "--traffic",
                       str(fproxy.audit_file), "--format", "json", "--resolve",
                       "upstream.test=127.0.0.2"])
    out.write_text(buf.getvalue())
    doc = json.loads(buf.getvalue())
    assert rc == 1
    widened = [c for c in doc["changes"] if c["kinds"][0] == "deny->allow"]
    assert widened and widened[0]["request"].endswith("/repo.git/info/refs?service="
                                                      "git-receive-pack")
    assert widened[0]["new"]["rule"] == "git-refs"


def test_max_request_bytes(fproxy, upstream):
    url = "https://upstream.test/repo.git/git-upload-pack"
    before = len(upstream.seen)
    body, code = split_status(curl(fproxy, "agent", url, "--data-binary", "x" * 1024).stdout)
    assert code == 200 and json.loads(body)["body_len"] == 1024
    body, code = split_status(curl(fproxy, "agent", url, "--data-binary", "x" * 1025).stdout)
    assert code == 413, body
    refusal = json.loads(body)
    assert refusal["code"] == "too_large" and "max_request_bytes" in refusal["reason"]
    assert len(upstream.seen) == before + 1  # only the first one went out


def test_public_refuses_a_name_resolving_to_loopback(fproxy, upstream):
    before = len(upstream.seen)
    # start_proxy passes --resolve other.test=127.0.0.2: a loopback address
    body, code = split_status(curl(fproxy, "browser", "https://other.test/").stdout)
    assert code == 403, body
    refusal = json.loads(body)
    assert refusal["code"] == "internal_address" and "public" in refusal["reason"]
    # the same host through a rule that names it and its range is fine (agent), and a public
    # rule never injects: nothing else reached the upstream
    assert upstream.seen[before:] == []
