"""Refuse: the one place a raised refusal becomes what the sandbox (or the dialler) sees.

Any stage raises a `Refused`; the hook's `guarded` wrapper (addons/gate.py) brings it here.
What cannot be judged at all (raw TCP/UDP bytes in a tunnel no passthrough rule allows, DNS
carried through a CONNECT) is refused here as well.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mitmproxy import dns, http, tcp, udp
from mitmproxy.net.dns import response_codes
from mitmproxy.proxy import server_hooks

from sandgate.audit import events as A
from sandgate.errors import Code, Refused
from sandgate.mitm.guards import wirelimits
from sandgate.refusal import Refusal
from sandgate.stages.context import GateState, record, via_gateway

log = logging.getLogger("sandgate")


def refused(st: GateState, obj: Any, error: Refused) -> None:
    """A refusal raised in a hook, answered on whatever the hook was given."""
    if isinstance(obj, http.HTTPFlow):
        refuse(obj, refusal_for(st, obj, error))
    elif isinstance(obj, server_hooks.ServerConnectionHookData):
        obj.server.error = f"sandgate: {error.code}: {error.reason}"
    else:
        fail(obj)


def refusal_for(st: GateState, flow: http.HTTPFlow, error: Refused) -> Refusal:
    """The answer for `error` on this flow: who asked, for what, with every secret scrubbed."""
    rec = record(flow)
    target = rec.info.target if rec.info is not None and flow.request.method != "CONNECT" \
        else target_of(flow.request)
    gateway = via_gateway(flow)
    if gateway and rec.info is None:
        target = A.redact_path(flow.request.path)  # no gateway matched: its own path
    identity = rec.caller.identity if rec.caller is not None else None
    refusal = Refusal.from_error(error, identity=identity, target=target, gateway=gateway)
    if rec.llm is not None:  # an LLM call: the provider's error shape (sandgate.refusal)
        refusal = dataclasses.replace(refusal, dialect=rec.llm.api)
    secrets = st.secrets(rec)
    if secrets.empty:
        return refusal
    # The reason may quote the request, and the request may quote a value.
    return dataclasses.replace(
        refusal,
        reason=secrets.scrub_text(refusal.reason)[0],
        target=secrets.scrub_text(refusal.target)[0] if refusal.target else None,
        hint=secrets.scrub_text(refusal.hint)[0] if refusal.hint else None,
    )


def drop_response(st: GateState, flow: http.HTTPFlow, error: Refused) -> None:
    """An upstream answer that cannot be forwarded: nothing of it reaches the sandbox."""
    record(flow).refusal = refusal_for(st, flow, error)
    flow.kill()


def refuse(flow: http.HTTPFlow, refusal: Refusal) -> None:
    """Answer the flow with the refusal (it is then never forwarded)."""
    record(flow).refusal = refusal
    flow.response = http.Response.make(refusal.status, refusal.body(), refusal.headers())
    if refusal.status == 407 or flow.request.method == "CONNECT" or (
            refusal.code == Code.TOO_MANY_CONNECTIONS):
        flow.response.headers["connection"] = "close"


def fail(obj: Any) -> None:
    """An exception that is not a refusal: refuse (internal_error) or end whatever it was."""
    if isinstance(obj, http.HTTPFlow):
        if obj.response is None or not record(obj).refused:
            try:
                refuse(obj, Refusal(Code.INTERNAL_ERROR,
                                    "Sandgate hit an internal error; nothing was sent",
                                    target=target_of(obj.request)))
            except Exception:
                obj.kill()
        if obj.live and obj.killable:
            obj.kill()
        return
    if isinstance(obj, server_hooks.ServerConnectionHookData):
        obj.server.error = "sandgate: internal error"
        return
    kill = getattr(obj, "kill", None)
    if callable(kill) and getattr(obj, "killable", False):
        kill()


def upstream_error(flow: http.HTTPFlow) -> None:
    """An upstream that did not answer in time is refused as upstream_timeout (not a bare
    connection error): the sandbox and the audit both say why."""
    rec = record(flow)
    if (flow.error is not None and wirelimits.TIMEOUT_MARK in flow.error.msg
            and rec.refusal is None):
        rec.refusal = Refusal(Code.UPSTREAM_TIMEOUT, "the upstream did not answer in time",
                              identity=rec.caller.identity if rec.caller else None,
                              target=rec.info.target if rec.info is not None else None)


def drop_raw(flow: tcp.TCPFlow | udp.UDPFlow) -> None:
    """Relay nothing of a raw message (mitmproxy ignores kill() in tcp_start/udp_start)."""
    flow.messages[-1].content = b""
    if flow.killable:
        flow.kill()  # type: ignore[no-untyped-call]  # mitmproxy's Flow.kill is unannotated


def refuse_dns(flow: dns.DNSFlow) -> None:
    """A CONNECT to port 53 carrying raw DNS would be resolved by mitmproxy itself: answer
    REFUSED; should even that fail, end the flow (an exception here would let it resolve)."""
    try:
        flow.response = flow.request.fail(response_codes.REFUSED)
    except Exception:
        log.exception("sandgate: dns_request failed; killing")
        if flow.killable:
            flow.kill()


def target_of(req: http.Request) -> str:
    """The request's target for an answer or the audit when it was never parsed."""
    if req.method == "CONNECT":
        return f"{req.host}:{req.port}"
    return f"{req.scheme}://{req.pretty_host}:{req.port}{A.redact_path(req.path)}"
