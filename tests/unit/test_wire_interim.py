"""wirelimits.drop_interim: 1xx heads from an HTTP/1 upstream are dropped, the final one kept."""

from __future__ import annotations

import pytest
from h11._receivebuffer import ReceiveBuffer
from hypothesis import given
from hypothesis import strategies as st

from sandgate.mitm.guards.wirelimits import drop_interim

FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
_CODES = st.integers(100, 199).filter(lambda c: c != 101)
_HEAD = st.tuples(_CODES, st.sampled_from([b"", b"Link: </a.css>\r\n", b"X-A: 1\r\nX-B: 2\r\n"]))


def _buf(data: bytes) -> ReceiveBuffer:
    b = ReceiveBuffer()
    b += data
    return b


@given(st.lists(_HEAD, max_size=4), st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
def test_every_interim_head_before_the_final_one_is_dropped(heads, version):
    data = b"".join(version + b" %d X\r\n" % c + extra + b"\r\n" for c, extra in heads)
    buf = _buf(data + FINAL)
    assert drop_interim(buf) == len(heads)
    assert bytes(buf) == FINAL


@pytest.mark.parametrize("data", [
    FINAL,
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",  # not interim: kept
    b"HTTP/1.1 100 Continue\r\n",  # incomplete: wait for the rest
    b"HTTP/1.1 1000 X\r\n\r\n",  # not a 1xx status
])
def test_nothing_else_is_dropped(data):
    buf = _buf(data)
    assert drop_interim(buf) == 0
    assert bytes(buf) == data
