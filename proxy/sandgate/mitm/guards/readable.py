"""Readable refusals: answer first, then close gracefully, so the client can read the answer.

mitmproxy 11.0.2 (HTTP/1 clients) loses Sandgate's answer in three places:

1. A head over `--max-header-bytes` (wirelimits) was answered 431 and the connection closed at
   once, while the client was still sending its head: the kernel answers unread data with a
   reset, which discards the 431 on the client's side (curl: "Connection died").
2. A request refused at its head (`requestheaders`) was answered only after its whole body had
   been read (and `Expect: 100-continue` got a `100 Continue` first, inviting the body), or, for
   a body over 64 KiB, the flow was killed: a reset, no answer. Now the refusal is sent at once
   (no 100 for a refused request) and the body is not kept: HTTP/1 with `Connection: close`
   and a graceful close, HTTP/2 as a complete response on the stream.
3. A body whose chunked framing h11 refuses (a quoted CR LF in a chunk extension) closed the
   connection without any answer. Now it is answered 400 `bad_request` first. h11 0.14 takes a
   chunk size of any number of hex digits (`10000000000000005`, past 2**64) and waits for that
   many bytes: the request got no answer until the idle timeout. A size past what any length
   can be (2**63 - 1, nginx's bound, an `off_t`) is now h11's protocol error: a client gets
   the 400 at once, and an upstream's answer becomes a 502.

After such an answer the connection is closed gracefully: our side is half-closed (FIN after
the answer; not inside a CONNECT tunnel, see `close_gracefully`), and what the client still
sends is read and discarded, up to DRAIN_BYTES or for DRAIN_SECONDS, whichever comes first,
then the connection is closed. Nothing drained is kept.

"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import h11
from h11 import _readers as h11_readers
from mitmproxy import http
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.proxy.layers.http._events import ResponseEndOfMessage
from mitmproxy.proxy.layers.http._hooks import HttpResponseHeadersHook

_MARK = "_sandgate_readable"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


EARLY = "sandgate-answer-early"  # flow.metadata: the refusal is sent before the body is read
DRAIN_BYTES = 1024 * 1024
DRAIN_SECONDS = 5.0


def body_pending(req: http.Request) -> bool:
    """Does the head announce a body that has not been read yet?"""
    if "transfer-encoding" in req.headers:
        return True
    try:
        return int(req.headers.get("content-length", "0") or 0) > 0
    except ValueError:
        return True


def answer_early(flow: http.HTTPFlow) -> bool:
    """A request refused at its head: no `100 Continue` for it, and, for an HTTP/1 request
    with a body still to come, the refusal is sent at once and the connection closed
    gracefully (True). False: mitmproxy's own order applies (no body, or HTTP/2)."""
    req = flow.request
    req.headers.pop("expect", None)  # mitmproxy would answer 100 Continue and read the body
    if flow.response is None:
        return False
    if req.http_version.startswith("HTTP/1"):
        if not body_pending(req):
            return False
        flow.response.headers["connection"] = "close"
    elif not req.is_http2:
        return False
    # HTTP/2: the answer ends our side of the stream; DATA the client still sends on it is
    # acknowledged and dropped (mitmproxy ignores events of a finished stream).
    flow.metadata[EARLY] = True
    return True


def close_gracefully(self: Any) -> Generator[Any, Any, None]:
    """An Http1Server that has answered: FIN after the answer, then read and discard what the
    client still sends (bounded), then close."""
    self._sg_drained = 0
    self._sg_draining = True  # from now on every read goes to _drain, whatever self.state is
    if not in_tunnel(self):
        # (inside a CONNECT tunnel mitmproxy turns any close of the inner connection into a
        # full close of the socket, a reset for a client still sending: no FIN there, the
        # client closes once it has read the answer, or the drain time ends it)
        yield commands.CloseTcpConnection(self.conn, half_close=True)
    self._sg_drain_wakeup = commands.RequestWakeup(DRAIN_SECONDS)
    yield self._sg_drain_wakeup


def in_tunnel(layer: Any) -> bool:
    """Is this connection layer inside a CONNECT tunnel (below the CONNECT's HttpStream)?"""
    return any(isinstance(x, http_layer.HttpStream) for x in layer.context.layers)


def _drain(self: Any, event: events.Event) -> Generator[Any, Any, None]:
    if isinstance(event, events.DataReceived):
        self._sg_drained += len(event.data) + len(self.buf)
        self.buf.maybe_extract_at_most(len(self.buf))  # nothing drained is kept
        if self._sg_drained <= DRAIN_BYTES:
            return
    yield from _close(self)


def _close(self: Any) -> Generator[Any, Any, None]:
    self._sg_drain_wakeup = None
    self._sg_draining = False
    self.state = self.done
    yield commands.CloseConnection(self.conn)


def drain_wakeup(self: Any, event: events.Event) -> bool:
    """Is `event` the end of this connection's drain time?"""
    return isinstance(event, events.Wakeup) and event.command is getattr(
        self, "_sg_drain_wakeup", None)


def _wrap_handle_event(original: Any) -> Any:
    def _handle_event(self: Any, event: events.Event) -> Generator[Any, Any, None]:
        if drain_wakeup(self, event):
            if getattr(self, "_sg_draining", False):
                yield from _close(self)
            return
        if getattr(self, "_sg_draining", False) and isinstance(
                event, (events.DataReceived, events.ConnectionClosed)):
            yield from _drain(self, event)
            return
        yield from original(self, event)

    return _handle_event


def _wrap_send(original: Any) -> Any:
    def send(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from original(self, event)
        response = self.response
        if (isinstance(event, ResponseEndOfMessage) and not self.request_done
                and response is not None and not getattr(self, "_sg_draining", False)
                and self.state != self.done
                and "close" in response.headers.get("connection", "").lower()):
            # answered (and told the client so) before its body was read: stop reading it
            yield from close_gracefully(self)

    return send


def _wrap_read_body(original: Any) -> Any:
    def read_body(self: Any, event: events.Event) -> Generator[Any, Any, None]:
        from sandgate.mitm.guards.wirelimits import bad_request_response

        for command in original(self, event):  # read_body yields no blocking command
            if (isinstance(command, commands.CloseConnection) and command.connection is self.conn
                    and self.response is None and self.request is not None):
                # h11 refused the body's framing: mitmproxy closes without any answer
                yield commands.SendData(self.conn, bad_request_response(
                    "the request body's chunked framing is malformed"))
                yield from close_gracefully(self)
                continue
            yield command

    return read_body


def _wrap_request_headers(original: Any) -> Any:
    def state_wait_for_request_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from original(self, event)
        flow = self.flow
        if (flow is not None and flow.metadata.get(EARLY) and flow.response is not None
                and self.client_state == self.state_consume_request_body):
            # The refusal goes out now; the body is never read (the connection drains below).
            self.client_state = self.state_errored
            flow.response.timestamp_start = time.time()
            yield HttpResponseHeadersHook(flow)
            yield from self.send_response()
            if self.server_state == self.state_done:
                yield from self.flow_done()  # ResponseEndOfMessage: the Http1Server closes

    return state_wait_for_request_headers


MAX_CHUNK = 2**63 - 1


def _wrap_chunked(original: Any) -> Any:
    def __call__(self: Any, buf: Any) -> Any:
        out = original(self, buf)
        # a size line read just now: its size is what is left plus what this call returned
        if (isinstance(out, h11.Data) and out.chunk_start
                and self._bytes_in_chunk + len(out.data) > MAX_CHUNK):
            raise h11.RemoteProtocolError("chunk size larger than any body can be")
        return out

    return __call__


def install() -> None:
    reader = h11_readers.ChunkedReader
    if not getattr(reader, _MARK, False):
        reader.__call__ = _wrap_chunked(reader.__call__)  # type: ignore[method-assign]
        setattr(reader, _MARK, True)
    srv = _http1.Http1Server
    if getattr(srv, _MARK, False):
        return
    srv.send = _wrap_send(srv.send)  # type: ignore[method-assign]
    srv.read_body = _wrap_read_body(srv.read_body)  # type: ignore[method-assign]
    srv._handle_event = _wrap_handle_event(srv._handle_event)  # type: ignore[method-assign]
    stream = http_layer.HttpStream
    stream.state_wait_for_request_headers = _wrap_request_headers(  # type: ignore[method-assign]
        stream.state_wait_for_request_headers)
    setattr(srv, _MARK, True)


def installed() -> bool:
    return bool(getattr(_http1.Http1Server, _MARK, False)) and bool(
        getattr(h11_readers.ChunkedReader, _MARK, False))
