"""Sign: a rule with `inject: {sign: NAME}` has Sandgate sign the request with AWS SigV4 using
the `aws:` secret NAME (read from Vault by the inject stage, cached). Last before the dial, so
the signature covers the request as it is forwarded (secrets/sigv4.py)."""

from __future__ import annotations

from mitmproxy import http

from sandgate.addons.state import FlowRecord
from sandgate.errors import SecretError
from sandgate.request import default_port
from sandgate.secrets.sigv4 import sign as sigv4
from sandgate.stages.context import GateState, allowing_rule


async def sign(st: GateState, flow: http.HTTPFlow, rec: FlowRecord) -> None:
    rule = allowing_rule(rec)
    if rule is None or rule.inject is None or rule.inject.sign is None:
        return
    name = rule.inject.sign
    ref = st.flow_policy(rec).secrets.get(name)
    info = rec.info
    assert info is not None and ref is not None and ref.aws is not None
    sv = await st.cfg.broker.get(name, rec.caller)  # read (and cached) by the inject stage
    if not sv.username:
        raise SecretError(name, f"secret '{name}' unavailable: no access_key_id in its record")
    port = "" if info.port == default_port(info.scheme) else f":{info.port}"
    url = f"{info.scheme}://{info.host}{port}{flow.request.path}"
    sigv4(flow.request, url, ref.aws, sv.username, sv.value, dict(sv.extra).get("session_token"))
    rec.injected.append(f"{name}@{sv.version}: aws sigv4 {ref.aws.service} {ref.aws.region}"
                        if sv.version else f"{name}: aws sigv4 {ref.aws.service} "
                        f"{ref.aws.region}")
