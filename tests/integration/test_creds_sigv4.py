"""AWS SigV4 signed by Sandgate, through a real `sandgate run`, against moto's server with
authentication enforced (every signature checked against the access key moto's IAM holds), and
the official SDK (boto3) in the sandbox holding only a placeholder key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError

from tests.integration.conftest import Proxy, curl, split_status, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

AWS_IP = "127.0.51.6"  # helper 11's loopback range
HOST, UNSIGNED_HOST = "s3.creds.test", "s3-nosign.creds.test"
BADSIG_HOST = "s3-badsig.creds.test"  # signed with the right key id and a wrong secret key
RULE_SCOPE_HOST = "s3-eu.creds.test"  # the rule names service and region
AWS_SHAPED_HOST = "s3.eu-west-2.amazonaws.com"  # pinned to moto: the host gives the scope
NO_SCOPE_HOST = "storage.creds.test"  # same rule as AWS_SHAPED_HOST; gives no scope: 503
BUCKET_HOST = "s3-bucket.creds.test"  # a rule confined to one bucket by `paths`
SQS_HOST, STS_HOST = "sqs.creds.test", "sts.creds.test"  # rules listing `operations:`
S3_HOSTS = (HOST, UNSIGNED_HOST, BADSIG_HOST, RULE_SCOPE_HOST, AWS_SHAPED_HOST, NO_SCOPE_HOST,
            BUCKET_HOST)
HOSTS = (*S3_HOSTS, SQS_HOST, STS_HOST)
ROOT = Path(__file__).parents[2]

POLICY = f"""version: v1
secrets:
  aws: {{vault: secret/data/creds/aws, aws: {{region: us-east-1, service: s3}}}}
  aws-wrong: {{vault: secret/data/creds/aws-wrong, aws: {{region: us-east-1, service: s3}}}}
  scopeless: {{vault: secret/data/creds/aws, aws: {{}}}}
identities:
  agent:
    rules:
      - name: s3
        hosts: [{HOST}]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: aws}}
      - name: s3-wrong-key
        hosts: [{BADSIG_HOST}]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: aws-wrong}}
      - name: s3-not-signed
        hosts: [{UNSIGNED_HOST}]
        private_cidrs: [{AWS_IP}/32]
      - name: s3-rule-scope
        hosts: [{RULE_SCOPE_HOST}]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: {{secret: scopeless, service: s3, region: eu-west-1}}}}
      - name: s3-host-scope
        hosts: [{AWS_SHAPED_HOST}, {NO_SCOPE_HOST}]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: scopeless}}
      - name: s3-one-bucket
        hosts: [{BUCKET_HOST}]
        paths: ["/agent-bucket", "/agent-bucket/**"]
        copy_sources: ["/agent-bucket/**"]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: aws}}
      - name: sqs-send-only  # JSON protocol: X-Amz-Target
        hosts: [{SQS_HOST}]
        operations: [AmazonSQS.CreateQueue, AmazonSQS.SendMessage, "*.GetQueueUrl"]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: {{secret: scopeless, service: sqs, region: us-east-1}}}}
      - name: sts-whoami  # query protocol: Action in the form body
        hosts: [{STS_HOST}]
        operations: [GetCallerIdentity]
        private_cidrs: [{AWS_IP}/32]
        inject: {{sign: {{secret: scopeless, service: sts, region: us-east-1}}}}
"""


@dataclass
class Stack:
    proxy: Proxy
    keys: dict[str, str] = field(repr=False)  # never in a failure's output

    def s3(self, host: str = HOST, key_id: str = "sandgate-placeholder-aws"):
        """The sandbox's SDK: a placeholder key, nothing else."""
        return self.client("s3", host, key_id)

    def client(self, service: str, host: str, key_id: str = "sandgate-placeholder-aws"):
        url = f"http://agent:{self.proxy.token('agent')}@{self.proxy.host}:{self.proxy.port}"
        return boto3.client(
            service, endpoint_url=f"https://{host}", region_name="us-east-1",
            aws_access_key_id=key_id,
            aws_secret_access_key="sandgate-placeholder-aws-secret",
            verify=str(self.proxy.ca),
            config=Config(proxies={"https": url}, s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required",
                          retries={"max_attempts": 1}))


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("creds-sigv4")
    pki = make_pki(tmp / "pki", list(HOSTS))
    out = tmp / "keys.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.moto_s3", AWS_IP, "443", str(pki.cert),
         str(pki.key), str(out)], cwd=ROOT,
        env={**os.environ, "MOTO_S3_CUSTOM_ENDPOINTS": ",".join(
            f"https://{h}" for h in S3_HOSTS)},
        stdout=(tmp / "moto.log").open("wb"),
        stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not out.exists() or not out.read_text():
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError((tmp / "moto.log").read_text()[-3000:])
        time.sleep(0.2)
    keys = json.loads(out.read_text())
    vault = SeedableVault()
    vault.start()
    vault.put_kv2("creds/aws", keys)
    vault.put_kv2("creds/aws-wrong", {"access_key_id": keys["access_key_id"],
                                      "secret_access_key": "test-WRONG-secret-key-0000"})
    (tmp / "policies").mkdir()
    (tmp / "policies" / "aws.yaml").write_text(POLICY)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        *(f"--resolve={h}={AWS_IP}" for h in HOSTS))
    time.sleep(1)  # moto's server binds after writing the keys
    try:
        yield Stack(proxy, keys)
    finally:
        stop_proxy(proxy)
        server.terminate()
        server.wait(10)
        logs = proxy.logs() + (proxy.audit_file.read_text() if proxy.audit_file.exists() else "")
        vault.stop()
        assert_no_secret([logs], [keys["secret_access_key"]], "the proxy's logs or audit")


def test_sdk_with_a_placeholder_works_because_sandgate_signs(stack):
    s3 = stack.s3()
    s3.create_bucket(Bucket="sandgate-test")
    s3.put_object(Bucket="sandgate-test", Key="hello.txt", Body=b"hello from the sandbox",
                  Metadata={"owner": "agent"})
    got = s3.get_object(Bucket="sandgate-test", Key="hello.txt")
    assert got["Body"].read() == b"hello from the sandbox"
    assert got["Metadata"] == {"owner": "agent"}  # an X-Amz-Meta header, signed as sent
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "s3" and e.get("injected"))
    assert ev["injected"] == ["aws@1: aws sigv4 s3 us-east-1"]


def test_without_sandgate_signing_moto_refuses_the_placeholder(stack):
    with pytest.raises(ClientError) as ei:
        stack.s3(UNSIGNED_HOST, "test-sandbox-has-no-key").list_buckets()
    assert ei.value.response["Error"]["Code"] == "InvalidAccessKeyId"  # moto's, not ours


def test_moto_checks_the_signature_itself(stack):
    with pytest.raises(ClientError) as ei:
        stack.s3(BADSIG_HOST, "test-sandbox-has-no-key").list_buckets()
    assert ei.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


def test_another_secrets_placeholder_is_exfiltration(stack):
    with pytest.raises(ClientError) as ei:  # the `aws` placeholder on the aws-wrong rule
        stack.s3(BADSIG_HOST).list_buckets()
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    ev = stack.proxy.wait_audit(lambda e: e.get("code") == "exfiltration")
    assert ev["rule"] == "s3-wrong-key" and ev["exfiltration"] == ["aws:placeholder:header"]


def test_streaming_signed_payload_refused(stack):
    r = curl(stack.proxy, "agent", f"https://{HOST}/sandgate-test/x", "-X", "PUT",
             "-H", "x-amz-content-sha256: STREAMING-AWS4-HMAC-SHA256-PAYLOAD",
             "--data-binary", "abc")
    body, status = split_status(r.stdout)
    assert status == 400
    assert "streaming signed payloads" in json.loads(body)["reason"]


def test_rule_names_service_and_region(stack):
    """The secret names neither; the rule's `sign: {service, region}` is what is signed for
    (moto checks the signature over that credential scope)."""
    assert "Buckets" in stack.s3(RULE_SCOPE_HOST, "sandgate-placeholder-scopeless").list_buckets()
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "s3-rule-scope"
                                and e.get("injected"))
    assert ev["injected"] == ["scopeless@1: aws sigv4 s3 eu-west-1"]


def test_aws_endpoint_host_gives_service_and_region(stack):
    assert "Buckets" in stack.s3(AWS_SHAPED_HOST, "sandgate-placeholder-scopeless").list_buckets()
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "s3-host-scope"
                                and e.get("injected"))
    assert ev["injected"] == ["scopeless@1: aws sigv4 s3 eu-west-2"]


def test_host_without_scope_is_refused_not_forwarded_unsigned(stack):
    r = curl(stack.proxy, "agent", f"https://{NO_SCOPE_HOST}/")
    body, status = split_status(r.stdout)
    assert status == 503
    assert json.loads(body)["code"] == "secret_unavailable"
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") == "s3-host-scope"
                                and e.get("code") == "secret_unavailable")
    assert not ev.get("injected")


def _exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response["Error"]["Code"] in ("404", "NoSuchKey"):
            return False
        raise
    return True


def test_copy_from_a_bucket_the_rule_does_not_allow_is_refused(stack):
    """Issue 34: a rule confined to one bucket by `paths` must not sign an x-amz-copy-source
    naming another bucket: S3 would copy the forbidden object into the allowed bucket, where
    the sandbox could read it. Refused before anything is signed; nothing is copied."""
    admin = stack.s3()  # the unconfined rule: sets up both buckets
    admin.create_bucket(Bucket="private-data")
    admin.put_object(Bucket="private-data", Key="payroll.csv", Body=b"test-payroll-row")
    admin.create_bucket(Bucket="agent-bucket")
    confined = stack.s3(BUCKET_HOST)
    confined.put_object(Bucket="agent-bucket", Key="own.txt", Body=b"mine")  # its own bucket
    with pytest.raises(ClientError) as ei:
        confined.copy_object(Bucket="agent-bucket", Key="stolen.csv",
                             CopySource={"Bucket": "private-data", "Key": "payroll.csv"})
    r = ei.value.response
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert r["ResponseMetadata"]["HTTPHeaders"]["x-sandgate-reason"] == "no_rule"
    assert not _exists(admin, "agent-bucket", "stolen.csv")
    ev = stack.proxy.wait_audit(lambda e: e.get("code") == "no_rule"
                                and e.get("path") == "/agent-bucket/stolen.csv")
    assert "x-amz-copy-source" in ev["reason"] and not ev.get("injected")


def test_copy_from_an_admitted_source_is_signed(stack):
    """`copy_sources:` admits copies inside the rule's own bucket (CopyObject, and
    UploadPartCopy: the same header on a multipart upload)."""
    admin = stack.s3()
    admin.create_bucket(Bucket="agent-bucket")
    confined = stack.s3(BUCKET_HOST)
    confined.put_object(Bucket="agent-bucket", Key="a.txt", Body=b"x" * 10)
    confined.copy_object(Bucket="agent-bucket", Key="b.txt",
                         CopySource={"Bucket": "agent-bucket", "Key": "a.txt"})
    assert confined.get_object(Bucket="agent-bucket", Key="b.txt")["Body"].read() == b"x" * 10
    ev = stack.proxy.wait_audit(lambda e: (e.get("path") or "").startswith("/agent-bucket/b.txt")
                                and e.get("method") == "PUT")
    assert ev["injected"] == [
        "aws@1: aws sigv4 s3 us-east-1 (x-amz-copy-source /agent-bucket/a.txt)"]
    up = confined.create_multipart_upload(Bucket="agent-bucket", Key="c.txt")
    part = confined.upload_part_copy(Bucket="agent-bucket", Key="c.txt", PartNumber=1,
                                     UploadId=up["UploadId"],
                                     CopySource={"Bucket": "agent-bucket", "Key": "a.txt"})
    assert part["CopyPartResult"]["ETag"]


def test_upload_part_copy_from_a_forbidden_bucket_is_refused(stack):
    admin = stack.s3()
    admin.create_bucket(Bucket="private-data")
    admin.put_object(Bucket="private-data", Key="payroll.csv", Body=b"test-payroll-row")
    admin.create_bucket(Bucket="agent-bucket")
    confined = stack.s3(BUCKET_HOST)
    up = confined.create_multipart_upload(Bucket="agent-bucket", Key="d.txt")
    with pytest.raises(ClientError) as ei:
        confined.upload_part_copy(Bucket="agent-bucket", Key="d.txt", PartNumber=1,
                                  UploadId=up["UploadId"],
                                  CopySource={"Bucket": "private-data", "Key": "payroll.csv"})
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    parts = admin.list_parts(Bucket="agent-bucket", Key="d.txt", UploadId=up["UploadId"])
    assert not parts.get("Parts")  # nothing copied into the upload


@pytest.mark.parametrize(("version", "param"), [("s3v4", "X-Amz-Signature"),
                                                ("s3", "Signature")])  # SigV2 query auth
def test_presigned_url_refused_before_anything_is_signed(stack, version, param):
    """A presigned URL's signature parameters are never forwarded beside Sandgate's own."""
    presigner = boto3.client("s3", endpoint_url=f"https://{BUCKET_HOST}",
                             region_name="us-east-1",
                             aws_access_key_id="sandgate-placeholder-aws",
                             aws_secret_access_key="sandgate-placeholder-aws-secret",
                             config=Config(signature_version=version))
    url = presigner.generate_presigned_url(
        "get_object", Params={"Bucket": "agent-bucket", "Key": "a.txt"})
    r = curl(stack.proxy, "agent", url)
    body, status = split_status(r.stdout)
    assert status == 403
    doc = json.loads(body)
    assert doc["code"] == "no_rule" and param in doc["reason"]


def test_json_protocol_operations_not_listed_are_refused(stack):
    """`operations:` judges X-Amz-Target: the queue is created and written to, and the
    DeleteQueue the rule does not list is refused before anything is signed."""
    sqs = stack.client("sqs", SQS_HOST, "sandgate-placeholder-scopeless")
    url = sqs.create_queue(QueueName="sandgate-ops")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="hello from the sandbox")
    assert stack.proxy.wait_audit(lambda e: e.get("host") == SQS_HOST and e.get("injected"))
    assert stack.proxy.wait_audit(lambda e: e.get("injected") == [
        "scopeless@1: aws sigv4 sqs us-east-1 (operation AmazonSQS.SendMessage)"])
    with pytest.raises(ClientError) as ei:
        sqs.delete_queue(QueueUrl=url)
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    ev = stack.proxy.wait_audit(lambda e: e.get("rule") is None and e.get("code") == "no_rule"
                                and e.get("host") == SQS_HOST)
    assert "'AmazonSQS.DeleteQueue'" in ev["reason"] and not ev.get("injected")
    assert sqs.get_queue_url(QueueName="sandgate-ops")["QueueUrl"]  # still there


def test_query_protocol_action_in_the_form_body_is_judged(stack):
    sts = stack.client("sts", STS_HOST, "sandgate-placeholder-scopeless")
    assert sts.get_caller_identity()["Arn"]
    with pytest.raises(ResponseParserError, match="sandgate_refused"):
        sts.get_session_token()  # a query-protocol SDK expects XML; the refusal is JSON
    ev = stack.proxy.wait_audit(lambda e: e.get("code") == "no_rule"
                                and e.get("host") == STS_HOST)
    assert "'GetSessionToken' (Action in the body)" in ev["reason"]


@pytest.mark.parametrize("path", ["/private-data/..%2Fagent-bucket/planted-1",
                                  "/private-data/../agent-bucket/planted-2"])
def test_dot_segments_do_not_reach_a_bucket_the_rule_forbids(stack, path):
    """The rule judges the resolved path (/agent-bucket/...); S3 resolves nothing and would
    write the key `../agent-bucket/...` into private-data. Refused: what is signed must be the
    path judged: the decision refuses a dot segment for every rule (bad_request)."""
    admin = stack.s3()
    admin.create_bucket(Bucket="private-data")
    r = curl(stack.proxy, "agent", f"https://{BUCKET_HOST}{path}", "--path-as-is", "-X", "PUT",
             "--data-binary", "planted")
    body, status = split_status(r.stdout)
    assert status == 400 and json.loads(body)["code"] == "bad_request"
    keys = [o["Key"] for o in admin.list_objects_v2(Bucket="private-data").get("Contents", [])]
    assert not [k for k in keys if "planted" in k]
