"""Judge the LLM call: model, output cap and budget of an inference request (sandgate.llm.llmcall,
sandgate.llm.spend), once its body is complete.

A request to a provider's host (or on a rule with `llm: {api}`) that is an inference call is
read strictly (model, output cap, streaming) and decided again with it by the one decide() that
explain and fixtures use: a rule whose `llm.models` does not list the model, or whose
`max_tokens` the call exceeds (`on_max_tokens: refuse`), does not match (403 model_not_allowed,
400 max_tokens_over_cap, unless a later rule allows it). Then the body is made what the rule
says (the cap lowered; an OpenAI stream asked for its usage chunk, taken out of the answer
again by s70_scrub), and the call's worst case is reserved against its budget (429
spend_exhausted; Redis down: 503 state_unavailable). Every refusal from here on is answered in
the provider's own error format (sandgate.refusal), so the SDK raises its usual error.

The usage is read from the answer as it passes (s70_scrub) and settled when the flow ends
(sandgate.llm.spend.settle, from s90_audit).
"""

from __future__ import annotations

import dataclasses

from mitmproxy import http

from sandgate.decision import decide, reported
from sandgate.errors import BadRequest, Code, Refused
from sandgate.llm.llmcall import (
    KNOWN_HOSTS,
    CallUnreadable,
    read_call,
    recognise,
    with_max_tokens,
    with_usage_chunk,
)
from sandgate.llm.spend import (
    LlmFlow,
    amounts,
    budget_key,
    model_label,
    price_of,
    settled,
    worst_case,
)
from sandgate.policy.model import Rule
from sandgate.policy.paths import normalise_path
from sandgate.stages import s30_body
from sandgate.stages.context import GateState
from sandgate.stages.flow import FlowRecord

# Where clients carry an API key: OpenAI and others (authorization), Anthropic (x-api-key),
# Azure OpenAI (api-key), Gemini (x-goog-api-key, or a `key` query parameter).
CREDENTIAL_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
CREDENTIAL_QUERY = "key"


def own_credentials(flow: http.HTTPFlow, rec: FlowRecord, rule: Rule) -> None:
    """On a rule with `llm:` that injects a credential, only Sandgate's credential may reach
    the metered API: a credential the sandbox brought itself (in a place the rule's injection
    does not overwrite, holding no placeholder of the policy's) is refused (403
    own_credential, `own_credentials: refuse`, the default) or removed (`replace`); the audit
    says which (`injected`)."""
    f, inj = rule.llm, rule.inject
    if f is None or inj is None or rec.reported:
        return
    req = flow.request
    set_headers = {n for n, _ in inj.headers} | ({"authorization"} if inj.basic else set())
    set_query = {n for n, _ in inj.query}
    placeholders = tuple(rec.placeholders or ())
    found: list[str] = []
    for name in CREDENTIAL_HEADERS:
        if name in set_headers:
            continue  # overwritten by the injection
        values = req.headers.get_all(name)
        if values and not all(any(p in v for p in placeholders) for v in values):
            found.append(f"header {name}")
    if CREDENTIAL_QUERY not in set_query and rec.info is not None and rec.info.query:
        values = [v for n, v in rec.info.query if n.lower() == CREDENTIAL_QUERY]
        if values and not all(any(p in v for p in placeholders) for v in values):
            found.append(f"query {CREDENTIAL_QUERY}")
    if not found:
        return
    where = ", ".join(found)
    if f.own_credentials == "refuse":
        rec.injected.append(f"the sandbox's own credential ({where}): refused")
        raise Refused(Code.OWN_CREDENTIAL, f"the request carries a credential of its own "
                      f"({where}) to an API whose key Sandgate injects (rule '{rule.name}')",
                      hint="remove the key from the client (use the placeholder): Sandgate "
                      "sets the credential itself")
    for item in found:
        kind, _, name = item.partition(" ")
        if kind == "header":
            del req.headers[name]
        else:
            req.query = [(n, v) for n, v in req.query.items(multi=True)
                         if n.lower() != CREDENTIAL_QUERY]
    rec.injected.append(f"the sandbox's own credential ({where}): removed")


async def judge(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The LLM stage: nothing to do unless the allowed request is an inference call. A rule
    with `llm:` judges it strictly (an unreadable body is refused); on a rule without, a
    provider's call is only read for its usage (an unreadable one is left alone)."""
    head = rec.decision
    if head is None or not head.allowed or head.tunnel or head.rule is None \
            or rec.caller is None or rec.info is None:
        return
    rule = head.rule
    # the path as the decision (and the upstream) reads it: `/v1/%6Dessages` is a Messages
    # call too, and a Gemini model is named by its decoded path
    path = normalise_path(rec.info.path)
    api = recognise(flow.request.method, rec.info.host, path,
                    rule.llm.api if rule.llm is not None else None)
    if api is None:
        own_credentials(flow, rec, rule)  # any request on a metered API's rule
        return
    req = flow.request
    body = req.raw_content or b""
    compressed = req.headers.get("content-encoding", "identity").strip().lower() not in (
        "", "identity")
    if rule.llm is None:
        # no rule judges it (the first allowing rule has no `llm:`): its usage is read for the
        # audit and metrics when its body can be read, and nothing is refused for it
        try:
            call = None if compressed else read_call(api, path, body)
        except CallUnreadable:
            call = None
        if call is None:
            return
    llm = rec.llm = LlmFlow(api)  # from here on, refusals speak the provider's format
    if compressed:
        raise BadRequest(Code.BAD_REQUEST, "an LLM call's body must not be compressed: "
                         "Sandgate judges its model and output cap as sent")
    try:
        call = read_call(api, path, body)
    except CallUnreadable as e:
        raise BadRequest(Code.BAD_REQUEST, f"the LLM call cannot be judged: {e}",
                         hint="send one JSON object, each key once") from None
    llm.call = call
    policy = st.flow_policy(rec)
    identity = rec.caller.identity
    d = rec.decision = decide(policy, identity, rec.info,
                              rec.call.call if rec.call is not None else None, rec.aws, call)
    if not d.allowed:
        if not reported(policy, identity, d):
            raise d.refused()
        rec.reported = True  # forwarded without credentials; audited as `report`
        return
    if d.rule is not rule:
        await s30_body.check(st, flow, rec)  # the rule that forwards it: its limit, its secrets
    assert d.rule is not None
    own_credentials(flow, rec, d.rule)
    f = d.rule.llm
    changed = body
    if d.lower_max_tokens is not None:
        changed = with_max_tokens(api, changed, d.lower_max_tokens)
        llm.notes.append(f"max_tokens lowered to {d.lower_max_tokens}")
        call = llm.call = dataclasses.replace(call, max_tokens=d.lower_max_tokens)
    # OpenAI's stream has no usage unless asked: asked for (then taken out of the answer) on
    # OpenAI's own API, and on any server where a budget needs it (an OpenAI-compatible
    # server that does not know `stream_options` may refuse it: without a budget, its usage
    # goes unread rather than its calls refused)
    if api == "openai-chat" and call.stream and not call.include_usage and (
            KNOWN_HOSTS.get(rec.info.host) == "openai" or (f is not None and f.budget)):
        changed = with_usage_chunk(changed)
        llm.drop_usage_chunk = True
    if changed is not body:
        req.content = changed
        # the body the upstream receives is the one judged: its size, leaks and the places
        # of its placeholders (a `substitute_body` rule's plan points into the bytes)
        await s30_body.check(st, flow, rec)
    if f is None or f.budget is None:
        return
    budget = policy.budgets[f.budget]
    who = identity if budget.scope == "identity" else rec.caller.sandbox
    if who is None:
        raise Refused(
            Code.SANDBOX_REQUIRED, f"budget '{budget.name}' is counted per sandbox and the "
            "caller has no sandbox id",
            hint="call with a token or label that names the sandbox")
    cap = call.max_tokens
    if cap is None:
        raise Refused(Code.MAX_TOKENS_OVER_CAP, f"the call sets no output cap (max_tokens) and "
                      f"budget '{budget.name}' counts its worst case",
                      hint="set max_tokens in the request, or `llm: {max_tokens: N, "
                      "on_max_tokens: lower}` on the rule")
    price = price_of(policy.prices, call.model)
    if budget.cost_usd is not None and price is None:
        raise Refused(Code.MODEL_NOT_ALLOWED, f"model {str(call.model)[:100]!r} has no price "
                      f"and budget '{budget.name}' counts cost",
                      hint="add the model to the policy's `prices:`")
    llm.budget, llm.price = budget, price
    await settled(budget_key(budget, who))  # this process's earlier calls settled first
    llm.reservation = await st.counts.reserve(
        budget, who, amounts(worst_case(call, cap), price), identity=identity,
        model=model_label(f.models or (), policy.prices, call.model))
