"""Inject: the credentials the allowing rule names, read from Vault at request time.

Only over verified TLS; a caller without the sandbox a secret's path needs is refused before any
read; a secret's budget is spent only once every value is there to inject. A new kind of
credential is a new `inject:` form in sandgate.inject (applied here) or a stage of its own
after this one.
"""

from __future__ import annotations

from mitmproxy import ctx, http

from sandgate.audit.export.marks import VAULT_END, VAULT_START, mark
from sandgate.decision import decide, require_sandbox
from sandgate.errors import Code, Refused, SecretError
from sandgate.inject import apply
from sandgate.netguard import choose_address, resolve
from sandgate.policy.model import Policy
from sandgate.request import parse_url
from sandgate.scrub.flowsecrets import owned
from sandgate.secrets.tokenhttp import Dial
from sandgate.stages.context import GateState, allowing_rule
from sandgate.stages.flow import FlowRecord


def token_dial(st: GateState, policy: Policy, identity: str, name: str) -> Dial:
    """How `identity` may reach a token endpoint (an oauth2 secret): as any of its requests
    would, judged by its rules (POST to the endpoint must be allowed) and the address checks
    (the rule's private_cidrs, never the proxy itself). Refused: 503 secret_unavailable."""

    async def dial(url: str) -> tuple[str, int]:
        try:
            info = parse_url("POST", url)
            d = decide(policy, identity, info)
            if not d.allowed or d.rule is None:
                raise SecretError(name, f"secret '{name}' unavailable: the rules of identity "
                                  f"'{identity}' do not allow POST {url} ({d.code})")
            ips = await resolve(info.host, info.port, st.cfg.resolve_overrides)
            target = choose_address(info.host, info.port, ips, d.rule.private_cidrs,
                                    st.cfg.self_addresses, d.rule.public)
        except SecretError:
            raise
        except Refused as e:
            raise SecretError(name, f"secret '{name}' unavailable: token endpoint refused "
                              f"({e.code}: {e.reason})") from None
        return str(target.ip), target.port

    return dial


async def inject(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    """The inject stage: nothing to do in report mode or for a rule without secrets."""
    rule = allowing_rule(rec)
    if rule is None or not rule.secrets:
        return
    info = rec.info
    assert info is not None
    if info.scheme != "https" or ctx.options.ssl_insecure:
        raise Refused(Code.UNSAFE_INJECTION,
                      "credentials are injected only over verified TLS to the upstream")
    policy = st.flow_policy(rec)
    caller = rec.caller
    assert caller is not None
    require_sandbox(policy, rule, caller.identity, caller.sandbox)  # before any read
    values: dict[str, str] = {}
    versions: list[str] = []
    mark(rec, VAULT_START)
    for name in sorted(rule.secrets):
        sv = await st.cfg.broker.get(name, caller, token_dial(st, policy, caller.identity, name),
                                     rule.github_scope)
        values[name] = sv.value
        if sv.note is not None:
            rec.injected.append(f"{name}@{sv.version}: {sv.note}" if sv.version else
                                f"{name}: {sv.note}")
        if sv.username is not None:
            values[f"{name}.username"] = sv.username
        versions.append(f"{name}@{sv.version}" if sv.version else name)
    mark(rec, VAULT_END)
    # counted only now that the secrets are there to inject (or 429, nothing spent)
    await st.counts.spend([(n, policy.secrets[n].budget) for n in sorted(rule.secrets)])
    rec.secrets += versions
    rec.owned = owned(policy, values, rule.secrets)  # always scrubbed from its response
    plan = rec.body_plan
    if plan is not None:
        rec.injected += [f"{v}: {plan.describe()}" for v in versions
                         if v.partition("@")[0] in plan.secrets]
    apply(rule, flow.request, values, {n: policy.secrets[n].placeholder for n in rule.secrets},
          plan)
