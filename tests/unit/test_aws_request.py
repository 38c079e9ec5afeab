"""What a signing rule judges of a request (sandgate.secrets.aws_request) and how decide()
uses it: copy sources admitted by `copy_sources:`, operations listed in `operations:`,
presigned parameters and unknown x-amz-* headers refused. "What is judged is what is signed":
a request the parser accepts carries no x-amz-* header the signer would sign unjudged.
tests/integration/test_creds_sigv4.py runs the same against moto with boto3."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sandgate.decision import decide, judge
from sandgate.errors import Code
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.paths import normalise_path
from sandgate.request import parse_query, parse_url
from sandgate.secrets.aws_request import (
    SIGNING_HEADERS,
    SOURCE_HEADERS,
    AwsParts,
    parse,
    path_as_judged,
    signed_header,
    source_path,
)
from sandgate.text import percent_decode

pytestmark = pytest.mark.unit

FORM = "application/x-www-form-urlencoded; charset=utf-8"


def parts(headers: dict[str, str] | None = None, query: str = "", body: bytes | None = None,
          content_type: str | None = None, encoded: bool = False) -> AwsParts:
    return parse(list((headers or {}).items()), parse_query(query), body, content_type,
                 encoded)


# --- the parser ------------------------------------------------------------------------------

def test_copy_source_is_read_as_the_path_it_names():
    p = parts({"x-amz-copy-source": "private-data/payroll%20q1.csv?versionId=3"})
    assert p.refusal is None
    assert p.sources == (("x-amz-copy-source", "/private-data/payroll q1.csv"),)


@pytest.mark.parametrize("value", [
    "/agent-bucket/../private-data/payroll.csv",  # S3 reads the key "../private-data/..."
    "/agent-bucket/a%2F..%2F..%2Fprivate-data/x",  # the same, escaped
    "/agent-bucket//x", "/agent-bucket/./x", "agent-bucket", "/",
    "arn:aws:s3:us-east-1:123456789012:accesspoint/ap/object/x",
    "/agent-bucket/x?versionId=1&other=2", "/agent-bucket/x?acl", "/agent-bucket/%zz",
    "/agent-bucket/a+b",  # a space to form decoders, a plus to others
])
def test_copy_source_that_is_not_one_plain_path_is_refused(value):
    p = parts({"x-amz-copy-source": value})
    assert p.refusal is not None and "x-amz-copy-source" in p.refusal
    assert p.hint == "name the source in x-amz-copy-source as /bucket/key"


def test_source_given_twice_is_refused():
    p = parse([("x-amz-copy-source", "/a/x"), ("x-amz-copy-source", "/b/y")], ())
    assert p.refusal == "it gives the x-amz-copy-source header more than once"


@pytest.mark.parametrize("name", ["x-amz-copy-source-if-match", "x-amz-copy-source-range",
                                  "x-amz-source-expected-bucket-owner",
                                  "x-amz-rename-source-if-match"])
def test_source_qualifier_without_a_source_is_refused(name):
    assert parts({name: "x"}).refusal is not None
    assert parts({name: "x", "x-amz-copy-source": "/a/b"}).refusal is None


@pytest.mark.parametrize("name", ["x-amz-server-side-encryption-aws-kms-key-id",
                                  "x-amz-account-id", "x-amz-request-route",
                                  "x-amz-some-future-header"])
def test_headers_no_rule_judges_are_refused(name):
    p = parts({name: "x"})
    assert p.refusal is not None and name in p.refusal
    assert p.hint is not None and name in p.hint


def test_content_and_signing_headers_pass():
    p = parts({"x-amz-meta-owner": "agent", "x-amz-acl": "private",
               "x-amz-checksum-crc32": "AAAAAA==", "x-amz-server-side-encryption": "AES256",
               "x-amz-date": "x", "authorization": "x", "user-agent": "sdk", "range": "1-2"})
    assert p == AwsParts()


@pytest.mark.parametrize("query", [
    "X-Amz-Signature=abc", "x-amz-credential=a", "X-AMZ-Date=1", "X-Amz-Security-Token=t",
    "AWSAccessKeyId=a&Signature=s&Expires=1", "signature=s",
])
def test_presigned_parameters_are_refused(query):
    p = parts(query=query)
    assert p.refusal is not None and "presigned" in p.refusal


@pytest.mark.parametrize(("path", "judged"), [
    ("/agent-bucket/x", True), ("/agent-bucket/dir/", True), ("/", True),
    ("/agent-bucket/a%2Fb%20c", True),  # S3 decodes %2F too: the key a/b c, as judged
    ("/private-data/../agent-bucket/x", False), ("/private-data/..%2Fagent-bucket/x", False),
    ("/private-data/%2E%2E/agent-bucket/x", False), ("/agent-bucket/./x", False),
    ("/agent-bucket//x", False), ("/agent-bucket/a%5Cb", False), ("/agent-bucket/%zz", False),
])
def test_a_signed_path_must_be_the_path_judged(path, judged):
    assert path_as_judged(path) is judged
    assert (parse([], (), path=path).refusal is None) is judged


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "%2E", "%2F", "%2e%2E", "%5C",
                                 "c%20d"]), min_size=1, max_size=6))
def test_an_accepted_path_reads_as_judged(segments):
    """Whatever the segments: a path the parser accepts is, decoded once as S3 decodes it,
    exactly the path the decision judged (so S3 acts on the object the rule matched)."""
    raw = "/" + "/".join(segments)
    if path_as_judged(raw):
        assert percent_decode(raw) == normalise_path(raw)
        assert not {".", ".."} & set(percent_decode(raw).split("/"))


def test_unreadable_query_is_refused():
    assert parts(query="Action=A+B").refusal is not None


@pytest.mark.parametrize(("kw", "op", "where"), [
    ({"headers": {"X-Amz-Target": "DynamoDB_20120810.GetItem"}}, "DynamoDB_20120810.GetItem",
     "X-Amz-Target"),
    ({"query": "Action=SendMessage&Version=2012-11-05"}, "SendMessage", "Action in the query"),
    ({"body": b"Action=Get%43allerIdentity&Version=2011-06-15", "content_type": FORM},
     "GetCallerIdentity", "Action in the body"),
    ({"body": b'{"Action": "X"}', "content_type": "application/x-amz-json-1.0"}, None, None),
])
def test_operation(kw, op, where):
    p = parts(**kw)
    assert (p.refusal, p.operation, p.operation_from) == (None, op, where)


@pytest.mark.parametrize("kw", [
    {"headers": {"X-Amz-Target": "A.B"}, "query": "Action=C"},
    {"query": "Action=A&Action=A"},
    {"query": "action=DeleteQueue"},  # another spelling some server may read
    {"query": "Action=A", "body": b"Action=A", "content_type": FORM},
    {"body": b"Version=1&Action=A&ACTION=B", "content_type": FORM},
    {"body": b"Action=A&x=%zz", "content_type": FORM},  # a field that cannot be read
    {"body": b"Action=A", "content_type": FORM, "encoded": True},
])
def test_operation_named_ambiguously_is_refused(kw):
    assert parts(**kw).refusal is not None


# --- properties ------------------------------------------------------------------------------

_SEGMENT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                   min_size=1, max_size=12)


@given(st.lists(_SEGMENT, min_size=2, max_size=5), st.booleans())
@example(["/0", "0"], False)  # found by hypothesis: a first segment that starts with "/"
def test_a_quoted_source_reads_back_exactly_or_is_refused(segments, slash):
    """The path judged is the object S3 reads: whatever an SDK encodes, the judged path is
    its exact decoding, or the source is refused (never a re-spelled path)."""
    plain = "/".join(segments)
    value = ("/" if slash else "") + quote(plain, safe="/")
    got = source_path(value)
    if got is not None:
        # a first segment that starts with '/' (the strategy allows '/' in a segment) makes the
        # value start with '/' even without `slash`: then it is that path as written
        assert got == (plain if value == quote(plain, safe="/") and plain.startswith("/")
                       else "/" + plain)
        segs = got.split("/")[1:]  # a trailing "/" (a folder marker key) is kept
        assert not {".", ".."} & set(segs) and "" not in segs[:-1]
    else:
        assert any(s in (".", "..") or "/" in s or "\\" in s or "+" in s for s in segments)


@given(st.text(max_size=40))
def test_any_source_value_is_its_own_decoding_or_refused(value):
    got = source_path(value)
    if got is not None:
        raw = value.strip().partition("?")[0]
        assert got == percent_decode(raw if raw.startswith("/") else "/" + raw)


_NAMES = st.sampled_from([
    "x-amz-meta-a", "x-amz-acl", "x-amz-copy-source", "x-amz-copy-source-range",
    "x-amz-rename-source", "x-amz-target", "x-amz-date", "x-amz-security-token",
    "x-amz-server-side-encryption-aws-kms-key-id", "x-amz-account-id", "x-amz-tagging",
    "x-amz-source-expected-bucket-owner", "x-amz-grant-read", "content-type", "range",
    "authorization", "x-amzn-trace-id"]) | st.from_regex(r"[xX]-[aA][mM][zZ]-[a-z-]{1,12}",
                                                          fullmatch=True)


@given(st.lists(st.tuples(_NAMES, st.sampled_from(["/b/k", "v", "/b/../k"])), max_size=6))
def test_what_is_signed_is_what_was_judged(headers):
    """A request the parser accepts carries no x-amz-* header the signer would sign without
    judging it: every one is Sandgate's own, content, the judged operation, or a source
    listed in `sources` (which `copy_sources:` must admit)."""
    p = parse(headers, ())
    if p.refusal is not None:
        return
    for name, _ in headers:
        low = name.lower()
        if low.startswith("x-amz-"):
            assert low in SIGNING_HEADERS or signed_header(low)
        if low in SOURCE_HEADERS:
            assert low in {h for h, _ in p.sources}


# --- the decision ----------------------------------------------------------------------------

POLICY = """
version: v1
secrets:
  aws: {vault: secret/data/aws/agent, aws: {region: eu-west-1}}
identities:
  agent:
    rules:
      - name: s3-artifacts
        hosts: [s3.eu-west-1.amazonaws.com]
        paths: ["/acme-artifacts/**"]
        copy_sources: ["/acme-artifacts/**", "/acme-public/*.txt"]
        inject: {sign: aws}
      - name: s3-reports
        hosts: [s3.eu-west-1.amazonaws.com]
        paths: ["/acme-reports/**"]
        inject: {sign: aws}
      - name: dynamodb-read
        hosts: [dynamodb.eu-west-1.amazonaws.com]
        operations: ["DynamoDB_20120810.GetItem", "*.Query"]
        inject: {sign: aws}
      - name: sqs-send
        hosts: [sqs.eu-west-1.amazonaws.com]
        operations: [SendMessage, GetQueueUrl]
        inject: {sign: aws}
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d: Path = tmp_path_factory.mktemp("aws-policy")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


def _decide(policy, method: str, url: str, headers: dict[str, str] | None = None,
            body: bytes | None = None):
    info = parse_url(method, url)
    return decide(policy, "agent", info, aws=parse(list((headers or {}).items()), info.query,
                                                   body, FORM if body else None))


S3 = "https://s3.eu-west-1.amazonaws.com"


def test_copy_from_a_forbidden_bucket_is_not_signed(policy):
    d = _decide(policy, "PUT", f"{S3}/acme-artifacts/stolen.csv",
                {"x-amz-copy-source": "/private-data/payroll.csv"})
    assert (d.allowed, d.code) == (False, Code.NO_RULE)
    assert d.reason == ("PUT https://s3.eu-west-1.amazonaws.com:443/acme-artifacts/stolen.csv "
                        "is not signed for agent: rule 's3-artifacts' does not admit the "
                        "x-amz-copy-source /private-data/payroll.csv: its `copy_sources:` do "
                        "not match it")
    assert d.hint is not None and "copy_sources:" in d.hint and "s3-artifacts" in d.hint


@pytest.mark.parametrize("source", ["/acme-artifacts/a/b.tgz", "acme-public/readme.txt",
                                    "/acme-artifacts/x%20y?versionId=7"])
def test_copy_from_an_admitted_source_is_signed(policy, source):
    d = _decide(policy, "PUT", f"{S3}/acme-artifacts/copy", {"x-amz-copy-source": source})
    assert d.allowed and d.rule_name == "s3-artifacts"


def test_a_rule_without_copy_sources_admits_none(policy):
    d = _decide(policy, "PUT", f"{S3}/acme-reports/x",
                {"x-amz-copy-source": "/acme-reports/y"})
    assert not d.allowed and "it lists no `copy_sources:`" in d.reason
    assert _decide(policy, "PUT", f"{S3}/acme-reports/x").allowed  # a plain PUT still is


@pytest.mark.parametrize(("url", "headers", "body", "allowed"), [
    ("https://dynamodb.eu-west-1.amazonaws.com/",
     {"x-amz-target": "DynamoDB_20120810.GetItem"}, None, True),
    ("https://dynamodb.eu-west-1.amazonaws.com/",
     {"x-amz-target": "DynamoDB_20120810.Query"}, None, True),
    ("https://dynamodb.eu-west-1.amazonaws.com/",
     {"x-amz-target": "DynamoDB_20120810.DeleteTable"}, None, False),
    ("https://dynamodb.eu-west-1.amazonaws.com/", {}, None, False),  # names no operation
    ("https://sqs.eu-west-1.amazonaws.com/?Action=SendMessage", {}, None, True),
    ("https://sqs.eu-west-1.amazonaws.com/", {}, b"Action=SendMessage&MessageBody=a+b", True),
    ("https://sqs.eu-west-1.amazonaws.com/", {}, b"Action=DeleteQueue", False),
    ("https://sqs.eu-west-1.amazonaws.com/?Action=DeleteQueue", {}, None, False),
])
def test_operations(policy, url, headers, body, allowed):
    d = _decide(policy, "POST", url, headers, body)
    assert d.allowed is allowed
    if not allowed:
        assert d.code == Code.NO_RULE and "operation" in d.reason and d.hint


def test_not_yet_read_parts_are_judged_later(policy):
    """aws=None: the proxy's head stage, before the body; stages/s36_sigv4 decides again."""
    info = parse_url("POST", "https://dynamodb.eu-west-1.amazonaws.com/")
    assert decide(policy, "agent", info).allowed


def test_judge_reads_the_headers_it_is_given(policy):
    """explain, check and fixtures judge through `judge`, with the request's headers."""
    url = f"{S3}/acme-artifacts/x"
    assert judge(policy, "agent", "PUT", url, {}).decision.allowed
    v = judge(policy, "agent", "PUT", url, {},
              headers=[("x-amz-copy-source", "/private-data/payroll.csv")])
    assert not v.decision.allowed and "x-amz-copy-source" in v.decision.reason
    v = judge(policy, "agent", "GET", url + "?X-Amz-Signature=abc", {})
    assert not v.decision.allowed and "presigned" in v.decision.reason
    v = judge(policy, "agent", "PUT", f"{S3}/private-data/..%2Facme-artifacts/x", {})
    assert not v.decision.allowed and "'..'" in v.decision.reason


# --- the tools: explain, check's fixtures, the CLI -------------------------------------------

def test_explain_shows_what_is_signed_and_refuses_what_is_not(policy):
    from sandgate.explain.answer import explain

    url = f"{S3}/acme-artifacts/copy"
    out, ok = explain(policy, "agent", "PUT", url,
                      headers=[("x-amz-copy-source", "/acme-public/notes.txt")])
    assert ok and out["signed"]["sources"] == ["x-amz-copy-source: /acme-public/notes.txt"]
    assert out["signed"]["copy_sources"] == ["/acme-artifacts/**", "/acme-public/*.txt"]
    out, ok = explain(policy, "agent", "POST",
                      "https://dynamodb.eu-west-1.amazonaws.com/",
                      headers=[("X-Amz-Target", "DynamoDB_20120810.DeleteTable")])
    assert not ok and out["code"] == "no_rule"
    assert "'DynamoDB_20120810.DeleteTable' (X-Amz-Target)" in out["reason"]


FIXTURES = POLICY + """
tests:
  - identity: agent
    request: PUT https://s3.eu-west-1.amazonaws.com/acme-artifacts/stolen.csv
    headers: {x-amz-copy-source: /private-data/payroll.csv}
    expect: deny
    code: no_rule
  - identity: agent
    request: POST https://dynamodb.eu-west-1.amazonaws.com/
    headers: {X-Amz-Target: DynamoDB_20120810.GetItem}
    expect: allow
    rule: dynamodb-read
  - {identity: agent, request: "POST https://sqs.eu-west-1.amazonaws.com/?Action=SendMessage",
     expect: allow}
  - identity: agent  # a wrong expectation: check must fail it
    request: PUT https://s3.eu-west-1.amazonaws.com/acme-artifacts/stolen.csv
    headers: {x-amz-copy-source: /private-data/payroll.csv}
    expect: allow
"""


def test_fixtures_judge_their_headers(tmp_path):
    from sandgate.policy.fixtures import run_policy_tests

    (tmp_path / "p.yaml").write_text(FIXTURES)
    results = run_policy_tests(load_policy_dir(tmp_path))
    assert [r.passed for r in results] == [True, True, True, False]
    assert "x-amz-copy-source" in results[3].message


def test_a_fixture_header_must_be_a_header(tmp_path):
    from sandgate.policy.loader import PolicyError

    (tmp_path / "p.yaml").write_text(POLICY + """
tests:
  - {identity: agent, request: "GET https://s3.eu-west-1.amazonaws.com/acme-artifacts/x",
     headers: {"x amz": "v"}, expect: allow}
""")
    with pytest.raises(PolicyError, match=r"tests\[0\]\.headers\.x amz: 'x amz' is not an HTTP"):
        load_policy_dir(tmp_path)


def test_cli_explain_takes_headers(tmp_path, capsys):
    import json

    from sandgate.cli import main

    (tmp_path / "p.yaml").write_text(POLICY)
    rc = main(["explain", "--policies", str(tmp_path), "--identity", "agent", "-H",
               "x-amz-copy-source: /private-data/payroll.csv", "PUT",
               f"{S3}/acme-artifacts/stolen.csv"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["code"] == "no_rule" and "/private-data/payroll.csv" in out["reason"]
    rc = main(["explain", "--policies", str(tmp_path), "--identity", "agent", "-H",
               "no colon here", "PUT", f"{S3}/acme-artifacts/x"])
    assert rc != 0 and "Name: value" in capsys.readouterr().err


# --- analyses that compare rules: proofs, shadowing ------------------------------------------

PROOF_HEAD = """version: v1
secrets:
  aws: {vault: secret/data/aws/agent, aws: {region: eu-west-1}}
  aws2: {vault: secret/data/aws/other, aws: {region: eu-west-1}}
identities:
"""
DDB = "dynamodb.eu-west-1.amazonaws.com"


def _narrower(tmp_path: Path, narrow: str, other: str):
    from sandgate.review.proofs import prove

    (tmp_path / "p.yaml").write_text(PROOF_HEAD + f"""  n:
    narrower_than: o
    rules:
      - {{name: n, hosts: [{DDB}], inject: {{sign: aws}}, {narrow}}}
  o:
    rules:
      - {{name: o, hosts: [{DDB}], inject: {{sign: aws}}, {other}}}
""")
    [res] = prove(load_policy_dir(tmp_path))
    return res


@pytest.mark.parametrize(("narrow", "other", "ok"), [
    ("operations: [GetItem, DeleteTable]", "operations: [GetItem]", False),
    ("operations: [GetItem]", "operations: [GetItem, Query]", True),
    ("copy_sources: [/a/**]", "operations: [GetItem]", False),  # any operation vs one
    ("copy_sources: [/a/**, /b/**]", "copy_sources: [/a/**]", False),
    ("copy_sources: [/a/x]", "copy_sources: [/a/**]", True),
])
def test_narrower_than_counts_what_a_rule_signs(tmp_path, narrow, other, ok):
    res = _narrower(tmp_path, narrow, other)
    assert res.ok is ok, str(res)
    if not ok:
        assert "signs only some of what rule 'n' of n lets through" in str(res)


def test_a_rule_listing_other_operations_is_not_shadowed(tmp_path):
    """Two signing rules on one host with different operations and secrets: the second one
    signs the operations the first does not list, so it is not shadowed (a load error)."""
    (tmp_path / "p.yaml").write_text(PROOF_HEAD + f"""  a:
    rules:
      - {{name: read, hosts: [{DDB}], operations: ["*.GetItem"], inject: {{sign: aws}}}}
      - {{name: write, hosts: [{DDB}], operations: ["*.PutItem"], inject: {{sign: aws2}}}}
tests:
  - identity: a
    request: POST https://{DDB}/
    headers: {{x-amz-target: DynamoDB_20120810.PutItem}}
    expect: allow
    rule: write
    inject: [aws2]
""")
    from sandgate.policy.fixtures import run_policy_tests

    [r] = run_policy_tests(load_policy_dir(tmp_path))
    assert r.passed, r.message



def test_lint_judges_fixtures_with_their_headers(tmp_path):
    """sandgate lint re-judges fixtures as check does, headers included: this deny fixture is
    refused for its copy source (no_rule), not by the deny rule written for the host, and
    lint says so (judged without its header it would be allowed, and lint silent)."""
    from sandgate.review.lint import lint_dir

    (tmp_path / "p.yaml").write_text(POLICY + """
      - {name: no-deletes, action: deny, hosts: [s3.eu-west-1.amazonaws.com], methods: [DELETE]}
tests:
  - identity: agent
    request: PUT https://s3.eu-west-1.amazonaws.com/acme-artifacts/stolen.csv
    headers: {x-amz-copy-source: /private-data/payroll.csv}
    expect: deny
""")
    [f] = [f for f in lint_dir(tmp_path) if "names no `rule:` or `code:`" in str(f)]
    assert "refused by no_rule, not by deny rule 'no-deletes'" in str(f)


def test_report_says_what_each_signing_rule_signs(tmp_path):
    """`sandgate report`: a signing rule's operations and copy sources, and a later rule that
    signs other operations is not "never decides a request"."""
    from sandgate.review.report import build_report, format_markdown

    (tmp_path / "p.yaml").write_text(PROOF_HEAD + f"""  a:
    rules:
      - {{name: read, hosts: [{DDB}], operations: ["*.GetItem"], inject: {{sign: aws}}}}
      - {{name: write, hosts: [{DDB}], operations: ["*.PutItem"], inject: {{sign: aws2}}}}
""")
    text = format_markdown(build_report(load_policy_dir(tmp_path), "t"))
    row = next(line for line in text.splitlines() if "| write |" in line)
    assert r"signs operations: \*.PutItem; copy sources: none" in row
    assert "never decides" not in row and "earlier rule 'read'" not in row


def test_lint_does_not_call_rules_signing_other_operations_overlapping(tmp_path):
    from sandgate.review.lint import lint_dir

    (tmp_path / "p.yaml").write_text(PROOF_HEAD + f"""  a:
    rules:
      - {{name: read, hosts: [{DDB}], methods: [POST], operations: ["*.GetItem"],
         inject: {{sign: aws}}}}
      - {{name: write, hosts: [{DDB}], methods: [POST], paths: [/], operations: ["*.PutItem"],
         inject: {{sign: aws2}}}}
""")
    assert not [f for f in lint_dir(tmp_path) if "first matching allow rule wins" in str(f)]


@pytest.mark.parametrize(("old", "new", "widened", "text"), [
    ('copy_sources: ["/b/**"]', 'copy_sources: ["/**"]', True, "copy_sources /b/** -> /**"),
    ('operations: ["*.GetItem"]', 'operations: ["*.GetItem", "*.DeleteTable"]', True,
     "operations *.GetItem -> *.GetItem, *.DeleteTable"),
    ('operations: ["*.GetItem", "*.Query"]', 'operations: ["*.GetItem"]', False,
     "operations *.GetItem, *.Query -> *.GetItem"),
])
def test_diff_shows_what_a_signing_rule_signs_changing(tmp_path, old, new, widened, text):
    """`sandgate diff`: a wider (or narrower) operations:/copy_sources: is a change of reach."""
    from sandgate.review.reach_diff import reach_diff

    rule = "      - {{name: r, hosts: [{h}], {x}, inject: {{sign: aws}}}}\n"
    dirs = []
    for name, x in (("old", old), ("new", new)):
        d = tmp_path / name
        d.mkdir()
        (d / "p.yaml").write_text(PROOF_HEAD + "  a:\n    rules:\n" + rule.format(h=DDB, x=x))
        dirs.append(load_policy_dir(d))
    changes = reach_diff(*dirs).changes
    assert [c.widened for c in changes if text in c.summary()] == [widened], [
        c.summary() for c in changes]
