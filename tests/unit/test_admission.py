"""admission.py and the per-source count: no unidentified client holds slots for long."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.test import tflow

from sandgate.limits import ConnectionCounter, Limiter, LimitsConfig
from sandgate.mitm.guards import admission


def test_unidentified_connections_are_capped_per_source_and_released_on_identify():
    c = ConnectionCounter()
    assert all(c.connected(f"a{i}", None, "10.0.0.1", 3) for i in range(3))
    assert not c.connected("a3", None, "10.0.0.1", 3)  # the fourth from one source
    assert c.connected("b0", None, "10.0.0.2", 3)  # another source is not affected
    c.disconnected("a3")
    assert c.identify("a0", "agent", None)  # identified: no longer counted for its source
    assert c.connected("a4", None, "10.0.0.1", 3)
    assert c.unidentified == {"10.0.0.1": 3, "10.0.0.2": 1}


@given(st.lists(st.tuples(st.sampled_from(["connect", "identify", "close"]),
                          st.integers(0, 9), st.sampled_from(["s1", "s2"])), max_size=60))
def test_per_source_counts_match_the_open_unidentified_connections(ops):
    c = ConnectionCounter()
    open_: dict[str, str] = {}
    ident: set[str] = set()
    for op, n, source in ops:
        cid = f"c{n}"
        if op == "connect" and cid not in open_:
            c.connected(cid, None, source, None)
            open_[cid] = source
        elif op == "identify" and cid in open_:
            c.identify(cid, "agent", None)
            ident.add(cid)
        elif op == "close" and cid in open_:
            c.disconnected(cid)
            del open_[cid]
            ident.discard(cid)
    expected: dict[str, int] = {}
    for cid, source in open_.items():
        if cid not in ident:
            expected[source] = expected.get(source, 0) + 1
    assert c.unidentified == expected


def test_admit_names_the_limit_that_refused():
    lim = Limiter(LimitsConfig(max_connections=10, max_unidentified_per_source=1))
    a, b = tflow.tclient_conn(), tflow.tclient_conn()
    a.peername = b.peername = ("::ffff:10.0.0.1", 1234)  # counted as 10.0.0.1
    assert admission.admit(lim, a) is None
    reason = admission.admit(lim, b)
    assert reason is not None and "10.0.0.1" in reason and "per-source" in reason


def _handler(spoke: bool, tls: bool = False, established: bool = False):
    client = tflow.tclient_conn()
    client.tls = tls
    client.timestamp_tls_setup = 1.0 if established else None
    h = SimpleNamespace(client=client)
    if spoke:
        setattr(h, admission.SPOKE, True)
    return h


def test_deadlines_apply_only_while_unidentified():
    h = _handler(spoke=False)
    assert admission.overdue(h, "first_byte") is not None
    assert admission.overdue(_handler(spoke=True), "first_byte") is None
    assert admission.overdue(_handler(True, tls=True), "handshake") is not None
    assert admission.overdue(_handler(True, tls=True, established=True), "handshake") is None
    assert admission.overdue(_handler(True), "handshake") is None  # plain HTTP: no handshake
    assert admission.overdue(_handler(True), "identify") is not None
    admission.identified(h.client)
    try:
        assert all(admission.overdue(h, d) is None for d in ("first_byte", "handshake",
                                                              "identify"))
    finally:
        admission._identified.discard(h.client.id)
