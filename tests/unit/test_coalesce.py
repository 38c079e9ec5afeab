"""coalesce: consecutive SendData to one connection leave as one, bytes and order unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import connection
from mitmproxy.proxy import commands

from sandgate.mitm.speedups import coalesce

pytestmark = pytest.mark.unit

A = connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=0)
B = connection.Server(address=("example.com", 443))


def _drive(gen: Generator[Any, Any, None], replies: dict[int, Any]) -> list[Any]:
    """Run a layer generator the way mitmproxy's Layer does, answering blocking commands."""
    out: list[Any] = []
    reply = None
    while True:
        try:
            cmd = gen.send(reply)
        except StopIteration:
            return out
        out.append(cmd)
        reply = replies.get(id(cmd))


def _flatten(cmds: list[Any]) -> list[tuple[str, Any, bytes]]:
    """The commands as (kind, connection, bytes), adjacent sends to one connection merged."""
    flat: list[tuple[str, Any, bytes]] = []
    for c in cmds:
        if type(c) is commands.SendData:
            if flat and flat[-1][0] == "send" and flat[-1][1] is c.connection:
                flat[-1] = ("send", c.connection, flat[-1][2] + c.data)
            else:
                flat.append(("send", c.connection, c.data))
        else:
            flat.append(("other", c, b""))
    return flat


step = st.one_of(
    st.tuples(st.just("send"), st.sampled_from([A, B]), st.binary(max_size=40)),
    st.tuples(st.just("big"), st.sampled_from([A, B]), st.just(b"x" * (coalesce.MAX_JOIN + 1))),
    st.tuples(st.just("other"), st.sampled_from([A, B]), st.just(b"")),
)


@given(st.lists(step, max_size=12))
def test_same_bytes_same_order_fewer_pieces(steps: list[tuple[str, Any, bytes]]) -> None:
    made: list[Any] = []

    def layer() -> Generator[Any, Any, None]:
        for kind, conn, data in steps:
            c: commands.Command
            if kind == "other":
                c = commands.CloseConnection(conn)
            else:
                c = commands.SendData(conn, data)
            made.append(c)
            yield c

    merged = _drive(coalesce._coalesced(layer()), {})
    assert _flatten(merged) == _flatten(made)
    # never two sends to one connection in a row unless a join would pass MAX_JOIN
    for a, b in itertools.pairwise(merged):
        if type(a) is type(b) is commands.SendData and a.connection is b.connection:
            assert len(a.data) + len(b.data) > coalesce.MAX_JOIN
    assert all(len(c.data) <= coalesce.MAX_JOIN for c in merged
               if type(c) is commands.SendData and c not in made)


def test_held_data_goes_before_a_blocking_command_and_replies_reach_the_layer() -> None:
    hook = commands.OpenConnection(B)
    got: list[Any] = []

    def layer() -> Generator[Any, Any, None]:
        yield commands.SendData(A, b"head")
        yield commands.SendData(A, b"body")
        got.append((yield hook))  # the reply to the blocking command comes back in
        yield commands.SendData(A, b"after")

    out = _drive(coalesce._coalesced(layer()), {id(hook): "the reply"})
    assert [(type(c).__name__, getattr(c, "data", None)) for c in out] == [
        ("SendData", b"headbody"), ("OpenConnection", None), ("SendData", b"after")]
    assert got == ["the reply"]


def test_install_wraps_the_http_layer_once() -> None:
    from mitmproxy.proxy.layers import http as http_layer

    coalesce.install()
    wrapped = http_layer.HttpLayer._handle_event
    coalesce.install()
    assert coalesce.installed() and http_layer.HttpLayer._handle_event is wrapped
