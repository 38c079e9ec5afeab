"""The call layer of the `narrower_than` proof (sandgate.review.proofs): JSON-RPC calls as
finitely many witnesses.

A one-message call is judged by its method, the name it names (tool, prompt or resource uri)
and its tool arguments, each tested only against the call globs of the rules (`*`, `?`,
literals: model.glob_matches). So the strings fall into finitely many classes, one per vector
of "which globs match": a breadth-first search over the product of the globs' automata finds a
shortest string for every vector that any string realises (exact, not sampled). The witnesses
are every combination of those classes that a call can form, plus "no call" (a request whose
body carries none: a GET stream, a DELETE of the session) and "not a call" (a body that is no
JSON-RPC, refused wherever a rule with mcp:/jsonrpc: matches). Per witness every rule acts as an
allow rule (its filter allows the call, or it has none), a deny rule (a deny entry matches:
the request is refused), or not at all; the path search of proofs.py then runs unchanged.

A WebSocket is one more witness on GET: its handshake and each message on it, judged as the
same call on the same request except that a rule with a filter and without `websocket: true`
refuses it (`acting`'s `upgrade`).

Batches are covered message by message only: a batch is allowed when ONE rule allows all of
its entries, so an identity that allows two tools by two different rules refuses a batch of
both that another identity allows by one rule. MCP clients send no batches since protocol
version 2025-06-18; docs/mcp.md states the limit.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

from sandgate.decision import Decision, message_verdict, refuses_upgrade
from sandgate.policy.model import CallFilter, Rule, glob_matches
from sandgate.rpc.jsonrpc import Call, Message

# Product states explored per glob set, and call witnesses per proof: past either, the claim
# is reported as not proved.
MAX_STATES = 50000
MAX_CALLS = 20000
_SPECIAL = ("tools/call", "prompts/get", "resources/read")
# The witness for a non-empty body that is no JSON-RPC call (not JSON, another shape): the
# proxy refuses it (400) wherever a rule matching the request has mcp:/jsonrpc:, and passes
# it where none does.
NOT_A_CALL = Call(())


def passes(d: Decision, call: Call | None) -> bool:
    """Does the proxy forward the request, given decide()'s answer for it (for NOT_A_CALL:
    decide() without a call, as the head is judged)?"""
    return d.allowed and (call is not NOT_A_CALL or d.call_limit is None)


def _closure(pattern: str, states: Iterable[int]) -> frozenset[int]:
    out: set[int] = set()
    stack = list(states)
    while stack:
        i = stack.pop()
        if i in out:
            continue
        out.add(i)
        if i < len(pattern) and pattern[i] == "*":
            stack.append(i + 1)
    return frozenset(out)


def _step(pattern: str, states: frozenset[int], ch: str) -> frozenset[int]:
    nxt: set[int] = set()
    for i in states:
        if i >= len(pattern):
            continue
        p = pattern[i]
        if p == "*":
            nxt.add(i)
        elif p == "?" or p == ch:
            nxt.add(i + 1)
    return _closure(pattern, nxt)


def glob_witnesses(patterns: Sequence[str], empty: bool = False) -> list[str] | None:
    """One shortest string per vector of glob matches that some string realises (the empty
    string only when `empty`). None past MAX_STATES."""
    literals = {c for p in patterns for c in p if c not in "*?"}
    fresh = next(c for c in "xyzqj0123456789" + "".join(map(chr, range(0x100, 0x200)))
                 if c not in literals)
    alphabet = [*sorted(literals), fresh]
    start = tuple(_closure(p, [0]) for p in patterns)
    # a state is seen once as reached by the empty string and once by a non-empty one (a
    # state the empty string reaches may hold a vector only non-empty strings count for)
    seen = {(start, False)}
    queue: deque[tuple[tuple[frozenset[int], ...], str]] = deque([(start, "")])
    found: dict[tuple[bool, ...], str] = {}
    while queue:
        state, text = queue.popleft()
        if text or empty:
            vec = tuple(len(p) in s for p, s in zip(patterns, state, strict=True))
            found.setdefault(vec, text)
        for ch in alphabet:
            nxt = tuple(_step(p, s, ch) for p, s in zip(patterns, state, strict=True))
            if (nxt, True) not in seen:
                if len(seen) >= MAX_STATES:
                    return None
                seen.add((nxt, True))
                queue.append((nxt, text + ch))
    # A name the policy writes out is the readable witness of its class.
    for p in patterns:
        if "*" not in p and "?" not in p and (p or empty):
            found[tuple(glob_matches(q, p) for q in patterns)] = p
    return sorted(found.values(), key=lambda t: (len(t), t))


def call_witnesses(rules: Sequence[Rule]) -> list[Call | None] | None:
    """The calls the proof must try for these rules ([None] when none has a filter); None when
    there are too many for an exact proof."""
    filters = [r.call for r in rules if r.call is not None]
    if not filters:
        return [None]
    method_globs = sorted({g for f in filters for g in (*(f.allowed_methods or ()),
                                                        *f.deny_methods)} | set(_SPECIAL))
    methods = glob_witnesses(method_globs)
    if methods is None:
        return None
    methods = sorted(set(methods) | set(_SPECIAL))
    tool_names = glob_witnesses(sorted({g for f in filters for g in (*(f.tools or ()),
                                                                     *f.deny_tools)}))
    prompts = glob_witnesses(sorted({g for f in filters for g in f.prompts or ()}))
    resources = glob_witnesses(sorted({g for f in filters for g in f.resources or ()}))
    arguments = _argument_witnesses(filters)
    if None in (tool_names, prompts, resources) or arguments is None:
        return None
    assert tool_names is not None and prompts is not None and resources is not None
    calls: list[Call | None] = [None, NOT_A_CALL]
    for m in methods:
        if m == "tools/call":
            calls += [Call((Message("request", m, 1, n, a),)) for n in tool_names
                      for a in arguments]
        elif m in ("prompts/get", "resources/read"):
            calls += [Call((Message("request", m, 1, n, None),))
                      for n in (prompts if m == "prompts/get" else resources)]
        else:
            calls.append(Call((Message("request", m, 1, None, None),)))
        if len(calls) > MAX_CALLS:
            return None
    return calls


def _argument_witnesses(filters: Iterable[object]) -> list[dict[str, str]] | None:
    """Argument objects: for each constrained name, one value per class of its globs, or the
    argument left out (which also stands for a non-string value: no constraint matches it)."""
    by_name: dict[str, set[str]] = {}
    for f in filters:
        for name, glob in getattr(f, "arguments", ()):
            by_name.setdefault(name, set()).add(glob)
    cells: list[dict[str, str]] = [{}]
    for name in sorted(by_name):
        values = glob_witnesses(sorted(by_name[name]), empty=True)
        if values is None:
            return None
        cells = [{**c, name: v} for c in cells for v in values] + cells
        if len(cells) > MAX_CALLS:
            return None
    return cells


def acting(rules: Sequence[Rule], call: Call | None, upgrade: str | None = None) -> list[Rule]:
    """The rules as they act on this call: unchanged (no filter, no call, or the filter allows
    it), as a deny rule (a deny entry matches), or left out (the filter does not allow it).
    `upgrade`: the request opens a WebSocket ("websocket"; the call is a message on it), which
    a rule with a filter (or `llm:`) refuses unless it says `websocket: true` (decide():
    upgrade_refused)."""
    out: list[Rule] = []
    for r in rules:
        if upgrade is not None and refuses_upgrade(r, upgrade):
            out.append(dataclasses.replace(r, action="deny"))
            continue
        if call is NOT_A_CALL and r.call is not None:
            out.append(dataclasses.replace(r, action="deny"))  # the body is refused (400)
            continue
        if r.call is None or call is None or r.action != "allow":
            out.append(r)
            continue
        verdicts = [message_verdict(r.call, m) for m in call.messages]
        if any(v is not None and v[0] == "deny" for v in verdicts):
            out.append(dataclasses.replace(r, action="deny"))
        elif all(v is None for v in verdicts):
            out.append(r)
    return out


def common_call(a: Rule, b: Rule) -> str | None:
    """A JSON-RPC call both rules' filters allow, as `shown` writes it ("" when either rule
    has none: it takes every body, or when the witnesses are too many to tell); None only when
    both have mcp:/jsonrpc: and no call (one message) passes both: then each rule decides only
    its own calls, and neither takes the other's."""
    if a.call is None or b.call is None:
        return ""
    calls = call_witnesses([a, b])
    if calls is None:
        return ""
    return next((shown(c) for c in calls if c is not None and c is not NOT_A_CALL
                 and all(message_verdict(f, m) is None for f in (a.call, b.call)
                         for m in c.messages)), None)


def _passes(f: CallFilter | None, call: Call) -> bool:
    """Does a rule with this filter (None: none) forward a body carrying `call`?"""
    if f is None:
        return True
    return call is not NOT_A_CALL and all(message_verdict(f, m) is None for m in call.messages)


def calls_gained(old: Rule, new: Rule) -> list[str] | None:
    """The calls (one per witness class, as `shown` writes them) the new rule forwards and the
    old one does not, judged by the two rules' filters alone, and "a WebSocket" when only the
    new one lets one be opened; None when the witnesses are too many to tell."""
    if old.call == new.call:
        return []
    calls = call_witnesses([old, new])
    if calls is None:
        return None
    websocket = [WEBSOCKET] if _opens_websocket(new.call) and not _opens_websocket(
        old.call) else []
    return [shown(c).removeprefix(" carrying ") for c in calls if c is not None
            and _passes(new.call, c) and not _passes(old.call, c)] + websocket


WEBSOCKET = "a WebSocket"


def _opens_websocket(f: CallFilter | None) -> bool:
    """Does a rule with this filter (None: none) let a WebSocket be opened? (decide())"""
    return f is None or f.websocket


def tools_gained(old: Rule, new: Rule, names: Iterable[str]) -> list[str]:
    """Of `names` (the tool names the policies write out), those whose tools/call the new
    rule's filter forwards and the old one's does not, judged by name (arguments aside): the
    members a widened tool glob gains, in words a reviewer knows."""
    if old.call == new.call:
        return []

    def call(name: str) -> Call:
        return Call((Message("request", "tools/call", 1, name, None),))
    return sorted(n for n in set(names)
                  if _passes(new.call, call(n)) and not _passes(old.call, call(n)))


def shown(call: Call | None) -> str:
    """The witness in a counter-example: " with tool create_issue {repo: ...}"."""
    if call is None:
        return ""
    if call is NOT_A_CALL:
        return " carrying a body that is not a JSON-RPC call"
    (m,) = call.messages
    args = ""
    if m.method == "tools/call" and m.arguments:
        args = " " + ", ".join(f"{k}={v!r}" for k, v in sorted(m.arguments.items()))
    return f" carrying {m.shown}{args}"
