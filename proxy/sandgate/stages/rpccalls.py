"""The call stage: the JSON-RPC / MCP messages of a request body, judged before it goes on, and
the server's answers to list calls filtered to what the identity may call.

Request side (`judge_call`, from Gate.request once the bounded body is complete): a rule with
`mcp:` or `jsonrpc:` matched the head (Decision.call_limit); the body is parsed strictly
(sandgate.rpc.jsonrpc) and the request decided again with the call, by sandgate.decision.decide,
the one decision function `explain`, fixtures and proofs use. A well-formed call that is refused
is answered as a JSON-RPC error for each of its ids (`answer_call`), in the transport the
client asked for; anything that is not a well-formed call gets the HTTP refusal.

Response side: the `Mcp-Session-Id` a response carries is handed to the client wrapped, bound by
a MAC to the identity whose request it answered and the server (sandgate.rpc.mcpsession: no state,
so it holds across workers, replicas and restarts); a request presents it back and is forwarded
with the upstream's own id only if the MAC verifies for its identity and host:port (another
identity's id, or any id Sandgate did not issue, is refused); the id is also bound to the
protocol version the initialize answer names. Answers to tools/list, resources/list,
resources/templates/list, prompts/list and server/discover (JSON or server-sent events, every
page) keep only the entries the identity may call, judged by the same decide(), and are
cacheable by their caller only (cacheScope private).

MCP's metadata headers (Mcp-Method, Mcp-Name, MCP-Protocol-Version) must agree with the body
(sandgate.rpc.mcpheaders): a disagreement is answered 400 with MCP's HeaderMismatch error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from mitmproxy import http

from sandgate.decision import decide, reported
from sandgate.errors import BadRequest, Code, Refused
from sandgate.policy.model import Policy
from sandgate.refusal import REASON_HEADER, Refusal
from sandgate.request import RequestInfo
from sandgate.rpc import mcpheaders
from sandgate.rpc.callbody import header_mismatch, read_call
from sandgate.rpc.jsonrpc import Call, CallError, Id, id_key, loads
from sandgate.rpc.mcpheaders import HEADER_MISMATCH_CODE
from sandgate.rpc.mcpsession import SessionIdError, unwrap_bound, wrap
from sandgate.stages.flow import CallState, FlowRecord

SESSION_HEADER = "mcp-session-id"
# The JSON-RPC error code of a call Sandgate refused (implementation-defined server range);
# error.data.sandgate says why, as the HTTP refusal body would.
REFUSED_CODE = -32003
# A list answer is parsed whole (JSON) or per event (SSE): at most this much at once.
MAX_LIST_BODY = 8 * 1024 * 1024

# A list in a result: (the result member, the member naming an entry, the call that uses an
# entry). A resource template is kept when resources/read of the template itself (its text,
# placeholders and all) would be allowed: the policy's globs must cover it.
_TOOLS = ("tools", "name", "tools/call")
_RESOURCES = ("resources", "uri", "resources/read")
_TEMPLATES = ("resourceTemplates", "uriTemplate", "resources/read")
_PROMPTS = ("prompts", "name", "prompts/get")
# list method -> the lists its result may carry (server/discover, of the 2026-07-28 revision,
# names none in the spec; any it carries is filtered all the same)
LISTS = {
    "tools/list": (_TOOLS,),
    "resources/list": (_RESOURCES,),
    "resources/templates/list": (_TEMPLATES,),
    "prompts/list": (_PROMPTS,),
    "server/discover": (_TOOLS, _RESOURCES, _TEMPLATES, _PROMPTS),
}
# A filtered result is this identity's view: cacheable at most by this caller (MCP's
# `cacheScope`: "public" lets any cache serve it to anyone; "private" only within the same
# authorization context, which behind Sandgate is the identity's own).
PRIVATE = "private"


# ------------------------------------------------------------------------- the request side

def judge_call(rec: FlowRecord, req: http.Request, policy: Policy,
               session_key: bytes) -> Refused | None:
    """Judge the call in a complete request body (rec: the flow's FlowRecord). Returns the
    refusal to answer as JSON-RPC errors (see answer_call), None to go on (rec.decision is then
    the decision with the call); raises a Refused for an HTTP-level refusal."""
    d = rec.decision
    if d is None or d.call_limit is None or rec.caller is None or rec.info is None:
        return None
    identity, info = rec.caller.identity, rec.info
    bound = open_session(req, session_key, identity, info)
    state = rec.call = CallState(policy, identity, info, session_version=bound)
    body = req.raw_content or b""
    if not body:  # nothing to act on (a GET stream, a DELETE of the session): its headers?
        return _headers_agree(req, state)
    call = read_call(d.call_limit, body, req.headers.get("content-encoding"))
    state.call = call
    mismatch = _headers_agree(req, state)
    if mismatch is not None:
        return mismatch
    final = rec.decision = decide(policy, identity, info, call)
    state.outcomes = outcomes(state, call, final.allowed)
    for m in call.messages:
        if m.kind == "request" and m.method in LISTS and m.id is not None:
            state.lists[id_key(m.id)] = m.method
        if m.kind == "request" and m.method == "initialize" and m.id is not None:
            state.init_id = id_key(m.id)
    if final.allowed:
        return None
    if reported(policy, identity, final):
        rec.reported = True  # forwarded without credentials; audited as `report`
        return None
    if not call.ids:
        raise final.refused()  # notifications only: there is no id to answer
    return final.refused()


def open_session(req: http.Request, key: bytes, identity: str, info: RequestInfo
                 ) -> str | None:
    """The Mcp-Session-Id the request carries (a GET stream, a call, the DELETE that ends the
    session: all alike) replaced by the upstream's own id, if Sandgate issued it to this
    identity for this host:port; refused otherwise, so no id reaches the upstream unverified.
    Returns the protocol version the session was bound to, if any (MCP-Protocol-Version must
    then be that one: mcpheaders)."""
    values = req.headers.get_all(SESSION_HEADER)
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest(Code.BAD_REQUEST, f"the Mcp-Session-Id header is given {len(values)} "
                         "times; send the session id once")
    try:
        sid, version = unwrap_bound(key, identity, info.host, info.port, values[0],
                                    mcpheaders.KNOWN_VERSIONS)
    except SessionIdError as e:
        raise Refused(Code.SESSION_MISMATCH, f"this MCP session id cannot be used by "
                      f"{identity}: {e}",
                      hint="open a session of your own through Sandgate (initialize without "
                      "Mcp-Session-Id) and send back the id Sandgate answers with") from None
    req.headers[SESSION_HEADER] = sid.decode("utf-8", "surrogateescape")
    return version


def _headers_agree(req: http.Request, state: CallState) -> Refused | None:
    """MCP's Mcp-Method / Mcp-Name / MCP-Protocol-Version against the body (mcpheaders): the
    refusal to answer as a JSON-RPC error when they disagree, whatever the policy says."""
    refused = header_mismatch(req.headers.get_all, state.call, state.session_version)
    if refused is not None:
        state.outcomes = ["deny"] * (len(state.call.messages) if state.call else 0)
    return refused


def outcomes(state: CallState, call: Call, allowed: bool) -> list[str]:
    """Per message of a judged call: allow, deny, or batch (the audit's `rpc[].decision`)."""
    if allowed:
        return ["allow"] * len(call.messages)
    if not call.batch:
        return ["deny"]
    return ["batch" if decide(state.policy, state.identity, state.info,
                              Call((m,))).allowed else "deny" for m in call.messages]


def rpc_errors(call: Call | None, refusal: Refusal) -> list[dict[str, Any]]:
    """The JSON-RPC error answering each request id of a refused call (over HTTP or on a
    WebSocket, sandgate.stages.wsrpc: the same shape); no id: one error with a null id."""
    mismatch = refusal.code == Code.HEADER_MISMATCH
    ids: tuple[Id | None, ...] = call.ids if call is not None else ()
    return [{"jsonrpc": "2.0", "id": i,
             "error": {"code": HEADER_MISMATCH_CODE if mismatch else REFUSED_CODE,
                       "message": refusal.reason,
                       "data": {"sandgate": refusal.doc()}}} for i in ids or (None,)]


def answer_call(flow: http.HTTPFlow, rec: FlowRecord, refusal: Refusal) -> None:
    """Answer a refused call as JSON-RPC errors, one per request id (all of a batch): JSON, or
    server-sent events when the client accepts only those. Headers that disagree with the body
    are answered `400` with MCP's HeaderMismatch error (as the spec has servers and
    intermediaries answer them), in JSON, for each id (no id: one error with a null id)."""
    call = rec.call.call if rec.call is not None else None
    mismatch = refusal.code == Code.HEADER_MISMATCH
    assert call is not None or mismatch
    rec.refusal = refusal
    errors = rpc_errors(call, refusal)
    accept = flow.request.headers.get("accept", "").lower()
    headers = {REASON_HEADER: str(refusal.code)}
    batch = call is not None and call.batch
    if mismatch:
        body = json.dumps(errors if batch else errors[0]).encode()
        headers["Content-Type"] = "application/json"
        flow.response = http.Response.make(refusal.status, body, headers)
        return
    if "text/event-stream" in accept and "application/json" not in accept and "*/*" not in accept:
        body = b"".join(b"event: message\ndata: " + json.dumps(e).encode() + b"\n\n"
                        for e in errors)
        headers["Content-Type"] = "text/event-stream"
    else:
        body = json.dumps(errors if batch else errors[0]).encode()
        headers["Content-Type"] = "application/json"
    flow.response = http.Response.make(200, body, headers)


# ------------------------------------------------------------------------ the response side

def response_headers(rec: FlowRecord, resp: http.Response, session_key: bytes) -> bool:
    """The session id the upstream hands out, wrapped: bound to the identity it answered and
    to the server (sandgate.rpc.mcpsession), and to the protocol version of the session: the one
    the request's own session id was bound to or, on the answer to initialize, the one that
    answer names. That answer's ids are held back (no raw id goes out) until its body is read:
    True means the response must be read whole (s70_scrub), and filter_whole issues them."""
    state: CallState | None = rec.call
    if state is None:
        return False
    values = resp.headers.get_all(SESSION_HEADER)
    if not values:
        return False
    if not all(values):
        raise Refused(Code.UPSTREAM_ERROR, "the upstream answered with an empty MCP session id")
    if state.session_version is None and state.init_id is not None and \
            200 <= resp.status_code < 300 and resp.status_code not in (204, 205):
        resp.headers.pop(SESSION_HEADER)
        state.pending = (session_key, values)
        return True
    _issue(state, resp, session_key, values, state.session_version)
    return False


def _issue(state: CallState, resp: http.Response, key: bytes, values: list[str],
           version: str | None) -> None:
    info = state.info
    resp.headers.set_all(SESSION_HEADER, [
        wrap(key, state.identity, info.host, info.port, v.encode("utf-8", "surrogateescape"),
             version) for v in values])


def _filtering(rec: FlowRecord, resp: http.Response) -> CallState | None:
    state: CallState | None = rec.call
    if state is None or not (state.lists or state.pending) or not 200 <= resp.status_code < 300:
        return None
    return state


def _sse(resp: http.Response) -> bool:
    return "text/event-stream" in resp.headers.get("content-type", "").lower()


def filter_whole(rec: FlowRecord, resp: http.Response) -> None:
    """A buffered answer (already scrubbed) with list results: filtered in place; the answer
    to initialize: its session ids issued, bound to the version it names."""
    state = _filtering(rec, resp)
    if state is None:
        return
    body = resp.content or b""
    if _sse(resp):
        f = _SseFilter(state)
        resp.content = b"".join([f.feed(body), f.feed(b"")])
    else:
        resp.content = _filter_json(state, body)
    if state.pending is not None:
        key, values = state.pending
        state.pending = None
        version = state.negotiated if state.negotiated in mcpheaders.KNOWN_VERSIONS else None
        _issue(state, resp, key, values, version)


def wrap_stream(rec: FlowRecord, flow: http.HTTPFlow,
                stream: Callable[[bytes], bytes | list[bytes]]
                ) -> Callable[[bytes], bytes | list[bytes]]:
    """A streamed answer: the scrubber first (it decodes), then the list filter."""
    resp = flow.response
    assert resp is not None
    state = _filtering(rec, resp)
    if state is None:
        return stream
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    resp.headers.pop("content-length", None)  # filtering changes the length
    if flow.request.http_version == "HTTP/1.1" and resp.http_version in ("HTTP/1.0",
                                                                         "HTTP/1.1"):
        resp.http_version = "HTTP/1.1"
        if "chunked" not in resp.headers.get("transfer-encoding", "").lower():
            resp.headers["transfer-encoding"] = "chunked"
    flt: _SseFilter | _JsonFilter = _SseFilter(state) if _sse(resp) else _JsonFilter(state)

    def filtered(chunk: bytes) -> list[bytes]:
        out: list[bytes] = []
        try:
            if encoding not in ("", "identity") and "content-encoding" in resp.headers:
                raise ValueError("an encoded list answer cannot be filtered")
            for part in _parts(stream(chunk)):
                piece = flt.feed(part)
                if piece:
                    out.append(piece)
            if not chunk:
                tail = flt.feed(b"")
                if tail:
                    out.append(tail)
        except ValueError:  # unreadable: nothing more of it reaches the client
            flt.overflow = True
        if flt.overflow:
            if flow.killable:
                flow.kill()
            return []
        return out

    return filtered


def _parts(out: bytes | Iterable[bytes]) -> list[bytes]:
    return [out] if isinstance(out, bytes) else list(out)


class _JsonFilter:
    def __init__(self, state: CallState) -> None:
        self._state = state
        self._buf = bytearray()
        self.overflow = False

    def feed(self, chunk: bytes) -> bytes:
        if chunk:
            self._buf += chunk
            if len(self._buf) > MAX_LIST_BODY:
                self.overflow = True
            return b""
        return _filter_json(self._state, bytes(self._buf)) if not self.overflow else b""


_LINE = re.compile(rb"\r\n|\r|\n")


class _SseFilter:
    """Server-sent events, one event at a time; events answering a list call are rewritten.

    (Its event framing duplicates sandgate.scrub.deltas.SseFramer, which the joined-text scrub
    uses; one framer for both is left for a change that may alter behaviour: this one keeps
    the lines of an event, that one its bytes.)"""

    def __init__(self, state: CallState) -> None:
        self._state = state
        self._buf = b""
        self._lines: list[bytes] = []
        self._size = 0
        self.overflow = False

    def feed(self, chunk: bytes) -> bytes:
        if self.overflow:
            return b""
        out: list[bytes] = []
        self._buf += chunk
        while True:
            m = _LINE.search(self._buf)
            # a trailing CR may be the first half of CRLF: wait for the next chunk
            if m is None or (m.group() == b"\r" and m.end() == len(self._buf) and chunk):
                break
            line, self._buf = self._buf[:m.start()], self._buf[m.end():]
            if line:
                self._lines.append(line)
                self._size += len(line)
            else:
                out.append(self._event(self._lines))
                self._lines, self._size = [], 0
        if self._size + len(self._buf) > MAX_LIST_BODY:
            self.overflow = True
            return b""
        if not chunk:  # the end: an unfinished event is discarded, as the SSE spec says
            self._buf, self._lines = b"", []
        return b"".join(out)

    def _event(self, lines: list[bytes]) -> bytes:
        data = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
        if data:
            new = _filter_doc(self._state, b"\n".join(data))
            if new is not None:
                lines = [ln for ln in lines if not ln.startswith(b"data:")]
                lines.append(b"data: " + new)
        return b"".join(ln + b"\n" for ln in lines) + b"\n"


def filter_message(state: CallState, data: bytes) -> bytes | None:
    """One JSON text (a WebSocket message from the server) with its list results filtered;
    None when nothing in it answers a list call. Raises CallError for an unreadable list
    answer (sandgate.stages.wsrpc)."""
    return _filter_doc(state, data)


def _filter_json(state: CallState, body: bytes) -> bytes:
    new = _filter_doc(state, body)
    return body if new is None else new


def _filter_doc(state: CallState, data: bytes) -> bytes | None:
    """The JSON text with list results filtered; None when nothing in it answers a list call.
    A list answer that cannot be read strictly raises (the response is dropped)."""
    try:
        doc = loads(data)
    except CallError:
        if _answers_list(state, data):
            raise
        return None
    changed = False
    for msg in doc if isinstance(doc, list) else [doc]:
        if not isinstance(msg, dict) or "id" not in msg or not isinstance(msg.get("result"),
                                                                          dict):
            continue
        mid = msg["id"]
        if isinstance(mid, bool) or not isinstance(mid, int | str):
            continue
        if state.pending is not None and id_key(mid) == state.init_id:
            version = msg["result"].get("protocolVersion")
            state.negotiated = version if isinstance(version, str) else None
        method = state.lists.get(id_key(mid))
        if method is None:
            continue
        changed = _filter_result(state, msg["result"], LISTS[method]) or changed
    return json.dumps(doc, ensure_ascii=False).encode() if changed else None


def _filter_result(state: CallState, result: dict[str, Any],
                   lists: tuple[tuple[str, str, str], ...]) -> bool:
    """One list result (one page: each page is an answer of its own, cursor or not) filtered
    in place, its cache scope narrowed to the caller; False if it carries no list."""
    filtered = False
    for member, key, use in lists:
        if member not in result:
            continue
        entries = result[member]
        if not isinstance(entries, list):  # not readable as a list: not passed on
            raise ValueError(f"the list answer's {member} is not a list")
        kept = [e for e in entries if isinstance(e, dict) and isinstance(e.get(key), str)
                and state.may(use, e[key])]
        state.removed += len(entries) - len(kept)
        result[member] = kept
        filtered = True
    if filtered and ("cacheScope" in result or "ttlMs" in result):
        # ttlMs (how long it stays fresh) holds; who may reuse it narrows to this caller
        result["cacheScope"] = PRIVATE
    return filtered


def _answers_list(state: CallState, data: bytes) -> bool:
    """Unreadable text that might still answer a list call (then it is not passed on)."""
    return bool(state.lists) and b'"result"' in data
