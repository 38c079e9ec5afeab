"""The SigV4 signing scope: AWS endpoint host parsing, precedence rule > secret > host, the load
check for a scope nothing can give, and how explain and the reach report show it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.explain.answer import explain
from sandgate.policy.loader import PolicyError
from sandgate.policy.loader import load_policy_dir as load_policy
from sandgate.policy.model import AwsRef, SignRef
from sandgate.review.report import build_report, format_markdown
from sandgate.secrets.aws_scope import host_scope, hosts_may_give, resolve

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("host", "want"), [
    ("sqs.eu-west-1.amazonaws.com", ("sqs", "eu-west-1")),
    ("dynamodb.us-gov-west-1.amazonaws.com", ("dynamodb", "us-gov-west-1")),
    ("sqs-fips.us-east-2.amazonaws.com", ("sqs", "us-east-2")),
    ("s3.eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
    ("s3-fips.us-east-1.amazonaws.com", ("s3", "us-east-1")),
    ("s3.dualstack.ap-southeast-2.amazonaws.com", ("s3", "ap-southeast-2")),
    ("acme-artifacts.s3.eu-central-1.amazonaws.com", ("s3", "eu-central-1")),
    ("my.dotted.bucket.s3.eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
    ("acme.s3.dualstack.eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
    ("ap-123456789012.s3-accesspoint.us-west-2.amazonaws.com", ("s3", "us-west-2")),
    ("s3-eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
    ("acme.s3-eu-west-1.amazonaws.com", ("s3", "eu-west-1")),
    ("s3.amazonaws.com", ("s3", "us-east-1")),
    ("acme-artifacts.s3.amazonaws.com", ("s3", "us-east-1")),
    ("iam.amazonaws.com", ("iam", "us-east-1")),
    ("sts.amazonaws.com", ("sts", "us-east-1")),
    ("STS.AmazonAWS.com.", ("sts", "us-east-1")),
    ("abc123.execute-api.eu-west-1.amazonaws.com", ("execute-api", "eu-west-1")),
    ("s3.cn-north-1.amazonaws.com.cn", ("s3", "cn-north-1")),
    ("iam.cn-north-1.amazonaws.com.cn", ("iam", "cn-north-1")),
    ("bucket.s3.cn-northwest-1.amazonaws.com.cn", ("s3", "cn-northwest-1")),
    # not an AWS endpoint this parser knows: None, never a guess
    ("example.com", None),
    ("amazonaws.com", None),
    ("amazonaws.com.cn", None),
    ("iam.amazonaws.com.cn", None),  # the China partition has no region-less endpoints
    ("eu-west-1.amazonaws.com", None),
    ("a.b.amazonaws.com", None),
    ("s3.amazonaws.com.evil.example", None),
    ("s3.eu-west-1.amazonaws.com.example.com", None),
    ("notamazonaws.com", None),
    ("under_score.eu-west-1.amazonaws.com", None),
    ("", None),
])
def test_host_scope(host, want):
    assert host_scope(host) == want


_LABELS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._*AZ", max_size=30)


@given(st.one_of(
    st.text(max_size=80),
    st.builds(lambda a, b: a + b, _LABELS,
              st.sampled_from([".amazonaws.com", ".amazonaws.com.cn", ".eu-west-1.amazonaws.com",
                               ".s3.amazonaws.com", "amazonaws.com", ""]))))
def test_host_scope_never_raises(host):
    got = host_scope(host)
    assert got is None or (isinstance(got, tuple) and len(got) == 2
                           and all(isinstance(x, str) and x for x in got))


@pytest.mark.parametrize(("sign", "aws", "host", "want"), [
    (SignRef("k", "sqs", "eu-west-3"), AwsRef("us-east-1", "s3"), "s3.eu-west-1.amazonaws.com",
     ("sqs", "eu-west-3", "rule", "rule")),
    (SignRef("k"), AwsRef("us-east-2", "s3"), "sqs.eu-west-1.amazonaws.com",
     ("s3", "us-east-2", "secret", "secret")),
    (SignRef("k", region="eu-north-1"), AwsRef(service="sqs"), "s3.eu-west-1.amazonaws.com",
     ("sqs", "eu-north-1", "secret", "rule")),
    (SignRef("k"), AwsRef(), "s3.eu-west-1.amazonaws.com", ("s3", "eu-west-1", "host", "host")),
    (SignRef("k", service="execute-api"), AwsRef(), "sqs.eu-west-1.amazonaws.com",
     ("execute-api", "eu-west-1", "rule", "host")),
    (SignRef("k"), AwsRef(service="s3"), "storage.example.com", ("s3", None, "secret", "host")),
    (SignRef("k"), AwsRef(), None, (None, None, "host", "host")),
])
def test_precedence_rule_then_secret_then_host(sign, aws, host, want):
    s = resolve(sign, aws, host)
    assert (s.service, s.region, s.service_from, s.region_from) == want
    assert s.complete == (None not in want)


@pytest.mark.parametrize(("hosts", "want"), [
    (("storage.example.com",), False),
    (("*.example.com", "minio.internal"), False),
    (("s3.eu-west-1.amazonaws.com",), True),
    (("storage.example.com", "*.amazonaws.com"), True),
    (("*.s3.eu-west-1.amazonaws.com",), True),
    (("*.amazonaws.com.cn",), True),
    (("*.notamazonaws.com",), False),
])
def test_hosts_may_give(hosts, want):
    assert hosts_may_give(hosts) is want


def _write(tmp_path: Path, secret: str, rule: str, hosts: str) -> Path:
    d = tmp_path / "policies"
    d.mkdir(exist_ok=True)
    (d / "p.yaml").write_text(f"""version: v1
secrets:
  aws: {{vault: secret/data/aws, aws: {secret}}}
identities:
  agent:
    rules:
      - name: r
        hosts: {hosts}
        inject: {{sign: {rule}}}
""")
    return d


def _load_error(d: Path) -> str:
    with pytest.raises(PolicyError) as ei:
        load_policy(d)
    return str(ei.value)


@pytest.mark.parametrize(("secret", "rule", "missing"), [
    ("{}", "aws", "service and region"),
    ("{service: s3}", "aws", "region"),
    ("{region: eu-west-1}", "aws", "service"),
    ("{}", "{secret: aws, region: eu-west-1}", "service"),
])
def test_scope_nothing_can_give_is_a_load_error(tmp_path, secret, rule, missing):
    msg = _load_error(_write(tmp_path, secret, rule, "[storage.example.com, '*.example.org']"))
    assert f"identities.agent.rules[0].inject.sign: the SigV4 {missing} of secret 'aws'" in msg
    assert "storage.example.com, *.example.org" in msg
    assert "Fix: write `inject: {sign: {secret: aws, " in msg


@pytest.mark.parametrize(("secret", "rule", "hosts"), [
    ("{}", "{secret: aws, service: s3, region: eu-west-1}", "[minio.internal]"),
    ("{service: s3, region: eu-west-1}", "aws", "[minio.internal]"),
    ("{service: s3}", "{secret: aws, region: eu-west-1}", "[minio.internal]"),
    ("{}", "aws", "[s3.eu-west-1.amazonaws.com]"),
    ("{}", "aws", "[minio.internal, sqs.eu-west-1.amazonaws.com]"),  # 503 for minio at request time
])
def test_scope_that_can_be_given_loads(tmp_path, secret, rule, hosts):
    load_policy(_write(tmp_path, secret, rule, hosts))


def test_bad_rule_scope_names_are_located(tmp_path):
    msg = _load_error(_write(tmp_path, "{}", "{secret: aws, service: S3, region: eu-west-1}",
                             "[s3.eu-west-1.amazonaws.com]"))
    assert "inject.sign.service: service 'S3' is not a valid AWS name" in msg


def test_sign_spec_unknown_key_is_a_schema_error(tmp_path):
    msg = _load_error(_write(tmp_path, "{}", "{secret: aws, regoin: eu-west-1}",
                             "[s3.eu-west-1.amazonaws.com]"))
    assert "regoin" in msg


def test_explain_shows_scope_and_where_each_came_from(tmp_path):
    policy = load_policy(_write(tmp_path, "{service: s3}", "aws",
                                "[s3.eu-west-1.amazonaws.com, minio.test]"))
    out, ok = explain(policy, "agent", "GET", "https://s3.eu-west-1.amazonaws.com/b/k")
    assert ok
    assert ("sign: aws(service=s3, region=eu-west-1) [service from the secret, region from "
            "the host] with secret aws") in out["inject"]
    out, _ = explain(policy, "agent", "GET", "https://minio.test/b/k")
    assert any("host minio.test gives no service/region" in w and "503 secret_unavailable" in w
               for w in out["inject"])


def test_explain_rule_scope_wins(tmp_path):
    policy = load_policy(_write(tmp_path, "{service: sqs, region: us-east-1}",
                                "{secret: aws, service: s3, region: eu-west-1}",
                                "[s3.eu-west-2.amazonaws.com]"))
    out, _ = explain(policy, "agent", "PUT", "https://s3.eu-west-2.amazonaws.com/b/k")
    assert ("sign: aws(service=s3, region=eu-west-1) [service from the rule, region from the "
            "rule] with secret aws") in out["inject"]


def test_report_shows_scope(tmp_path):
    policy = load_policy(_write(tmp_path, "{region: eu-west-1}",
                                "{secret: aws, service: s3}", "[minio.test]"))
    text = format_markdown(build_report(policy, "t"))
    assert ("sign: aws(service=s3, region=eu-west-1) [service from the rule, region from the "
            "secret] with secret aws") in text
