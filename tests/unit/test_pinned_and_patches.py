"""Pinned mitmproxy options and the patches to mitmproxy 11.0.2 that no hook can make."""

from __future__ import annotations

import json

import h11
import pytest
from mitmproxy import exceptions, options
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import _http1, _http2, _http3, _http_h2
from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError
from mitmproxy.test import taddons, tflow

from sandgate.addons.pinned import _PINNED, Pinned, check_sets, pinned
from sandgate.mitm.guards import corrections
from sandgate.refusal import REASON_HEADER


async def test_every_pinned_option_exists_in_this_mitmproxy():
    # A rename in a mitmproxy upgrade must fail here, not silently unpin an option.
    from mitmproxy import master
    from mitmproxy.addons import default_addons

    m = master.Master(options.Options())
    m.addons.add(*default_addons())
    assert set(_PINNED) <= set(m.options.keys())


@pytest.mark.parametrize("spec", ["stream_large_bodies=1k", "mode=socks5",
                                  "validate_inbound_headers=false", "connection_strategy=eager",
                                  "ssl_insecure=true", "ignore_hosts=.*", " scripts = x.py",
                                  # new in mitmproxy 12
                                  "emudhra=true", "emudhra_old=true",
                                  "store_streamed_bodies=true", "tcp_timeout=86400"])
def test_set_of_a_pinned_option_is_refused(spec):
    with pytest.raises(ValueError, match="pinned by Sandgate"):
        check_sets([spec])


def test_the_idle_timeout_is_mitmproxys_tcp_timeout_in_whole_seconds():
    # mitmproxy 12 reads its idle watchdog's timeout from the tcp_timeout option (an int)
    assert pinned("1m", None, idle_timeout=1.5)["tcp_timeout"] == 2
    assert pinned("1m", None, idle_timeout=300)["tcp_timeout"] == 300
    assert pinned("1m", None, idle_timeout=None)["tcp_timeout"] == 600  # off: mitmproxy's own


def test_set_of_other_options_is_allowed():
    check_sets(["termlog_verbosity=warn", "http2=false"])


async def test_pinned_values_cannot_change_at_run_time():
    from mitmproxy.addons import default_addons

    values = pinned("1m", None)
    addon = Pinned(values)
    extra = [a for a in default_addons() if type(a).__name__ != "Core"]
    with taddons.context(*extra, addon) as tctx:
        tctx.options.update(**{k: v for k, v in values.items() if k in tctx.options})
        with pytest.raises(exceptions.OptionsError):
            tctx.options.update(stream_large_bodies="1k")
        assert tctx.options.stream_large_bodies is None
        with pytest.raises(exceptions.OptionsError):
            tctx.options.update(connection_strategy="eager")
        assert tctx.options.connection_strategy == "lazy"


def test_patches_install_once_and_replace_error_pages():
    corrections.install()
    corrections.install()
    assert corrections.installed()
    for status, code in [(400, "bad_request"), (413, "too_large"), (502, "upstream_error"),
                         (504, "upstream_timeout")]:
        raw = _http1.make_error_response(status, "Bad HTTP response line: b'FAKE-SECRET'")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"FAKE-SECRET" not in raw and b"<html>" not in raw
        assert REASON_HEADER.lower().encode() in head.lower()
        doc = json.loads(body)
        assert doc["code"] == code and doc["status"] == status
        for mod in (_http2, _http3):
            assert b"FAKE-SECRET" not in mod.format_error(status, "FAKE-SECRET")



def test_sandgate_timeouts_are_answered_504_on_http1_and_http2():
    # mitmproxy 12's error codes have no 504 (ErrorCode.http_status_code): an error whose
    # message carries TIMEOUT_MARK (wirelimits' upstream timeouts) is answered 504 anyway.
    corrections.install()
    message = f"{corrections.TIMEOUT_MARK}: nothing from the upstream for 1s"
    raw = _http1.make_error_response(502, message)
    assert raw.startswith(b"HTTP/1.1 504 ")
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["code"] == "upstream_timeout"
    assert json.loads(_http2.format_error(502, message))["code"] == "upstream_timeout"
    assert json.loads(_http2.format_error(502, "other"))["code"] == "upstream_error"

    # HTTP/2: mitmproxy's error branch sends its page's headers (":status" 502, no message)
    import h2.config
    import h2.connection
    import h2.events

    def status_sent(event: ResponseProtocolError) -> dict[bytes, bytes]:
        server = _http_h2.BufferedH2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        client.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "https"),
                                (":authority", "example.com")], end_stream=True)
        server.initiate_connection()
        server.receive_data(client.data_to_send())

        class Layer:  # the part of an Http2Connection its error branch uses
            h2_conn = server

        def branch(self, ev):  # mitmproxy's error branch, reduced to the call patched
            self.h2_conn.send_headers(1, [(b":status", b"502"), (b"server", b"mitmproxy"),
                                          (b"content-type", b"text/html")])
            yield from ()

        list(corrections._h2_error_status(branch)(Layer(), event))
        assert getattr(server, corrections._H2_STATUS, None) is None  # only for that page
        got = client.receive_data(server.data_to_send())
        (resp,) = [e for e in got if isinstance(e, h2.events.ResponseReceived)]
        return dict(resp.headers)

    timeout = status_sent(ResponseProtocolError(1, message, ErrorCode.GENERIC_SERVER_ERROR))
    assert timeout[b":status"] == b"504"
    assert timeout[REASON_HEADER.lower().encode()] == b"upstream_timeout"
    other = status_sent(ResponseProtocolError(1, "other", ErrorCode.GENERIC_SERVER_ERROR))
    assert other[b":status"] == b"502"
    assert other[REASON_HEADER.lower().encode()] == b"upstream_error"


def test_http1_trailers_are_dropped_not_fatal():
    corrections.install()
    reader = _http1.make_body_reader(None)  # chunked
    from h11._receivebuffer import ReceiveBuffer

    buf = ReceiveBuffer()
    buf += b"5\r\nhello\r\n0\r\nX-Trailer: FAKE-SECRET\r\n\r\n"
    events = []
    while True:
        ev = reader(buf)
        if ev is None:
            break
        events.append(ev)
        if isinstance(ev, h11.EndOfMessage):
            break
    assert isinstance(events[-1], h11.EndOfMessage) and not events[-1].headers


def test_body_size_limit_is_for_requests_only():
    corrections.install()

    class Stream:
        flow = tflow.tflow(resp=True)

    gen = http_layer.HttpStream.check_body_size(Stream(), False)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value is False


def test_a_response_read_whole_is_held_to_the_body_size_limit():
    """The answer to an MCP initialize is buffered whole (stages/rpccalls.py) although its length
    is not known: past body_size_limit it is ended with an error, never buffered on."""
    corrections.install()

    class Options:
        stream_large_bodies = None
        body_size_limit = "16"

    class Context:
        options = Options()
        client = server = None

    class Stream:
        context = Context()
        flow = tflow.tflow(resp=True)
        stream_id = 1
        request_body_buf = bytearray()
        response_body_buf = bytearray(b"x" * 10)
        state_errored = None

    def run(stream: Stream) -> bool:
        gen = http_layer.HttpStream.check_body_size(stream, False)
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            return bool(stop.value)

    Stream.flow.metadata[corrections.READ_WHOLE] = True
    assert run(Stream()) is False  # within the limit
    Stream.response_body_buf += b"x" * 10
    assert run(Stream()) is True and Stream.flow.error is not None
    del Stream.flow.metadata[corrections.READ_WHOLE]
    assert run(Stream()) is False  # any other response is streamed: no limit
