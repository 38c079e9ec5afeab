"""The SigV4 stages on their own: s36_sigv4 decides again with what the signature covers,
and s55_sign signs nothing it did not judge (fail closed). The end to end run against moto is
tests/integration/test_creds_sigv4.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from sandgate.audit import events as audit
from sandgate.decision import decide
from sandgate.errors import Code, Refused
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.policy.loader import load_policy_dir
from sandgate.request import parse_proxied
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.stages import context, s36_sigv4, s55_sign
from sandgate.stages.flow import FlowRecord

pytestmark = pytest.mark.unit

POLICY = """
version: v1
secrets:
  aws: {vault: secret/data/aws/agent, aws: {region: eu-west-1, service: s3}}
identities:
  agent:
    rules:
      - name: one-bucket
        hosts: [s3.example]
        paths: ["/agent-bucket/**"]
        copy_sources: ["/agent-bucket/**"]
        inject: {sign: aws}
      - name: unsigned-fallback  # a later rule that signs nothing
        hosts: [s3.example]
        methods: [GET]
"""


@pytest.fixture
def state(tmp_path: Path) -> context.GateState:
    (tmp_path / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(tmp_path)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    return context.GateState(context.GateConfig(
        policy=policy, broker=broker, identifier=Identifier(b"k" * 32),
        audit=audit.AuditLog(tmp_path / "audit.jsonl"), max_request_body=1000))


def flow(state: context.GateState, method: str, path: str,
         **headers: str) -> tuple[FlowRecord, http.HTTPFlow]:
    f = tflow.tflow(req=tflow.treq(method=method.encode(), host="s3.example", port=443,
                                   scheme=b"https", path=path.encode(), content=b"",
                                   headers=tuple((k.replace("_", "-").encode(), v.encode())
                                                 for k, v in headers.items())))
    rec = context.record(f)
    policy = state.flow_policy(rec)
    info = parse_proxied("https", "s3.example", 443, method, path, None)
    rec.caller, rec.info, rec.policy = Caller("agent", None, "token"), info, policy
    rec.decision = decide(policy, "agent", info)  # the head stage: nothing signed is read
    assert rec.decision.rule is not None and rec.decision.rule.name == "one-bucket"
    return rec, f


async def test_a_copy_source_the_rule_does_not_admit_is_refused(state):
    rec, f = flow(state, "PUT", "/agent-bucket/x",
                  x_amz_copy_source="/private-data/payroll.csv")
    with pytest.raises(Refused) as ei:
        await s36_sigv4.judge(state, f, rec)
    assert ei.value.code == Code.NO_RULE and "copy_sources" in ei.value.reason
    assert rec.aws is None


async def test_an_admitted_copy_source_is_judged_and_recorded(state):
    rec, f = flow(state, "PUT", "/agent-bucket/x", x_amz_copy_source="/agent-bucket/y")
    await s36_sigv4.judge(state, f, rec)
    assert rec.aws is not None and rec.aws.sources == (("x-amz-copy-source",
                                                         "/agent-bucket/y"),)


async def test_a_later_rule_that_does_not_sign_may_still_allow_it(state):
    """The signing rule does not match a presigned GET; the later unsigned rule does: it is
    forwarded as sent, with no signature of Sandgate's beside the client's."""
    rec, f = flow(state, "GET", "/agent-bucket/x?X-Amz-Signature=abc")
    await s36_sigv4.judge(state, f, rec)
    assert rec.decision is not None and rec.decision.rule_name == "unsigned-fallback"
    assert rec.aws is None
    await s55_sign.sign(state, f, rec)  # the allowing rule signs nothing
    assert "authorization" not in f.request.headers


async def test_the_signer_refuses_a_request_the_sigv4_stage_did_not_judge(state):
    rec, f = flow(state, "PUT", "/agent-bucket/x")
    with pytest.raises(Refused) as ei:  # before any Vault read (the broker has no server)
        await s55_sign.sign(state, f, rec)
    assert ei.value.code == Code.INTERNAL_ERROR
    assert "authorization" not in f.request.headers


async def test_a_path_the_rules_resolved_is_not_signed_as_sent(state):
    """Judged as /agent-bucket/x; S3 would write the key ../agent-bucket/x into
    private-data."""
    # refused by the decision itself, whatever the rule (judged resolved, it would go on as
    # sent): before the signing stage is reached
    d = decide(state.flow_policy(context.record(tflow.tflow())), "agent",
               parse_proxied("https", "s3.example", 443, "PUT",
                             "/private-data/..%2Fagent-bucket/x", None))
    assert d.code == Code.BAD_REQUEST and "'..' segment" in d.reason
