"""The audit stream of a real proxy: OCSF events, the signed hash chain, verify, rotation.

A proxy runs with `--audit-format ocsf` and its checkpoint key from OpenBao, real traffic goes
through it (a credential injected from OpenBao into TLS requests, refusals, a failed proxy
token, a passthrough tunnel); every line is a valid OCSF event, `sandgate audit verify` passes,
then edits, deletions and reorderings of the file make it fail at the right line. With
`--workers 2` and a small `--audit-max-bytes` the files rotate under load and still verify.
No secret value appears in any audit byte, in any encoding.
"""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sandgate.audit.chain import public_hex
from sandgate.audit.file import rotated_files
from sandgate.audit.verify import Broken, verify
from tests.integration.conftest import (
    HERE,
    SANDGATE,
    SECRET_VALUES,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.ocsf_schema import check
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

LISTEN = "127.0.66.1"  # this suite's proxies (helper 6's loopback range)
SIGNING_SEED = bytes(range(32))  # an obvious fake signing key, stored in OpenBao


def _encodings(value: str) -> list[str]:
    raw = value.encode()
    return [value, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode(),
            base64.b64encode(raw).decode().rstrip("="), urllib.parse.quote(value, safe=""),
            urllib.parse.quote_plus(value), raw.hex(), raw.hex().upper()]


def _no_secret_anywhere(data: bytes, extra: tuple[str, ...] = ()) -> None:
    text = data.decode("utf-8", "replace")
    values = [e for v in (*SECRET_VALUES, *extra) for e in _encodings(v)]
    assert_no_secret([text, text.lower()], values, "the audit files")


def _verify(*files: Path, public: Path | None = None,
            live: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [*SANDGATE, "audit", "verify", *map(str, files)]
    if public is not None:
        cmd += ["--public-key", str(public)]
    if live:
        cmd.append("--live")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def ocsf_run(tmp_path_factory, vault, upstream, plain_upstream, pki):
    """One proxy run, stopped: its audit file, and the public key of its signing key."""
    tmp = tmp_path_factory.mktemp("audit-ocsf")
    key = Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    vault.put_kv2("sandgate/audit", {"signing_key": pem})
    public = tmp / "audit.pub"
    public.write_text(public_hex(key.public_key()) + "\n")
    p = start_proxy(tmp, HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--audit-format", "ocsf", "--audit-checkpoint-lines", "3",
                    "--audit-signing-key", "vault:secret/sandgate/audit#signing_key",
                    listen_host=LISTEN)
    try:
        r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages", "-X", "POST",
                 "-d", "{}")  # the key from OpenBao injected upstream
        assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
        r = curl(p, "bash-tool", "https://upstream.test/docs/a?token=FAKE-query-value")
        assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
        r = curl(p, "bash-tool", "https://api.openai.com/v1/chat/completions")
        assert split_status(r.stdout)[1] == 403, r.stdout  # no rule
        r = curl(p, "coding-agent", "http://plain.test/x", token="not-a-token")
        assert split_status(r.stdout)[1] == 407, r.stdout  # proxy token refused
        r = curl(p, None, "http://plain.test/")
        assert split_status(r.stdout)[1] == 407, r.stdout  # no credentials at all
        tunnel = subprocess.run(
            ["curl", "-sS", "--max-time", "15", "--proxy", p.url, "--proxy-user",
             f"coding-agent:{p.token('coding-agent')}", "--cacert", str(pki.ca_cert),
             "-o", "/dev/null", "-w", "%{http_code}", "https://tunnel.test/docs/t"],
            capture_output=True, text=True, timeout=30)
        assert tunnel.stdout == "200", tunnel.stdout + tunnel.stderr  # passthrough: not opened
    finally:
        stop_proxy(p)
    assert p.proc.returncode == 0, p.logs()[-2000:]
    return p.audit_file, public, p


def test_every_event_is_ocsf_and_the_chain_verifies(ocsf_run):
    audit, public, p = ocsf_run
    events = [json.loads(x) for x in audit.read_text().splitlines()]
    kinds = {(e["class_uid"], e["unmapped"]["event"]) for e in events}
    for e in events:
        check(e)
    assert {(4002, "request"), (3002, "request"), (4001, "connect"), (6002, "policy"),
            (6002, "shutdown"), (1008, "checkpoint")} <= kinds, kinds
    llm = next(e for e in events
               if e["unmapped"].get("rule") == "llm" and e["unmapped"]["event"] == "request")
    assert llm["http_request"]["http_method"] == "POST" and llm["http_response"]["code"] == 200
    assert llm["unmapped"]["secrets"][0].startswith("anthropic@")
    assert events[-1]["unmapped"]["final"] is True
    r = _verify(audit, public=public)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"OK: 1 file(s), {len(events)} lines, 1 chain(s)")
    _no_secret_anywhere(audit.read_bytes(), extra=(SIGNING_SEED.hex(),))
    assert_no_secret([p.logs()], SECRET_VALUES, "the proxy's log")


@pytest.mark.parametrize("tamper", ["edit", "delete", "reorder"])
def test_verify_names_the_tampered_line(ocsf_run, tmp_path, tamper):
    audit, public, _ = ocsf_run
    lines = audit.read_bytes().splitlines(keepends=True)
    target = next(i for i, x in enumerate(lines)
                  if b'"rule": "llm"' in x and b'"event_code": "request"' in x)
    if tamper == "edit":  # the decision quietly turned around
        lines[target] = lines[target].replace(b'"upstream_status": 200', b'"upstream_status": 403')
    elif tamper == "delete":
        del lines[target]
    else:
        lines[target], lines[target + 1] = lines[target + 1], lines[target]
    copy = tmp_path / "audit.jsonl"
    copy.write_bytes(b"".join(lines))
    r = _verify(copy, public=public)
    assert r.returncode == 1, r.stdout
    want = {"edit": (target + 1, "edited"), "delete": (target + 1, "lines missing"),
            "reorder": (target + 1, "lines missing")}[tamper]
    assert r.stdout.startswith(f"FAILED: {copy}:{want[0]}: {want[1]}"), r.stdout


def test_rotation_under_load_with_two_workers(tmp_path, vault, upstream, plain_upstream, pki):
    """Bounds: 2 workers, 42 requests from 6 clients; files of at most 6 KB, 3 kept."""
    p = start_proxy(tmp_path, HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--workers", "2", "--audit-max-bytes", "6k", "--audit-keep", "3",
                    "--audit-checkpoint-lines", "7", listen_host=LISTEN)
    proxy_url = f"http://coding-agent:{p.token('coding-agent')}@{p.host}:{p.port}"
    try:
        def batch(k: int) -> list[int]:  # one client keeping its connection: load, not forks
            with requests.Session() as s:
                s.trust_env = False
                s.proxies = {"https": proxy_url}
                return [s.post(f"https://api.anthropic.com/v1/messages?n={k}-{i}", json={},
                               verify=str(p.ca), timeout=15).status_code for i in range(7)]

        with ThreadPoolExecutor(6) as pool:
            statuses = [c for b in pool.map(batch, range(6)) for c in b]
        assert statuses == [200] * 42
        live = [*rotated_files(p.audit_file), p.audit_file]
        assert verify(live, live=True).open_tails  # while it runs: the open tails reported
    finally:
        stop_proxy(p)
    assert p.proc.returncode == 0, p.logs()[-2000:]
    files = [*rotated_files(p.audit_file), p.audit_file]
    assert len(files) == 4  # 3 kept + the current one
    r = _verify(*files, public=_confdir_public(p.confdir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "chain(s)" in r.stdout and "deleted by retention" in r.stdout, r.stdout
    data = b"".join(f.read_bytes() for f in files)
    workers = {json.loads(x).get("worker") for x in data.splitlines()}
    assert workers == {0, 1}
    assert all(f.stat().st_size <= 6 * 1024 for f in files)
    _no_secret_anywhere(data)
    with pytest.raises(Broken) as e:  # the CLI's own answer to this: tests/unit
        verify([files[1], files[0], *files[2:]])
    assert (e.value.file, e.value.line) == (str(files[0]), 1)


def _confdir_public(confdir: Path) -> Path:
    out = subprocess.run([*SANDGATE, "audit", "public-key", "--confdir", str(confdir)],
                         capture_output=True, text=True, check=True)
    path = confdir.parent / "confdir.pub"
    path.write_text(out.stdout)
    return path


def test_workers_writing_to_stdout_chain_each_their_lines(tmp_path, vault, upstream, pki):
    """Bounds: 2 workers, no --audit (the supervisor relays their lines to stdout); 3 requests.
    """
    import os
    import signal
    import socket
    import time

    from tests.integration.conftest import UPSTREAM_IP, Proxy, free_port

    port = free_port()
    out, log = tmp_path / "stdout.jsonl", tmp_path / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VAULT_")}
    env.update(VAULT_ADDR=vault.addr, VAULT_TOKEN=vault.root_token)
    proc = subprocess.Popen(
        [*SANDGATE, "run", "--policies", str(HERE / "policies"), "--listen", f"{LISTEN}:{port}",
         "--confdir", str(tmp_path / "conf"), "--upstream-ca", str(pki.ca_cert),
         f"--resolve=upstream.test={UPSTREAM_IP}", "--workers", "2"],
        stdout=out.open("wb"), stderr=log.open("wb"), env=env)
    p = Proxy(LISTEN, port, tmp_path / "conf", out, log, proc)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, p.logs()[-2000:]
            try:
                socket.create_connection((LISTEN, port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        token = p.token("bash-tool")
        for i in range(3):
            r = curl(p, "bash-tool", f"https://upstream.test/docs/{i}", token=token)
            assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, p.logs()[-2000:]
    r = _verify(out, public=_confdir_public(tmp_path / "conf"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 chain(s)" in r.stdout, r.stdout
