"""What the policy says about one request: `sandgate explain` and `POST /v1/explain` both print
what `explain` returns, so the two can never disagree. The verdict is `decision.judge`: the
proxy's request parser, decision and (where the address is known) address step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sandgate.decision import (
    Decision,
    Verdict,
    decide_name,
    decide_request,
    judge,
    reported,
    shown_outcome,
)
from sandgate.errors import BadRequest, Code, Refused
from sandgate.llm.llmcall import CallUnreadable, LlmCall, recognise
from sandgate.llm.llmcall import read_call as read_llm_call
from sandgate.policy.ask import ask_fields
from sandgate.policy.call_rules import call_fields
from sandgate.policy.model import Policy
from sandgate.request import parse_url
from sandgate.review.prerequisites import rule_unreachable
from sandgate.rpc.callbody import header_mismatch, read_call
from sandgate.rpc.jsonrpc import Call
from sandgate.secrets.aws_request import signed_fields
from sandgate.secrets.describe import credential_forms, describe, sign_text

_NO_OVERRIDES: Mapping[str, str] = {}


def explain(policy: Policy, identity: str, method: str, url: str,
            resolve: Mapping[str, str] = _NO_OVERRIDES, sandbox: str | None = None,
            gateway: bool = False, call: Call | None = None,
            websocket: bool = False, headers: Sequence[tuple[str, str]] = (),
            body: bytes | None = None,
            llm: LlmCall | None = None) -> tuple[dict[str, Any], bool]:
    """(the explanation, allowed). Raises ValueError (a BadRequest) for a request that cannot
    be judged. Secrets appear by name only. `resolve` pins names as `sandgate run --resolve`
    does, so that the address step can be shown; `sandbox` is the caller's sandbox id (None: a
    caller without one); `gateway`: the URL is what a gateway path maps to (no CONNECT);
    `call`: the JSON-RPC call the body carries (judged by the rules' mcp:/jsonrpc:, as the
    proxy judges the body); `websocket`: the request opens a WebSocket (with `call`: the call
    is a message on it); `headers`: (name, value) pairs the request carries (a signing rule
    judges those a SigV4 signature covers, and the MCP metadata headers the call stage checks
    against the call); `body`: the request body as sent, read as the proxy's call stage reads
    it (`judge_body`; instead of `call`; an LLM call in it is read as the proxy's LLM stage
    reads it). `llm`: the LLM call the body makes (model, max_tokens), judged by the rules'
    `llm:` as the proxy judges the body. A tunnelled request is "allowed" (it is forwarded)
    with decision `tunnel`."""
    if body is not None and (call is not None or websocket):
        raise ValueError("give the body or the call (mcp_tool, rpc_method, mcp_resource, a "
                         "WebSocket message), not both")
    v = judge(policy, identity, method, url, resolve, sandbox, gateway, call,
              "websocket" if websocket else None, headers, llm)
    if not websocket:
        v, call = judge_body(policy, identity, method, url, resolve, sandbox, gateway, v,
                             body, headers, call)
        if llm is None and body and v.decision.allowed:
            v, llm = judge_llm_body(policy, identity, method, url, resolve, sandbox, gateway,
                                    v, body, headers, call)
    d = v.decision
    decision = shown_outcome(policy, identity, d)
    report = decision == "report"
    ident = policy.identities.get(identity)
    out: dict[str, Any] = {
        "identity": identity,
        "sandbox": sandbox,
        "request": v.request + (" (opening a WebSocket)" if websocket else ""),
        "decision": decision,
        **_why(d),
        "address": v.address,
    }
    if v.connect or d.tunnel:
        out["passthrough"] = v.passthrough
    if d.tunnel and not v.connect:
        out["tunnel"] = ("forwarded uninspected: the proxy never sees this request (any method, "
                         "path or query), injects nothing and scrubs nothing")
    out.update(call_fields(d, call))
    if llm is not None:
        out["llm"] = llm_fields(d, llm)
    if websocket and d.allowed and d.rule is not None and d.rule.llm is not None:
        out.setdefault("llm", {})["websocket"] = (
            "websocket: true: the Responses API's WebSocket may be opened; each "
            "response.create on it is judged as a POST body is (model, output cap), a refused "
            "call answered with the API's error event"
            + ("" if llm is not None else "; pass --model NAME to judge one"))
    if d.ask and d.rule is not None and d.rule.ask is not None:
        out["approval"] = ask_fields(d.rule.ask)
    if ident is not None and ident.mode != "enforce":
        out["mode"] = ident.mode
    if report:
        out["report"] = ("identity in report mode: forwarded without any credential and "
                         "audited as `report`; address and safety checks still apply")
    if d.allowed and d.rule is not None and not v.connect and not d.tunnel:
        inj = d.rule.inject
        would: list[str] = []
        if inj is not None:
            would += [f"header {n}: from secret(s) {', '.join(sorted(t.secrets)) or '-'}"
                      for n, t in inj.headers]
            if inj.basic is not None:
                s = inj.basic[0].secrets | inj.basic[1].secrets
                would.append(f"basic auth: from secret(s) {', '.join(sorted(s))}")
            would += [f"query {n}: from secret(s) {', '.join(sorted(t.secrets))}"
                      for n, t in inj.query]
        if inj is not None and inj.sign is not None:
            would.append(sign_text(policy, inj.sign, parse_url(method, url).host))
            out["signed"] = signed_fields(d.rule, parse_url(method, url).query, headers)
        if d.rule.substitute_body:
            would.append("body (JSON string values, form field values): placeholder of "
                         f"secret(s) {', '.join(sorted(d.rule.substitute))}; refused if one "
                         "cannot be swapped")
        out["inject"] = would
        out["credentials"] = {n: describe(policy.secrets[n], d.rule.github_scope)
                              for n in sorted(d.rule.secrets)
                              if n in policy.secrets}
        # what a fixture's `inject:` entry may say instead of the secret's name
        out["credential_forms"] = credential_forms(policy, d.rule, parse_url(method, url).host)
        out["placeholders_honoured"] = sorted(d.rule.secrets)
        out["trace_context"] = trace_context(d.rule.forward_trace_context)
        unmet = rule_unreachable(policy, identity, d.rule)
        if unmet:  # what `sandgate check` reports as an error: 503 at run time
            out["credentials_unavailable"] = [f"{u.message}. Fix: {u.fix}" for u in unmet]
    if d.rule is not None:
        out["private_cidrs"] = [str(n) for n in d.rule.private_cidrs]
        if d.allowed and d.rule.max_request_bytes is not None:
            out["max_request_bytes"] = d.rule.max_request_bytes  # the proxy's limit may be lower
        if d.rule.public:
            out["public"] = ("any host that resolves only to public addresses: the proxy "
                             "refuses the host if any of its addresses is non-public")
    return out, d.allowed


def judge_llm_body(policy: Policy, identity: str, method: str, url: str,
                   resolve: Mapping[str, str], sandbox: str | None, gateway: bool,
                   head: Verdict, body: bytes, headers: Sequence[tuple[str, str]],
                   call: Call | None) -> tuple[Verdict, LlmCall | None]:
    """The verdict once an LLM call's body is read, as the proxy's LLM stage (s37_llm) reads
    it: recognised by the provider's host or the allowing rule's `llm: {api}`, read by
    `llmcall.read_call` (an unreadable body is refused, bad_request), judged again with it."""
    rule = head.decision.rule
    req = parse_url(method, url)
    api = recognise(method, req.host, req.path,
                    rule.llm.api if rule is not None and rule.llm is not None else None)
    if api is None:
        return head, None
    try:
        llm = read_llm_call(api, req.path, body)
    except CallUnreadable as e:
        return dataclasses.replace(head, decision=Decision(
            False, Code.BAD_REQUEST, f"the LLM call cannot be judged: {e}",
            hint="send one JSON object, each key once",
            detail="the LLM stage refuses the body before any rule judges it")), None
    return judge(policy, identity, method, url, resolve, sandbox, gateway, call, None,
                 headers, llm), llm


def judge_body(policy: Policy, identity: str, method: str, url: str,
               resolve: Mapping[str, str], sandbox: str | None, gateway: bool, head: Verdict,
               body: bytes | None, headers: Sequence[tuple[str, str]], call: Call | None
               ) -> tuple[Verdict, Call | None]:
    """The verdict once the body is read, as the proxy's call stage reaches it: only where a
    rule with `mcp:`/`jsonrpc:` matched the head (`call_limit`; elsewhere the body is not a
    call to judge) the body is read by `callbody.read_call`, the MCP headers are checked
    against the call (the body's, or `call` given instead of a body, which `head` already
    judged), and the request is judged again with the call. Returns the verdict and the call.
    The call stage comes before the sandbox step (the proxy's s50_inject) and the dial: a
    refused body is refused whatever the sandbox, so the head it reads is `decide_request`'s,
    not `head` (which has both steps)."""
    if head.connect:
        return head, call
    d = decide_request(policy, identity, parse_url(method, url), gateway)
    if d.call_limit is None or d.tunnel:
        return head, call

    def lookup(name: str) -> Sequence[str]:
        return [v for n, v in headers if n.lower() == name.lower()]

    def refused(e: Refused) -> Verdict:
        return dataclasses.replace(head, decision=Decision(
            False, e.code, e.reason, hint=e.hint,
            detail="the call stage refuses the body before any rule judges it"))

    given = call is not None
    try:
        if body:
            call = read_call(d.call_limit, body, next(iter(lookup("content-encoding")), None))
    except BadRequest as e:
        return refused(e), None
    mismatch = header_mismatch(lookup, call)
    if mismatch is not None:
        return refused(mismatch), call
    if given or call is None:
        return head, call
    return judge(policy, identity, method, url, resolve, sandbox, gateway, call, None,
                 headers), call


def explain_request(policy: Policy, identity: str, method: str, url: str,
                    resolve: Mapping[str, str] = _NO_OVERRIDES, sandbox: str | None = None,
                    gateway: bool = False, call: Call | None = None, websocket: bool = False,
                    headers: Sequence[tuple[str, str]] = (), body: bytes | None = None,
                    llm: LlmCall | None = None) -> tuple[dict[str, Any], bool]:
    """`explain`, where with `gateway` the URL is a gateway path (e.g. /anthropic/v1/messages):
    mapped to its upstream request by the gateway listener's own `route`, then judged as the
    gateway judges it (no CONNECT precedes it). Raises ValueError for a path no gateway serves
    and for a bad request. `call`: the JSON-RPC call the body carries, `websocket`: the
    request opens a WebSocket (see `explain`)."""
    if not gateway:
        return explain(policy, identity, method, url, resolve, sandbox, call=call,
                       websocket=websocket, headers=headers, body=body, llm=llm)
    from sandgate.gateway import gateway_url

    upstream, gw = gateway_url(policy.gateways, method, url)
    out, allowed = explain(policy, identity, method, upstream, resolve, sandbox, gateway=True,
                           call=call, websocket=websocket, headers=headers, body=body,
                           llm=llm)
    return {"gateway": gw.prefix, "gateway_path": url, **out}, allowed


def llm_fields(d: Decision, llm: LlmCall) -> dict[str, Any]:
    """What explain says of an LLM call: what it asks for, the cap it is forwarded with, and
    the budget it is counted against."""
    f = d.rule.llm if d.allowed and d.rule is not None else None
    out: dict[str, Any] = {"model": llm.model, "max_tokens": llm.max_tokens}
    if f is not None:
        if d.lower_max_tokens is not None:
            out["forwarded_max_tokens"] = d.lower_max_tokens
        out["budget"] = f.budget
    return out


def _why(d: Decision) -> dict[str, Any]:
    """The fields every explanation gives of its decision: which rule, where it is written,
    the code, and why (the same for a request and for a name)."""
    return {"rule": d.rule_name, "rule_source": str(d.rule.source) if d.rule else None,
            "code": str(d.code) if d.code else None, "reason": d.reason, "hint": d.hint,
            "detail": d.detail}


def explain_name(policy: Policy, identity: str, qname: str, qtype: str = "A"
                 ) -> tuple[dict[str, Any], bool]:
    """What the policy DNS (`sandgate run --dns`) answers `identity` for `qname` (`qtype`):
    (the explanation, resolves). The same `decide_name` the DNS server calls."""
    d = decide_name(policy, identity, qname, qtype)
    # `mode: report`: a name the rules refuse is answered all the same, and audited as report
    report = reported(policy, identity, d)
    out: dict[str, Any] = {
        "identity": identity,
        "dns": qname,
        "type": qtype.upper(),
        "decision": "report" if report else "resolve" if d.allowed else "refuse",
        **_why(d),
        "answer": ("the addresses Sandgate's own resolver gives (the ones it will dial), "
                   "TTL and count bounded; CNAMEs followed by Sandgate" if d.allowed or report
                   else
                   "NXDOMAIN (or REFUSED, per --dns-refuse); the name is never asked upstream"),
    }
    if d.allowed and d.rule is not None and d.rule.public:
        out["public"] = ("public: true: only public addresses are answered, as only those "
                         "are dialled")
    if report:
        out["report"] = ("identity in report mode: answered as if allowed and audited as "
                         "`report`")
    return out, d.allowed or report


def trace_context(forwarded: bool) -> str:
    """What happens to the sandbox's traceparent/tracestate (sandgate.audit.export.traceparent)."""
    return ("traceparent/tracestate forwarded to the upstream as sent (forward_trace_context)"
            if forwarded else "traceparent/tracestate removed before forwarding")
