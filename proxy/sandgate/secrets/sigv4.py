"""AWS SigV4: Sandgate signs the request; the sandbox holds no key and cannot sign.

botocore's own signers (SigV4Auth; S3SigV4Auth for s3, which sends UNSIGNED-PAYLOAD over
https as the SDKs do and hashes the payload otherwise). The client's signing headers
(Authorization, X-Amz-Date, X-Amz-Content-SHA256, X-Amz-Security-Token) are removed first;
what is signed is the request as judged: method, the judged host, path and query, and only the
headers a signing rule judged (secrets/aws_request.py says which: Host, Content-Type,
Content-MD5, the operation, admitted copy sources, content headers such as metadata, ACL and
checksums). Refused (400 bad_request): a streaming signed payload (aws-chunked, STREAMING-*:
each chunk would need the key), a presigned URL's X-Amz-* query parameters, and any x-amz-*
header not judged (stages/s36_sigv4.py refuses those first, naming the rule).
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from mitmproxy import http

from sandgate.errors import BadRequest, Code
from sandgate.secrets.aws_request import SIGNING_HEADERS as SIGNING_HEADERS  # its old home
from sandgate.secrets.aws_request import presigned_names, signed_header


def check_signable(req: http.Request) -> None:
    sha = req.headers.get("x-amz-content-sha256", "")
    if (sha.upper().startswith("STREAMING-")
            or "aws-chunked" in req.headers.get("content-encoding", "").lower()
            or "x-amz-decoded-content-length" in req.headers):
        raise BadRequest(Code.BAD_REQUEST, "streaming signed payloads (aws-chunked) cannot be "
                         "signed by Sandgate", )
    if presigned_names(parse_qsl(req.path.partition("?")[2], keep_blank_values=True)):
        raise BadRequest(Code.BAD_REQUEST, "a presigned URL carries its own signature; "
                         "Sandgate signs requests itself (send it without X-Amz-* query "
                         "parameters)")
    unjudged = sorted({k.lower() for k in req.headers if k.lower().startswith("x-amz-")
                       and k.lower() not in SIGNING_HEADERS and not signed_header(k.lower())})
    if unjudged:  # the decision refuses these first (stages/s36_sigv4.py): never signed
        raise BadRequest(Code.BAD_REQUEST, f"the header {unjudged[0]} is not one Sandgate "
                         "judges, so it will not sign it")


def sign(req: http.Request, url: str, service: str, region: str, access_key_id: str,
         secret_key: str, session_token: str | None) -> None:
    """Sign `req` (whose judged URL is `url`) in place for `service` in `region`."""
    check_signable(req)
    for h in SIGNING_HEADERS:
        req.headers.pop(h, None)
    headers = {k: v for k, v in req.headers.items() if signed_header(k.lower())}
    areq = AWSRequest(method=req.method, url=url, data=req.raw_content or b"",
                      headers=headers)
    signer = S3SigV4Auth if service == "s3" else SigV4Auth
    signer(Credentials(access_key_id, secret_key, session_token), service,
           region).add_auth(areq)
    for h in SIGNING_HEADERS:
        v = areq.headers.get(h)
        if v is not None:
            req.headers[h] = v
