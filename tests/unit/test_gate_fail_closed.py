"""An exception inside a hook refuses the flow; nothing unapproved is dialled."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from mitmproxy.proxy import server_hooks
from mitmproxy.test import taddons, tflow

from sandgate.addons.gate import Gate, GateConfig
from sandgate.audit import events as audit
from sandgate.identity.resolve import Identifier
from sandgate.mitm.guards import dialorigin
from sandgate.policy.loader import load_policy_dir
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.stages import s20_head, s70_scrub
from sandgate.tokens import issue_token

KEY = b"k" * 32
POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: docs, hosts: [docs.example], methods: [GET], schemes: [http],
         private_cidrs: [127.0.0.0/8]}
"""


@pytest.fixture
def gate(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(tmp_path)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    sink = audit.AuditLog(tmp_path / "audit.jsonl")
    g = Gate(GateConfig(policy=policy, broker=broker, identifier=Identifier(KEY), audit=sink,
                        resolve_overrides={"docs.example": "127.0.0.1"}))
    g.audit_path = tmp_path / "audit.jsonl"  # type: ignore[attr-defined]
    return g


def plain_flow(path: str = "/x"):
    f = tflow.tflow()
    f.request.scheme = "http"
    f.request.host = "docs.example"
    f.request.port = 80
    f.request.path = path
    f.request.headers["host"] = "docs.example"
    import base64

    tok = issue_token(KEY, "agent", ttl_seconds=60)
    f.request.headers["proxy-authorization"] = "Basic " + base64.b64encode(
        f"agent:{tok}".encode()).decode()
    return f


async def test_allowed_plain_request_pins_checked_address(gate):
    with taddons.context(gate):
        f = plain_flow()
        await gate.request(f)
        assert f.response is None
        assert f.request.host == "127.0.0.1"  # dial the checked address
        assert f.request.headers["host"] == "docs.example"
        assert "proxy-authorization" not in f.request.headers


async def test_exception_in_request_hook_refuses(gate, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(s20_head, "decide", boom)
    with taddons.context(gate):
        f = plain_flow()
        await gate.request(f)
        assert f.response is not None and f.response.status_code == 503
        assert f.response.headers["x-sandgate-reason"] == "internal_error"
        assert b"bug" not in f.response.content  # no internals to the sandbox


async def test_exception_in_responseheaders_kills_flow(gate, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(s70_scrub, "ResponseScrubber", boom)
    with taddons.context(gate):
        f = plain_flow()
        await gate.request(f)
        f.response = tflow.tresp()
        await gate.responseheaders(f)
        assert f.error is not None  # killed: nothing reaches the sandbox


async def test_exception_while_streaming_the_body_cuts_it(gate, monkeypatch):
    """An exception in the scrubber of a streamed body (the joined-text layer included): the
    flow is killed and nothing more of the body is sent, never the unscrubbed bytes."""
    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(s70_scrub.ResponseScrubber, "__call__", boom)
    with taddons.context(gate):
        f = plain_flow()
        await gate.request(f)
        f.response = tflow.tresp(content=b"")
        del f.response.headers["content-length"]
        f.response.headers["content-type"] = "text/event-stream"
        await gate.responseheaders(f)
        stream = f.response.stream
        assert callable(stream)
        assert stream(b"data: unscrubbed\n\n") == []
        assert f.error is not None


async def test_server_connect_refuses_unapproved_address(gate):
    with taddons.context(gate):
        f = tflow.tflow()
        f.server_conn.address = ("10.9.9.9", 80)
        data = server_hooks.ServerConnectionHookData(server=f.server_conn, client=f.client_conn)
        await gate.server_connect(data)
        assert data.server.error and "not approved" in data.server.error


async def test_server_connect_allows_only_what_request_approved(gate):
    with taddons.context(gate):
        f = plain_flow()
        await gate.request(f)
        f.server_conn.address = (f.request.host, f.request.port)
        dialorigin.note(f.server_conn, f)  # the dial this request asked for (HttpLayer)
        data = server_hooks.ServerConnectionHookData(server=f.server_conn, client=f.client_conn)
        await gate.server_connect(data)
        assert not data.server.error
        assert ipaddress.ip_address(data.server.address[0]).is_loopback


async def test_unknown_identity_and_no_token(gate):
    with taddons.context(gate):
        f = plain_flow()
        del f.request.headers["proxy-authorization"]
        await gate.request(f)
        assert f.response is not None and f.response.status_code == 407
        assert "Proxy-Authenticate" in f.response.headers


async def test_every_decision_audited_once(gate):
    import json

    with taddons.context(gate):
        f = plain_flow("/y?token=abc")
        del f.request.headers["proxy-authorization"]
        await gate.request(f)
        gate.response(f)
        gate.response(f)
    lines = gate.audit_path.read_text().splitlines()
    assert len(lines) == 1
    ev = json.loads(lines[0])
    assert ev["decision"] == "challenge" and ev["code"] == "auth_required"  # no credentials
    assert ev["path"] == "/y?token=REDACTED"


async def test_canary_in_any_encoding_is_refused_and_audited(gate):
    import base64
    import json

    from sandgate.tokens import canary

    decoy = canary(KEY, "agent")
    assert decoy == canary(KEY, "agent") and decoy != canary(KEY, "other")
    gate.cfg.canaries = {"canary:agent": decoy}
    gate._scrub_sets.invalidate()  # the set is rebuilt on the next use
    with taddons.context(gate):
        for body in (decoy.encode(), base64.b64encode(decoy.encode()), decoy.upper().encode()):
            f = plain_flow()
            f.request.content = b"data=" + body
            await gate.requestheaders(f)
            await gate.request(f)
            assert f.response is not None and f.response.status_code == 403
            assert f.response.headers["x-sandgate-reason"] == "exfiltration"
            assert decoy.encode() not in f.response.content
            gate.response(f)
    events = [json.loads(line) for line in gate.audit_path.read_text().splitlines()]
    assert len(events) == 3
    assert all(e["code"] == "exfiltration" and any(x.startswith("canary:agent:")
                                                    for x in e["exfiltration"]) for e in events)


async def test_requestheaders_refuses_before_the_body(gate):
    with taddons.context(gate):
        f = plain_flow()
        del f.request.headers["proxy-authorization"]
        f.request.headers["content-length"] = str(10 * 1024 * 1024)
        await gate.requestheaders(f)
        assert f.response is not None and f.response.status_code == 407
        # answered now, before the body, which is never read (mitm/guards/readable.py)
        assert f.metadata["sandgate-answer-early"] is True
        assert f.response.headers["connection"] == "close"
        h2 = plain_flow()
        del h2.request.headers["proxy-authorization"]
        h2.request.http_version = "HTTP/3"  # neither HTTP/1 nor HTTP/2: mitmproxy's order
        h2.request.headers["content-length"] = str(10 * 1024 * 1024)
        await gate.requestheaders(h2)
        assert h2.error is not None  # killed: the large body is never read


async def test_nothing_is_forwarded_while_the_audit_log_cannot_be_written(gate):
    gate.cfg.audit.healthy = False  # as after a failed write (disk full, closed pipe)
    with taddons.context(gate):
        f = plain_flow()
        await gate.requestheaders(f)
        await gate.request(f)
        assert f.response is not None and f.response.status_code == 503
        assert f.response.headers["x-sandgate-reason"] == "audit_unavailable"
        gate.cfg.audit_best_effort = True
        f = plain_flow()
        await gate.requestheaders(f)
        await gate.request(f)
        assert f.response is None  # forwarded: the operator chose best effort


async def test_dns_over_a_tunnel_is_refused_or_killed(gate, monkeypatch):
    with taddons.context(gate):
        f = tflow.tdnsflow()
        gate.dns_request(f)
        assert f.response is not None and f.response.response_code == 5  # REFUSED

        f = tflow.tdnsflow()

        def boom(*a, **k):
            raise RuntimeError("bug")

        monkeypatch.setattr(f.request, "fail", boom)
        gate.dns_request(f)
        assert f.error is not None  # killed: mitmproxy never resolves it


async def test_a_failed_rotation_refuses_what_follows(gate, monkeypatch, tmp_path):
    """The rename of a full audit file fails (read-only directory): the flow's audit write
    fails, and the next request is refused until a write succeeds (docs/audit.md)."""
    from sandgate.audit import file as audit_file
    from sandgate.audit.chain import Chain

    gate.cfg.audit = audit.AuditLog(tmp_path / "rot.jsonl", chain=Chain(None),
                                    rotation=audit_file.Rotation(max_bytes=1024))
    gate.cfg.audit.emit("pad", pad="x" * 900)

    def refuse(*a):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(audit_file.os, "rename", refuse)
    with taddons.context(gate):
        f = plain_flow()
        await gate.requestheaders(f)
        await gate.request(f)
        gate.response(f)  # its audit event: the rotation fails, the write with it
        assert not gate.cfg.audit.healthy
        f = plain_flow()
        await gate.requestheaders(f)
        await gate.request(f)
        assert f.response is not None and f.response.status_code == 503
        assert f.response.headers["x-sandgate-reason"] == "audit_unavailable"
