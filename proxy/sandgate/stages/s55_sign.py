"""Sign: a rule with `inject: {sign: NAME}` has Sandgate sign the request with AWS SigV4 using
the `aws:` secret NAME, for the service and region the rule, the secret or the host gives
(secrets/aws_scope.py) (read from Vault by the inject stage, cached). Last before the dial, so
the signature covers the request as it is forwarded (secrets/sigv4.py), and only what
stages/s36_sigv4.py judged (a request it did not judge is refused, never signed)."""

from __future__ import annotations

from mitmproxy import http

from sandgate.errors import Code, Refused, SecretError
from sandgate.request import default_port
from sandgate.secrets.aws_scope import resolve
from sandgate.secrets.sigv4 import sign as sigv4
from sandgate.stages.context import GateState, allowing_rule
from sandgate.stages.flow import FlowRecord


async def sign(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    rule = allowing_rule(rec)
    if rule is None or rule.inject is None or rule.inject.sign is None:
        return
    if rec.aws is None:  # fail closed: never sign what s36_sigv4 did not judge
        raise Refused(Code.INTERNAL_ERROR, "the request was not judged for signing")
    name = rule.inject.sign.secret
    ref = st.flow_policy(rec).secrets.get(name)
    info = rec.info
    assert info is not None and ref is not None and ref.aws is not None
    scope = resolve(rule.inject.sign, ref.aws, info.host)
    if scope.service is None or scope.region is None:  # never an unsigned forward
        raise SecretError(name, f"secret '{name}' unavailable: no SigV4 service/region for "
                          f"host {info.host} (name them in the rule's `sign:`)")
    sv = await st.cfg.broker.get(name, rec.caller)  # read (and cached) by the inject stage
    if not sv.username:
        raise SecretError(name, f"secret '{name}' unavailable: no access_key_id in its record")
    port = "" if info.port == default_port(info.scheme) else f":{info.port}"
    url = f"{info.scheme}://{info.host}{port}{flow.request.path}"
    sigv4(flow.request, url, scope.service, scope.region, sv.username, sv.value,
          dict(sv.extra).get("session_token"))
    at = f"{name}@{sv.version}" if sv.version else name
    # what the signature vouches for beyond the request line, as the sandbox named it (so
    # scrubbed, as the audit's path is)
    named = [f"operation {rec.aws.operation}"] if rec.aws.operation is not None else []
    named += [f"{h} {p}" for h, p in rec.aws.sources]
    extra = st.secrets(rec).scrub_text(" (" + "; ".join(named) + ")")[0] if named else ""
    rec.injected.append(f"{at}: aws sigv4 {scope.service} {scope.region}{extra}")
