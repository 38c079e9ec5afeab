"""SigV4 signing by Sandgate (sandgate.secrets.sigv4): the client's signing headers are
replaced, the signature is botocore's over the judged URL, and what cannot be signed by a
proxy is refused. tests/integration/test_creds_sigv4.py checks the signatures with moto's
server (authentication enforced) and boto3."""

from __future__ import annotations

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from mitmproxy.test import tutils

from sandgate.errors import BadRequest
from sandgate.secrets.sigv4 import sign

pytestmark = pytest.mark.unit

AWS = ("s3", "eu-west-1")  # (service, region)
URL = "https://s3.example.com/bucket/key?x=1"


def req(**headers: str):
    r = tutils.treq(method=b"PUT", path=b"/bucket/key?x=1", content=b"data",
                    headers=tuple((k.encode(), v.encode()) for k, v in
                                  {"host": "s3.example.com", **headers}.items()))
    return r


def test_client_signing_headers_replaced_and_signature_is_botocores():
    r = req(authorization="AWS4-HMAC-SHA256 Credential=sandgate-placeholder-aws/x",
            **{"x-amz-date": "20000101T000000Z", "x-amz-security-token": "client-token",
               "x-amz-meta-owner": "agent", "user-agent": "sdk"})
    sign(r, URL, *AWS, "test-key-id", "test-secret-key", None)
    auth = r.headers["authorization"]
    assert auth.startswith("AWS4-HMAC-SHA256 Credential=test-key-id/")
    assert "/eu-west-1/s3/aws4_request" in auth
    assert "x-amz-security-token" not in r.headers  # the client's is gone; none of ours
    assert r.headers["x-amz-date"] != "20000101T000000Z"
    assert "x-amz-meta-owner" in auth  # signed as sent
    assert "user-agent" not in auth.split("SignedHeaders=")[1]
    # botocore's signer, computing the signature itself for the same request and instant
    expect = AWSRequest(method="PUT", url=URL, data=b"data", headers={
        "host": "s3.example.com", "x-amz-meta-owner": "agent",
        "x-amz-date": r.headers["x-amz-date"],
        "x-amz-content-sha256": r.headers["x-amz-content-sha256"]})
    expect.context["timestamp"] = r.headers["x-amz-date"]
    signer = S3SigV4Auth(Credentials("test-key-id", "test-secret-key"), "s3", "eu-west-1")
    string_to_sign = signer.string_to_sign(expect, signer.canonical_request(expect))
    assert auth.split("Signature=")[1] == signer.signature(string_to_sign, expect)


def test_session_token_added_and_signed():
    r = req()
    sign(r, URL, *AWS, "test-key-id", "test-secret-key", "test-session-token")
    assert r.headers["x-amz-security-token"] == "test-session-token"
    assert "x-amz-security-token" in r.headers["authorization"]


@pytest.mark.parametrize(("headers", "path", "why"), [
    ({"x-amz-content-sha256": "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"}, None, "streaming"),
    ({"content-encoding": "aws-chunked"}, None, "streaming"),
    ({"x-amz-decoded-content-length": "4"}, None, "streaming"),
    ({}, b"/b/k?X-Amz-Signature=abc&X-Amz-Credential=x", "presigned"),
    ({}, b"/b/k?AWSAccessKeyId=a&Signature=s&Expires=1", "presigned"),  # SigV2 query auth
    ({"x-amz-some-future-header": "x"}, None, "not one Sandgate judges"),
    ({"x-amz-account-id": "111122223333"}, None, "not one Sandgate judges"),
])
def test_unsignable_refused(headers, path, why):
    r = req(**headers)
    if path is not None:
        r.path = path.decode()
    with pytest.raises(BadRequest, match=why):
        sign(r, URL, *AWS, "test-key-id", "test-secret-key", None)


def test_only_judged_headers_are_signed():
    """A judged copy source and content headers are signed; other headers are forwarded
    unsigned (the upstream ignores or rejects them, never acts on them as vouched for)."""
    r = req(**{"x-amz-copy-source": "/bucket/other", "x-amz-copy-source-if-match": "e",
               "x-amz-acl": "private", "range": "bytes=0-1", "cache-control": "no-cache",
               "x-amzn-trace-id": "t"})
    sign(r, URL, *AWS, "test-key-id", "test-secret-key", None)
    signed = r.headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert {"x-amz-copy-source", "x-amz-copy-source-if-match", "x-amz-acl", "host"} <= set(
        signed)
    assert not {"range", "cache-control", "x-amzn-trace-id"} & set(signed)
    assert r.headers["range"] == "bytes=0-1"  # forwarded as sent
