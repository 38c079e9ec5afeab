"""The policy DNS's part of a policy file: a rule's `dns: {types: [...]}` and `dns:` fixtures.

Pure compile steps (the loader reports what they find); the judging is
`sandgate.decision.decide_name`.
"""

from __future__ import annotations

from collections.abc import Callable

import dns.rdatatype

from sandgate.policy.hosts import normalise_host
from sandgate.policy.model import PolicyTest, Source
from sandgate.policy.schema import RuleSpec, TestSpec

Loc = tuple[str | int, ...]
Report = Callable[[Loc, str, str], None]

ALWAYS = frozenset({"A", "AAAA"})
# Never answered, whatever a rule says: ANY and zone transfers answer with many records at once;
# the meta types are not data (OPT, TSIG...); the obsolete MAIL* query types too.
NEVER = frozenset({"ANY", "AXFR", "IXFR", "MAILA", "MAILB", "OPT", "TSIG", "TKEY"})


def query_type(text: str) -> str:
    """The canonical name of a DNS query type ("txt" -> "TXT", "TYPE16" -> "TXT").
    Raises ValueError with a message that can be shown."""
    try:
        value = dns.rdatatype.from_text(text.strip().upper())
    except (dns.rdatatype.UnknownRdatatype, ValueError):
        raise ValueError(f"{text!r} is not a DNS query type (e.g. A, AAAA, TXT, MX, SRV)") \
            from None
    return dns.rdatatype.to_text(value)


def compile_dns(rs: RuleSpec, loc: Loc, rep: Report) -> frozenset[str]:
    """The query types beyond A/AAAA the rule's `dns:` lets the policy DNS answer."""
    if rs.dns is None:
        return frozenset()
    dloc: Loc = (*loc, "dns")
    if rs.action == "deny":
        rep(dloc, "a deny rule cannot have `dns:`: a name it matches is never answered",
            "remove `dns:`, or put it on the allow rule for these hosts")
    if rs.public:
        rep(dloc, "a `public: true` rule cannot have `dns:`: any name on the internet would "
            "answer these types (a channel through DNS for every name)",
            "put `dns:` on a rule that names the hosts needing it")
    out: set[str] = set()
    for j, raw in enumerate(rs.dns.types):
        tloc: Loc = (*dloc, "types", j)
        try:
            t = query_type(raw)
        except ValueError as e:
            rep(tloc, str(e), "write a query type name such as TXT, MX, SRV or CAA")
            continue
        if t in ALWAYS:
            rep(tloc, f"{t} is always answered for the hosts a rule could reach",
                f"remove {t} from `dns: types`")
        elif t in NEVER:
            rep(tloc, f"{t} queries are never answered by the policy DNS (many records or "
                "no data at once)", f"remove {t}; name the types clients need instead")
        elif t in out:
            rep(tloc, f"{t} is listed twice", "list each type once")
        else:
            out.add(t)
    return frozenset(out)


def compile_dns_test(spec: TestSpec, loc: Loc, src: Source, report: Report) -> PolicyTest | None:
    """A fixture `dns: NAME` (+ `type:`), `expect: resolve|refuse`. method is "DNS", url the
    normalised name, qtype the query type."""
    ok = True
    assert spec.dns is not None
    if spec.request is not None:
        report((*loc, "dns"), "a fixture has either `request` or `dns`, not both",
               "split it into two fixtures")
        ok = False
    if spec.expect not in ("resolve", "refuse"):
        report((*loc, "expect"), f"a `dns` fixture expects resolve or refuse, not "
               f"{spec.expect}", "write `expect: resolve` or `expect: refuse`")
        ok = False
    for key in ("inject", "code", "passthrough", "mcp", "jsonrpc", "sandbox"):
        if getattr(spec, key) is not None:
            report((*loc, key), f"`{key}` is for request fixtures; a `dns` fixture asserts "
                   "only whether the name resolves", f"remove `{key}`")
            ok = False
    for flag in ("gateway", "websocket"):
        if getattr(spec, flag):
            report((*loc, flag), f"`{flag}` is for request fixtures", f"remove `{flag}`")
            ok = False
    try:
        name = normalise_host(spec.dns)
    except ValueError as e:
        report((*loc, "dns"), f"bad name {spec.dns!r}: {e}", "write a host name, e.g. "
               "api.example.com")
        return None
    qtype = "A"
    if spec.type is not None:
        try:
            qtype = query_type(spec.type)
        except ValueError as e:
            report((*loc, "type"), str(e), "write a query type such as A, AAAA or TXT")
            return None
    if not ok:
        return None
    return PolicyTest(identity=spec.identity, method="DNS", url=name, expect=spec.expect,
                      rule=spec.rule, source=src, qtype=qtype)
