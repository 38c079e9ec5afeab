"""`llm:` of a rule, `budgets:` and `prices:`: their file form compiled and checked (the
decision judges the model and cap: sandgate.decision; the proxy counts: sandgate.llm.spend).

Checked here: model globs are not empty, a cap is at least 1, `on_max_tokens: lower` has a cap
to lower to, `llm:` only on intercepted allow rules, `websocket: true` (the Responses API's
WebSocket, judged by sandgate.stages.wsllm) only where a GET can open one and without a budget,
a budget limits something and its window is a duration, prices are not negative. Budget names
a rule uses are checked once the files are merged (sandgate.policy.loader), like every other
cross-file name.
"""

from __future__ import annotations

from sandgate.policy.ask import Loc, Report, duration
from sandgate.policy.model import Budget, LlmRule, Price, Source
from sandgate.policy.schema import BudgetDefSpec, PriceSpec, RuleSpec


def compile_llm(rs: RuleSpec, loc: Loc, rep: Report) -> LlmRule | None:
    spec = rs.llm
    if spec is None:
        return None
    ok = True
    where = (*loc, "llm")
    if rs.action == "deny" or rs.passthrough:
        rep(where, "`llm:` judges the calls a rule lets through: not on a deny or passthrough "
            "rule", "move it to the allow rule that carries the calls")
        ok = False
    for j, pat in enumerate(spec.models or ()):
        if not pat.strip() or pat != pat.strip():
            rep((*where, "models", j), f"model glob {pat!r} is empty or has spaces around it",
                "write a model name or a glob such as claude-sonnet-4*")
            ok = False
    if spec.max_tokens is not None and spec.max_tokens < 1:
        rep((*where, "max_tokens"), f"max_tokens {spec.max_tokens} allows no output",
            "write the largest output cap a call may ask for, e.g. 4096")
        ok = False
    if spec.on_max_tokens == "lower" and spec.max_tokens is None:
        rep((*where, "on_max_tokens"), "`on_max_tokens: lower` needs `max_tokens` to lower to",
            "add max_tokens, or remove on_max_tokens")
        ok = False
    websocket = bool(rs.websocket)
    # with mcp:/jsonrpc: too, sandgate.policy.call_rules checks the key (one message, not two)
    checked = rs.mcp is not None or rs.jsonrpc is not None
    if websocket and not checked and rs.action == "ask":
        rep((*loc, "websocket"), "an `action: ask` rule cannot take `websocket: true`: an "
            "approval holds one HTTP request, and a WebSocket's calls cannot be held",
            "remove `websocket` (calls then go as POSTs, each held for approval)")
        ok = False
    elif websocket and not checked and rs.methods is not None and "GET" not in {
            m.upper() for m in rs.methods}:
        rep((*loc, "websocket"), "`websocket: true` has no effect: a WebSocket is opened by a "
            "GET, and the rule's `methods` does not list GET", "add GET to `methods`, or "
            "remove `websocket`")
        ok = False
    if websocket and spec.budget is not None:
        rep((*loc, "websocket"), "a rule with `llm.budget` cannot take `websocket: true`: the "
            "calls on a WebSocket are not counted against budgets",
            "let the budgeted calls go as POSTs (remove `websocket`), or move `websocket: "
            "true` to a rule without a budget")
        ok = False
    if not ok:
        return None
    return LlmRule(api=spec.api, models=tuple(spec.models) if spec.models else None,
                   max_tokens=spec.max_tokens, on_max_tokens=spec.on_max_tokens,
                   budget=spec.budget, own_credentials=spec.own_credentials,
                   websocket=websocket)


def compile_budget(name: str, spec: BudgetDefSpec, loc: Loc, src: Source,
                   rep: Report) -> Budget | None:
    ok = True
    limits = {"input_tokens": spec.input_tokens, "output_tokens": spec.output_tokens,
              "cost_usd": spec.cost_usd}
    if all(v is None for v in limits.values()):
        rep(loc, f"budget {name!r} limits nothing",
            "give input_tokens, output_tokens or cost_usd (per window)")
        ok = False
    for key, v in limits.items():
        if v is not None and (isinstance(v, bool) or v <= 0):
            rep((*loc, key), f"{key} must be more than 0, not {v!r}",
                "write the most a window may spend, e.g. 200000")
            ok = False
    per = duration(spec.per, (*loc, "per"), rep, "`per`")
    if per is None or not ok:
        return None
    return Budget(name=name, per=per, scope=spec.scope, source=src,
                  input_tokens=spec.input_tokens, output_tokens=spec.output_tokens,
                  cost_usd=float(spec.cost_usd) if spec.cost_usd is not None else None)


def compile_price(spec: PriceSpec, loc: Loc, rep: Report) -> Price | None:
    values = {"input": spec.input, "output": spec.output, "cached_input": spec.cached_input}
    bad = [k for k, v in values.items() if v is not None and (isinstance(v, bool) or v < 0)]
    for k in bad:
        rep((*loc, k), f"price {k} is negative", "write US dollars per million tokens")
    if bad or not spec.model.strip():
        if not spec.model.strip():
            rep((*loc, "model"), "an empty model glob", "write e.g. claude-sonnet-4*")
        return None
    return Price(model=spec.model, input=float(spec.input), output=float(spec.output),
                 cached_input=None if spec.cached_input is None else float(spec.cached_input))
