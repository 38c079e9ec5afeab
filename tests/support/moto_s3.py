"""moto's server (every AWS service moto implements, on one port) with authentication ENFORCED
(INITIAL_NO_AUTH_ACTION_COUNT=0: every request's SigV4 signature is checked against the access
keys moto's IAM holds), over TLS on loopback, as a subprocess:

    python -m tests.support.moto_s3 HOST PORT CERT KEY OUT_JSON

Before serving it creates an IAM user with an access key and an allow-all policy, and writes
{"access_key_id": ..., "secret_access_key": ...} to OUT_JSON (for the test to put in OpenBao)."""

from __future__ import annotations

import json
import os
import sys

os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # before moto reads its settings
os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")

from moto.core import DEFAULT_ACCOUNT_ID
from moto.iam.models import iam_backends
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})

if __name__ == "__main__":
    host, port, cert, key, out = sys.argv[1:6]
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["global"]
    iam.create_user(region_name="us-east-1", user_name="sandgate-test")
    iam.put_user_policy("sandgate-test", "all", ALLOW_ALL)
    k = iam.create_access_key("sandgate-test", prefix="TEST")  # not shaped like a real key
    with open(out, "w") as f:
        json.dump({"access_key_id": k.access_key_id, "secret_access_key": k.secret_access_key},
                  f)
    run_simple(host, int(port), DomainDispatcherApplication(create_backend_app),
               ssl_context=(cert, key), threaded=True)
