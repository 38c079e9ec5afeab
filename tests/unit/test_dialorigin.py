"""dialorigin.py: each upstream dial is approved from its own flow, not from the connection."""

from __future__ import annotations

import base64
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import connection
from mitmproxy.proxy import commands, server_hooks
from mitmproxy.test import taddons, tflow

from sandgate.addons.gate import Gate, GateConfig
from sandgate.audit import events as audit
from sandgate.identity.resolve import Identifier
from sandgate.mitm import registry
from sandgate.mitm.guards import dialorigin
from sandgate.policy.loader import load_policy_dir
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.tokens import issue_token

KEY = b"k" * 32
# Two names on one address, each under its own rule (as two tunnels of one HTTP/2 connection
# to the proxy port would have them).
POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: a, hosts: [a.example], methods: [GET], schemes: [http],
         private_cidrs: [127.0.0.0/8]}
      - {name: b, hosts: [b.example], methods: [GET], schemes: [http],
         private_cidrs: [127.0.0.0/8]}
"""


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    (tmp_path / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(tmp_path)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    sink = audit.AuditLog(tmp_path / "audit.jsonl")
    return Gate(GateConfig(policy=policy, broker=broker, identifier=Identifier(KEY), audit=sink,
                           resolve_overrides={"a.example": "127.0.0.7",
                                              "b.example": "127.0.0.7"}))


def _flow(host: str, client: connection.Client | None = None) -> Any:
    f = tflow.tflow()
    if client is not None:
        f.client_conn = client
    f.request.scheme = "http"  # (a unit test has no CONNECT; the dial is approved the same way)
    f.request.host = host
    f.request.port = 80
    f.request.headers["host"] = host
    tok = issue_token(KEY, "agent", ttl_seconds=60)
    f.request.headers["proxy-authorization"] = "Basic " + base64.b64encode(
        f"agent:{tok}".encode()).decode()
    return f


def _dial_of(f: Any) -> tuple[connection.Server, server_hooks.ServerConnectionHookData]:
    server = connection.Server(address=(f.request.host, f.request.port))
    dialorigin.note(server, f)  # what the HttpLayer wrapper records for the asking stream
    return server, server_hooks.ServerConnectionHookData(server=server, client=f.client_conn)


async def test_two_requests_on_one_connection_each_dial_their_own_name(gate: Gate) -> None:
    """Both requests pin (the same IP) before either dials: each dial still verifies the name
    its own request was judged for. Kept per connection, the first dial took the second
    request's name as its SNI."""
    with taddons.context(gate):
        a = _flow("a.example")
        b = _flow("b.example", client=a.client_conn)
        await gate.request(a)
        await gate.request(b)
        assert a.response is None and b.response is None
        assert a.request.host == b.request.host == "127.0.0.7"
        server_a, data_a = _dial_of(a)
        server_b, data_b = _dial_of(b)
        await gate.server_connect(data_a)
        await gate.server_connect(data_b)
        assert (server_a.error, server_a.sni) == (None, "a.example")
        assert (server_b.error, server_b.sni) == (None, "b.example")


async def test_a_dial_without_its_flow_is_refused(gate: Gate) -> None:
    """An address some request on the connection was approved for is not enough: the dial must
    come from that request."""
    with taddons.context(gate):
        a = _flow("a.example")
        await gate.request(a)
        stray = connection.Server(address=(a.request.host, a.request.port))
        data = server_hooks.ServerConnectionHookData(server=stray, client=a.client_conn)
        await gate.server_connect(data)
        assert stray.error is not None and "not approved" in stray.error


async def test_a_dial_is_approved_once(gate: Gate) -> None:
    with taddons.context(gate):
        a = _flow("a.example")
        await gate.request(a)
        server, data = _dial_of(a)
        assert dialorigin.take(server) is a
        await gate.server_connect(data)  # its record was taken: not approved a second time
        assert server.error is not None


def test_wrapper_records_the_asking_flow_and_forwards_replies() -> None:
    f = tflow.tflow()
    server = connection.Server(address=("127.0.0.1", 443))
    event = object()
    replies: list[Any] = []

    def original(self: Any, event: Any, *, reuse: bool = True
                 ) -> Generator[commands.Command, Any, None]:
        replies.append((yield commands.OpenConnection(server)))
        replies.append((yield commands.Log("done")))

    class Layer:
        command_sources = {event: type("Stream", (), {"flow": f})()}

    wrapped = dialorigin._wrap_get_connection(original)
    gen = wrapped(Layer(), event)
    first = next(gen)
    assert isinstance(first, commands.OpenConnection)
    assert gen.send("reply-1").message == "done"  # type: ignore[attr-defined]
    with pytest.raises(StopIteration):
        gen.send("reply-2")
    assert replies == ["reply-1", "reply-2"]
    assert dialorigin.take(server) is f
    assert dialorigin.take(server) is None


def test_pending_records_are_bounded() -> None:
    f = tflow.tflow()
    servers = [connection.Server(address=("127.0.0.1", 443))
               for _ in range(dialorigin.MAX_PENDING + 3)]
    for s in servers:
        dialorigin.note(s, f)
    assert dialorigin.take(servers[0]) is None
    assert dialorigin.take(servers[-1]) is f
    for s in servers:
        dialorigin.forget(s)


def test_patched_source_is_pinned() -> None:
    """The wrapper relies on HttpLayer.get_connection making each new upstream connection for
    the stream in command_sources, and its OpenConnection passing up through it: a mitmproxy
    that changes that source must be looked at again."""
    assert registry.patch("dialorigin").changed() == []
