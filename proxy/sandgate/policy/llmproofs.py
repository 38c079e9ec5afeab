"""Exact comparisons of `llm:` (sandgate.policy.model.LlmRule) for `narrower_than`, `diff` and
lint's shadowing: which model names, output caps and bodies a rule lets through, what it
forwards, and what it holds them to.

The order (documented in docs/spend.md): rule N's `llm:` is no wider than rule W's when

* every model N lets through, W lets through (globs compared exactly, below; no `models:` lets
  through every model, and a call naming none);
* every output cap N lets through, W lets through (`on_max_tokens: refuse` with cap C lets
  through the calls asking for at most C; `lower` and no `max_tokens` let every cap through),
  and the cap N forwards is never above the one W forwards for the same call (`lower` forwards
  at most C);
* N holds its calls to a budget no wider than W's: the same budget, or one that limits every
  kind W's limits by no more, over a window no shorter, with the same scope (per sandbox,
  each sandbox spends the limit; per identity, a caller without a sandbox id is not refused:
  neither scope is narrower than the other);
* N refuses a sandbox's own credential wherever W does (`own_credentials: replace` forwards
  the request with Sandgate's key: wider than `refuse`).

Model globs (`*` any run of characters, `?` one: model.glob_matches) are regular languages, so
one model name per class of names that every glob treats alike is enough to decide them: the
search below runs over the product of one lazily determinised automaton per glob, on an
alphabet of the characters the globs name and one stand-in for every other character (no glob
can tell two such characters apart). Its witnesses stand for every model name: exact, not
sampled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from sandgate.decision import Decision, decide_request, llm_misfit
from sandgate.errors import Code, InvalidInput
from sandgate.llm.llmcall import Api, DeclaredApi, LlmCall, recognise
from sandgate.policy.model import Budget, LlmRule, Policy, Rule
from sandgate.policy.paths import PathPattern, compile_path_pattern, normalise_path
from sandgate.request import RequestInfo
from sandgate.rpc.jsonrpc import Call

# Beyond this many product states (or witnesses) a comparison is reported as not proved.
MAX_MODEL_STATES = 20_000


class _ModelNfa:
    """One model glob: positions 0..len; `*` loops on any character, `?` takes one."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.initial = self._closure({0})

    def _closure(self, states: Iterable[int]) -> frozenset[int]:
        out = set(states)
        todo = list(out)
        while todo:
            i = todo.pop()
            if i < len(self.p) and self.p[i] == "*" and i + 1 not in out:
                out.add(i + 1)
                todo.append(i + 1)
        return frozenset(out)

    def step(self, state: frozenset[int], ch: str) -> frozenset[int]:
        nxt: set[int] = set()
        for i in state:
            if i >= len(self.p):
                continue
            c = self.p[i]
            if c == "*":
                nxt.add(i)
            elif c == "?" or c == ch:
                nxt.add(i + 1)
        return self._closure(nxt)

    def accepts(self, state: frozenset[int]) -> bool:
        return len(self.p) in state


class TooManyModels(InvalidInput):
    """The globs' product automaton is too big for an exact comparison."""


@lru_cache(maxsize=256)
def model_witnesses(globs: tuple[str, ...]) -> dict[tuple[bool, ...], str]:
    """For every way the globs can match a model name (which of them match it), a shortest
    name that matches exactly those: every model name matches the same globs as one of these.
    TooManyModels beyond MAX_MODEL_STATES."""
    nfas = [_ModelNfa(g) for g in globs]
    named = sorted({c for g in globs for c in g if c not in "*?"})
    # one character no glob names stands for all of them: a readable one when possible
    fresh = next(c for c in (*"xqzjkvw0123456789", *map(chr, range(0xE000, 0xF900)))
                 if c not in named)
    alphabet = [*named, fresh]
    init = tuple(n.initial for n in nfas)
    seen: dict[tuple[frozenset[int], ...], str] = {init: ""}
    queue = [init]
    out: dict[tuple[bool, ...], str] = {}
    i = 0
    while i < len(queue):
        state = queue[i]
        i += 1
        text = seen[state]
        out.setdefault(tuple(n.accepts(s) for n, s in zip(nfas, state, strict=True)), text)
        for ch in alphabet:
            nxt = tuple(n.step(s, ch) for n, s in zip(nfas, state, strict=True))
            if nxt not in seen:
                if len(seen) >= MAX_MODEL_STATES:
                    raise TooManyModels(f"more than {MAX_MODEL_STATES} states")
                seen[nxt] = text + ch
                queue.append(nxt)
    return out


def model_gap(wider: tuple[str, ...] | None, narrow: tuple[str, ...] | None
              ) -> tuple[str | None] | None:
    """A model `narrow` lets through and `wider` does not ((None,): a call naming no model),
    or None when there is none. TooManyModels when it cannot be decided."""
    if wider is None:
        return None
    if narrow is None:
        return (None,)  # no allow-list: a call naming no model passes it
    globs = (*wider, *narrow)
    for vec, name in model_witnesses(globs).items():
        if any(vec[len(wider):]) and not any(vec[:len(wider)]):
            return (name,)
    return None


def models_cover(wider: tuple[str, ...] | None, narrow: tuple[str, ...] | None) -> bool:
    """Does every model `narrow` lets through pass `wider` (exact; False when undecidable
    within the bounds: the callers treat that as not covered)?"""
    try:
        return model_gap(wider, narrow) is None
    except TooManyModels:
        return False


# --- caps ------------------------------------------------------------------------------------


def refused_cap(f: LlmRule | None) -> int | None:
    """The cap above which (or without which) the rule refuses a call; None: it refuses none."""
    if f is None or f.max_tokens is None or f.on_max_tokens != "refuse":
        return None
    return f.max_tokens


def forwarded_cap(f: LlmRule | None, cap: int | None) -> int | None:
    """The output cap a call asking for `cap` is forwarded with (None: no cap)."""
    if f is not None and f.max_tokens is not None and f.on_max_tokens == "lower" and (
            cap is None or cap > f.max_tokens):
        return f.max_tokens
    return cap


def _cap_le(a: int | None, b: int | None) -> bool:
    return b is None or (a is not None and a <= b)


def caps_cover(wider: LlmRule | None, narrow: LlmRule | None) -> bool:
    """Every cap `narrow` lets through, `wider` does."""
    w, n = refused_cap(wider), refused_cap(narrow)
    return w is None or (n is not None and n <= w)


def forwards_no_more(wider: LlmRule | None, narrow: LlmRule | None) -> bool:
    """For every call, the cap `narrow` forwards is at most the one `wider` does (decided on the
    caps where the two rules change behaviour, and one cap past each)."""
    caps: set[int | None] = {None, 0}
    for f in (wider, narrow):
        if f is not None and f.max_tokens is not None:
            caps.update((f.max_tokens, f.max_tokens + 1))
    return all(_cap_le(forwarded_cap(narrow, c), forwarded_cap(wider, c)) for c in caps
               if llm_fits(narrow, None, c, ignore_model=True))


def llm_fits(f: LlmRule | None, model: str | None, cap: int | None,
             ignore_model: bool = False) -> bool:
    """Does the rule's `llm:` let this call through (decision.llm_misfit, the one judge)?"""
    if f is None:
        return True
    if ignore_model:
        f = LlmRule(max_tokens=f.max_tokens, on_max_tokens=f.on_max_tokens)
    return llm_misfit(f, LlmCall("openai-chat", model, cap, False)) is None


# --- budgets and own credentials --------------------------------------------------------------


def budget_wider(wider: Budget | None, narrow: Budget | None) -> str | None:
    """Why `narrow` lets a window spend more than `wider` (None: it does not). None budget:
    nothing counted."""
    if wider is None:
        return None
    if narrow is None:
        return f"counts its calls against no budget (was budget '{wider.name}')"
    if narrow == wider or (narrow.name == wider.name and _limits(narrow) == _limits(wider)):
        return None
    out: list[str] = []
    for key in ("input_tokens", "output_tokens", "cost_usd"):
        w, n = getattr(wider, key), getattr(narrow, key)
        if w is not None and (n is None or n > w):
            out.append(f"{key} {w} -> {'unlimited' if n is None else n}")
    if narrow.per < wider.per:
        out.append(f"per {wider.per}s -> {narrow.per}s")
    if wider.scope != narrow.scope:
        # per sandbox: each sandbox spends the limit; per identity: a caller without a
        # sandbox id is not refused. Neither is narrower than the other.
        out.append(f"scope {wider.scope} -> {narrow.scope}")
    if not out:
        return None
    return f"budget '{wider.name}' -> '{narrow.name}': " + ", ".join(out)


def _limits(b: Budget) -> tuple[object, ...]:
    return (b.input_tokens, b.output_tokens, b.cost_usd, b.per, b.scope)


def own_keys_pass(r: Rule) -> bool:
    """Does the rule forward a request carrying a credential of the sandbox's own (s37_llm:
    refused on an injecting rule with `llm:` unless `own_credentials: replace`)?"""
    return r.llm is None or r.inject is None or r.llm.own_credentials == "replace"


@dataclass(frozen=True, slots=True)
class LlmWidening:
    """One way a rule's `llm:` lets through or grants more than another's."""

    what: str

    def __str__(self) -> str:
        return self.what


def llm_widenings(old: Rule, new: Rule, old_budgets: Mapping[str, Budget],
                  new_budgets: Mapping[str, Budget]) -> list[LlmWidening]:
    """What the `new` rule's `llm:` grants beyond the `old` one's, each in words (empty: no
    more). Budget names resolve in each rule's own policy."""
    o, n = old.llm, new.llm
    out: list[LlmWidening] = []
    if o is not None and o.api is not None and (n is None or n.api != o.api):
        out.append(LlmWidening(f"api {o.api if o else None} -> {n.api if n else None} (calls "
                               "it recognised may no longer be judged)"))
    try:
        gap = model_gap(o.models if o is not None else None, n.models if n is not None else None)
    except TooManyModels:
        gap = ("(too many globs to compare exactly)",)
    if gap is not None:
        shown = "a call naming no model" if gap[0] is None else f"e.g. model {gap[0]!r}"
        out.append(LlmWidening(f"models {_models(o)} -> {_models(n)} ({shown} now passes)"))
    if not caps_cover(o, n):
        out.append(LlmWidening(f"refused cap {refused_cap(o)} -> {_cap_words(n)}"))
    if not forwards_no_more(o, n):
        out.append(LlmWidening(f"forwarded cap {_fwd_words(o)} -> {_fwd_words(n)}"))
    ob = old_budgets.get(o.budget) if o is not None and o.budget else None
    nb = new_budgets.get(n.budget) if n is not None and n.budget else None
    if o is not None and o.budget and ob is None:  # compared by name only
        ob = Budget(o.budget, 0, "identity", old.source)
    if n is not None and n.budget and nb is None:
        nb = ob if ob is not None and ob.name == n.budget else Budget(
            n.budget, 0, "identity", new.source)
    why = budget_wider(ob, nb)
    if why is not None:
        out.append(LlmWidening(why))
    if o is not None and not o.websocket and n is not None and n.websocket:
        out.append(LlmWidening("websocket: true (the Responses WebSocket, refused before, is "
                               "opened; each call on it judged)"))
    if own_keys_pass(new) and not own_keys_pass(old):
        out.append(LlmWidening("own_credentials refuse -> replace (a request with the "
                               "sandbox's own key is forwarded)"))
    return out


def _models(f: LlmRule | None) -> str:
    return "any" if f is None or f.models is None else ", ".join(f.models)


def _cap_words(f: LlmRule | None) -> str:
    c = refused_cap(f)
    return "none (any cap passes)" if c is None else str(c)


def _fwd_words(f: LlmRule | None) -> str:
    if f is None or f.max_tokens is None:
        return "as asked"
    return f"at most {f.max_tokens}" if f.on_max_tokens == "lower" else (
        f"as asked (at most {f.max_tokens})")


# --- the proof's LLM witnesses ---------------------------------------------------------------

# A call body Sandgate cannot read (not JSON, a key twice): refused on a rule with `llm:`,
# forwarded unjudged on one without.
UNREADABLE: Literal["unreadable"] = "unreadable"
LlmWitness = tuple[str | None, int | None] | Literal["unreadable"]

# The paths of each API's inference calls (llmcall.recognise), as path globs over normalised
# paths: the proof adds them to its path automaton.
_API_GLOBS: dict[Api, tuple[str, ...]] = {
    "anthropic": ("/**/messages", "/**/messages/"),
    "openai-chat": ("/**/chat/completions", "/**/chat/completions/"),
    "openai-responses": ("/**/responses", "/**/responses/"),
    "gemini": ("/**/*:generateContent", "/**/*:generateContent/",
               "/**/*:streamGenerateContent", "/**/*:streamGenerateContent/"),
}
API_PATHS: dict[Api, tuple[PathPattern, ...]] = {
    api: tuple(compile_path_pattern(p) for p in pats) for api, pats in _API_GLOBS.items()}
APIS: tuple[Api, ...] = tuple(API_PATHS)
FAMILY_APIS: dict[DeclaredApi, tuple[Api, ...]] = {
    "anthropic": ("anthropic",), "openai": ("openai-chat", "openai-responses"),
    "gemini": ("gemini",)}


def llm_witnesses(rules: Sequence[Rule]) -> list[LlmWitness] | None:
    """The LLM calls that stand for every call the rules' `llm:` can tell apart: each class of
    model names (and none), each cap where a rule changes behaviour (and one past it, and
    none), and an unreadable body. None when the model globs are too many."""
    globs = tuple(dict.fromkeys(g for r in rules if r.llm is not None and r.llm.models
                                for g in r.llm.models))
    try:
        models: list[str | None] = [None, *model_witnesses(globs).values()]
    except TooManyModels:
        return None
    caps: set[int] = {0}
    for r in rules:
        if r.llm is not None and r.llm.max_tokens is not None:
            caps.update((r.llm.max_tokens, r.llm.max_tokens + 1))
    capl: list[int | None] = [None, *sorted(caps)]
    return [UNREADABLE, *((m, c) for m in models for c in capl)]


def shown_witness(w: LlmWitness | None) -> str:
    if w is None:
        return ""
    if w == UNREADABLE:
        return " with an LLM call body Sandgate cannot read (not one JSON object)"
    model, cap = w
    return (f" with an LLM call of model {model!r}" if model is not None
            else " with an LLM call naming no model") + (
        f", max_tokens {cap}" if cap is not None else ", no max_tokens")


def witness_call(w: LlmWitness) -> LlmCall | None:
    if w == UNREADABLE:
        return None
    model, cap = w
    return LlmCall("openai-chat", model, cap, False)


def judged_as_llm(policy: Policy, identity: str, req: RequestInfo, call: Call | None,
                  w: LlmWitness | None) -> tuple[Decision, bool]:
    """What the proxy decides for a request whose body makes the LLM call `w` (None: not an
    LLM call), in stages/s37_llm's order: the request is decided, then, when the deciding
    rule's host or declared `api:` makes its path an inference call, the call is read (an
    unreadable one is refused on a rule with `llm:`, forwarded unjudged on one without) and
    the request decided again with it. Also: whether the call was judged."""
    head = decide_request(policy, identity, req, call=call)
    if w is None or not head.allowed or head.tunnel or head.rule is None:
        return head, False
    rule = head.rule
    if req.upgrade is not None:  # a message on the WebSocket (sandgate.stages.wsllm)
        return _ws_message(policy, identity, req, head, rule, w)
    api = recognise(req.method, req.host, normalise_path(req.path),
                    rule.llm.api if rule.llm is not None else None)
    if api is None:
        return head, False
    if w == UNREADABLE:
        if rule.llm is None:
            return head, False
        return Decision(False, Code.BAD_REQUEST, f"rule '{rule.name}' judges LLM calls and the "
                        "body is not one it can read (400 bad_request)", rule=rule), False
    return decide_request(policy, identity, req, call=call, llm=witness_call(w)), True


def _ws_message(policy: Policy, identity: str, req: RequestInfo, head: Decision, rule: Rule,
                w: LlmWitness) -> tuple[Decision, bool]:
    """wsllm.judge_client's verdict on a `response.create` making the call `w`."""
    if rule.llm is None:
        return head, False  # a WebSocket no `llm:` rule opened: its messages are not read
    if w == UNREADABLE:
        return Decision(False, Code.BAD_REQUEST, f"rule '{rule.name}' judges LLM calls and the "
                        "message is not one it can read (the WebSocket is closed)",
                        rule=rule), False
    d = decide_request(policy, identity, req, llm=witness_call(w))
    if d.allowed and d.rule is not None and (d.ask or (
            d.rule is not rule and d.rule.secrets != rule.secrets)):
        return Decision(False, Code.DENIED_BY_RULE, f"{d.reason}; on a WebSocket the call "
                        "cannot be held, nor run with other credentials than the upgrade's",
                        rule=d.rule), True
    return d, True


def llm_gap(narrow: Rule, narrow_judged: bool, other: Rule, other_judged: bool,
            w: LlmWitness | None, budgets: Mapping[str, Budget]) -> str | None:
    """Why the narrow rule, deciding this request (and LLM call `w`), grants more than the
    other rule deciding it (None: it does not): a sandbox's own key forwarded, a higher cap
    forwarded, a wider budget (or none). `*_judged`: the call was judged under that rule."""
    if own_keys_pass(narrow) and not own_keys_pass(other):
        return (f"rule '{narrow.name}' forwards a request carrying the sandbox's own key "
                f"(own_credentials: replace, or no `llm:`); rule '{other.name}' refuses it")
    if w is None or w == UNREADABLE:
        return None
    cap = w[1]
    nf = forwarded_cap(narrow.llm if narrow_judged else None, cap)
    of = forwarded_cap(other.llm if other_judged else None, cap)
    if not _cap_le(nf, of):
        return (f"rule '{narrow.name}' forwards the call with max_tokens "
                f"{'unset' if nf is None else nf}; rule '{other.name}' with at most {of}")

    def held(r: Rule, judged: bool) -> Budget | None:
        f = r.llm
        return budgets.get(f.budget) if judged and f is not None and f.budget else None

    why = budget_wider(held(other, other_judged), held(narrow, narrow_judged))
    if why is not None:
        return f"rule '{narrow.name}' {why}, where rule '{other.name}' holds the call to it"
    return None
