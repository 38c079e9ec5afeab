"""tunnels.py: one tunnel record per CONNECT stream (keyed by the stream's upstream Server)."""

from __future__ import annotations

from mitmproxy import connection
from mitmproxy.test import tflow

from sandgate.identity.base import Caller
from sandgate.mitm.guards import tunnels
from sandgate.stages.flow import Conn, Tunnel


def _tunnel(host: str) -> Tunnel:
    caller = Caller(identity="agent", sandbox=None, source="token")
    return Tunnel(caller=caller, host=host, port=443, rule=None, passthrough=False)


def test_each_stream_finds_its_own_tunnel():
    conn, client = Conn(), tflow.tclient_conn()
    a, b = connection.Server(address=None), connection.Server(address=None)
    tunnels.put(conn, client, a, _tunnel("a.example"))
    tunnels.put(conn, client, b, _tunnel("b.example"))
    found_a, found_b = tunnels.get(conn, client, a), tunnels.get(conn, client, b)
    assert found_a is not None and found_a.host == "a.example"
    assert found_b is not None and found_b.host == "b.example"
    assert tunnels.get(conn, client, connection.Server(address=None)) is None
    assert conn.tunnel is found_b  # the latest, for counting


def test_records_are_bounded_oldest_first():
    conn, client = Conn(), tflow.tclient_conn()
    servers = [connection.Server(address=None) for _ in range(tunnels.MAX_TUNNELS + 2)]
    for i, s in enumerate(servers):
        tunnels.put(conn, client, s, _tunnel(f"h{i}.example"))
    assert len(conn.tunnels) == tunnels.MAX_TUNNELS
    assert tunnels.get(conn, client, servers[0]) is None  # forgotten: refused, not misjudged
    assert tunnels.get(conn, client, servers[-1]) is not None
