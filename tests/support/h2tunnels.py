"""An HTTP/2 client of the proxy port itself: TLS to Sandgate with ALPN h2 and several CONNECT
streams on the one connection (the `h2` library for framing, Python's ssl). Every wait has a
deadline.

mitmproxy 11.0.2 answered a CONNECT stream with a 200 that ends the stream (END_STREAM), so
nothing came back through such a tunnel; what the client sent on the stream still reached
the tunnel's layers and was judged there. mitmproxy 12.3.1 (h2 4.4) serves no CONNECT over
HTTP/2 at all: either spelling ends the connection (tests/integration/test_wire.py).
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events


@dataclass
class Stream:
    sid: int
    status: int | None = None
    inbound: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: bool = False


class H2Proxy:
    def __init__(self, host: str, port: int, ca: str, timeout: float = 10) -> None:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection((host, port), timeout=timeout)
        self.sock = ctx.wrap_socket(raw, server_hostname=host)
        assert self.sock.selected_alpn_protocol() == "h2", self.sock.selected_alpn_protocol()
        # (h2 checks requests as if every one had a :path; a CONNECT has none, RFC 9113 8.5)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False))
        self.h2.initiate_connection()
        self.streams: dict[int, Stream] = {}
        self.timeout = timeout
        self._flush()

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, wait: float = 0.2) -> None:
        """Read once (up to `wait` seconds) and file each event under its stream."""
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return
        if not data:
            raise ConnectionError("the proxy closed the HTTP/2 connection")
        for ev in self.h2.receive_data(data):
            st = self.streams.get(getattr(ev, "stream_id", 0) or 0)
            if isinstance(ev, h2.events.ResponseReceived) and st is not None:
                st.status = int(dict(ev.headers)[b":status"])
            elif isinstance(ev, h2.events.DataReceived) and st is not None:
                st.inbound += ev.data
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded) and st is not None:
                st.ended = True
            elif isinstance(ev, h2.events.StreamReset) and st is not None:
                st.reset = True
        self._flush()

    def connect(self, target: str, auth: str, rfc9113: bool = True) -> Stream:
        sid = self.h2.get_next_available_stream_id()
        st = self.streams[sid] = Stream(sid)
        # RFC 9113 8.5: :method and :authority only; h2 4.1 (mitmproxy 11's) wanted :scheme
        # and :path too, and mitmproxy 11 served that form (rfc9113=False)
        headers = [(b":method", b"CONNECT"), (b":authority", target.encode())]
        if not rfc9113:
            headers += [(b":scheme", b"https"), (b":path", b"/")]
        self.h2.send_headers(sid, [*headers, (b"proxy-authorization", auth.encode())])
        self._flush()
        deadline = time.monotonic() + self.timeout
        while st.status is None and not st.reset and time.monotonic() < deadline:
            self.pump()
        return st

    def send(self, st: Stream, data: bytes) -> None:
        self.h2.send_data(st.sid, data)
        self._flush()

    def close(self) -> None:
        self.sock.close()


def inner_h2_request(host: str, path: str) -> bytes:
    """The bytes of an HTTP/2 connection preface and one GET, to send inside a tunnel."""
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    c.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", host),
                       (":path", path)], end_stream=True)
    return c.data_to_send()
