"""The stages of a request through Sandgate, one module each, in the order a request meets them.

    context.py        what every stage shares: GateConfig, GateState (policy, connections,
                      the secret set), record(flow) -> FlowRecord
    s10_identify.py   who is calling: connection admission, Proxy-Authorization, SOCKS5, tunnel
    s20_head.py       judge the head: bounds, parse, decide; gateway re-targeting; CONNECT
    s30_body.py       judge the body: the head once more, size as received, credential leaks
    s35_call.py       judge the call: JSON-RPC / MCP messages against mcp:/jsonrpc: rules
    s36_sigv4.py      judge what a SigV4 signature covers: operation, copy sources, x-amz-*
    s38_ask.py        hold for approval: an `action: ask` rule's request waits for people
    s40_forward.py    the head the upstream receives is the one judged (before injection)
    s50_inject.py     the rule's credentials, from Vault at request time
    s55_sign.py       AWS SigV4: Sandgate signs the request (`inject: {sign: NAME}`)
    s60_dial.py       resolve once, pin the checked address; server_connect dials only that
    s70_scrub.py      ask for plain bytes; scrub the response head, body, trailers, WebSocket;
                      MCP session ids bound, list answers filtered (stages/rpccalls.py)
    s80_refuse.py     where a refusal (from any stage) becomes the answer
    s90_audit.py      one event per flow (every stage ends here)

and what they share besides context.py (no number: not a step of the path):

    flow.py           the per-connection (tunnel, approved dials) and per-flow record
    forward.py        what is judged is what is forwarded (s20_head, s30_body, s40_forward)
    clienthello.py    a captured ClientHello judged as the CONNECT it stands for (s15_capture)
    rpccalls.py       the JSON-RPC / MCP work of s35_call and of s70_scrub's list answers
    wsrpc.py          the same over WebSocket (s70_scrub)

Why `sNN_` names: a module name cannot start with a digit, and the number makes `ls` show the
path a request takes. The numbers go in tens, as unit files and rule files do, so a stage that
comes between two others gets a free number (as `s35_call.py` did) and nothing is renamed.

Each stage is a function over the proxy-wide state (`GateState`, which the addon is), the flow
and its per-flow record (`FlowRecord`, stages/flow.py); it raises a `Refused` to refuse, and
leaves what later stages need in the record. The addon (addons/gate.py) holds mitmproxy's hooks
only: each hook calls stages, wrapped by `guarded` so that any exception refuses (fail closed).
Imports point backwards along the path (a stage uses earlier ones), except that every stage may
end in s80_refuse or s90_audit; a stage never imports sandgate.addons (the hooks call stages,
not the other way round).

Adding a stage (a new credential type, an approval hold): write it as

    async def step(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None

in a new module numbered for where it belongs, and add it as one line to `HEAD_PATH` (judged
before the body is read: anything that needs only the head) or `REQUEST_PATH` (the complete
request, before it is forwarded) in addons/gate.py, in order. Raise a `Refused` (errors.py) to
refuse; s80_refuse answers it and s90_audit records it. A stage that answers the flow itself
(sets rec.refusal and flow.response, as s35_call does with JSON-RPC errors) ends the path.
A stage for the response side is called from the response hooks the same way.
"""
