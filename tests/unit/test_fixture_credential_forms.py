"""A fixture's `inject:` entry: a secret name, or the credential form explain prints."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.explain.answer import explain
from sandgate.policy.fixtures import run_policy_tests
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.review.report import build_report, format_json
from sandgate.secrets.credential_form import parse_form

pytestmark = pytest.mark.unit

POLICY = """version: v1
secrets:
  gh:
    vault: secret/data/github/app
    github_app: {app_id: 1, installation_id: 2}
  aws-s3: {vault: secret/data/aws/fake, aws: {service: s3}}
  plain: {vault: secret/data/plain, field: token}
identities:
  a:
    rules:
      - name: gh-mint
        hosts: [api.github.com]
        methods: [POST]
        paths: ["/app/installations/*/access_tokens"]
      - name: gh-read
        hosts: [api.github.com]
        methods: [GET]
        inject: {headers: {authorization: "token {{ secrets.gh }}"}}
        github_app: {repositories: [acme/api], permissions: {contents: read}}
      - name: s3
        hosts: [s3.eu-west-1.amazonaws.com, s3.us-east-1.amazonaws.com]
        inject: {sign: aws-s3}
      - name: kv
        hosts: [kv.example]
        inject: {headers: {x-key: "{{ secrets.plain }}"}}
tests:
"""
GH = "GET https://api.github.com/repos/acme/api"
S3 = "GET https://s3.eu-west-1.amazonaws.com/b/k"


def _run(tmp_path: Path, request: str, inject: str) -> tuple[bool, str]:
    (tmp_path / "p.yaml").write_text(
        POLICY + f"  - {{identity: a, request: {request}, expect: allow, inject: {inject}}}\n")
    [r] = run_policy_tests(load_policy_dir(tmp_path))
    return r.passed, r.message


@pytest.mark.parametrize(("request_", "inject", "passed"), [
    (GH, "[gh]", True),                                          # by name
    (GH, '["gh-app(repo=api, contents=read)"]', True),           # by form
    (GH, '["gh-app( contents = read ,repo=api )"]', True),       # any order, any spaces
    (GH, '["gh-app(repo=api, contents=write)"]', False),         # a wider token
    (GH, '["gh-app(repo=api)"]', False),
    (GH, '["gh-app()"]', False),
    (GH, '["aws(service=s3, region=eu-west-1)"]', False),
    (S3, '["aws(service=s3, region=eu-west-1)"]', True),         # region from the host
    (S3, '["aws(region=eu-west-1, service=s3)"]', True),
    (S3, "[aws-s3]", True),
    (S3, '["aws(service=s3, region=us-east-1)"]', False),
    (S3, "[gh]", False),
    ("GET https://kv.example/", "[plain]", True),
    ("GET https://kv.example/", '["gh-app(repo=api, contents=read)"]', False),  # kv: no form
])
def test_inject_by_name_or_form(tmp_path: Path, request_: str, inject: str,
                                passed: bool) -> None:
    assert _run(tmp_path, request_, inject)[0] is passed


def test_mismatch_shows_expected_and_actual_form(tmp_path: Path) -> None:
    ok, message = _run(tmp_path, GH, '["gh-app(contents=write, repo=api)"]')
    assert not ok
    assert message.startswith("expected inject [gh-app(repo=api, contents=write)], got "
                              "[gh: gh-app(repo=api, contents=read)]"), message


def test_a_name_mismatch_keeps_its_message(tmp_path: Path) -> None:
    ok, message = _run(tmp_path, GH, "[plain]")
    assert not ok and message.startswith("expected inject [plain], got [gh]"), message


@pytest.mark.parametrize(("entry", "why"), [
    ("gh-app(repo api)", "is not key=value"),
    ("gh-app(repo=api", "neither a secret name nor a credential form"),
    ("vault(path=x)", "unknown credential kind 'vault'"),
    ("aws(service=s3)", "needs exactly one region="),
    ("aws(service=s3, region=a, zone=b)", "not 'zone'"),
    ("gh-app(repo=, contents=read)", "is not key=value"),
])
def test_malformed_entry_is_a_located_load_error(tmp_path: Path, entry: str, why: str) -> None:
    (tmp_path / "p.yaml").write_text(
        POLICY + f'  - {{identity: a, request: {GH}, expect: allow, inject: ["{entry}"]}}\n')
    with pytest.raises(PolicyError) as e:
        load_policy_dir(tmp_path)
    text = str(e.value)
    assert why in text and "tests[0].inject[0]" in text.replace(" ", ""), text


def test_explain_and_report_print_the_form_fixtures_compare(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    pol = load_policy_dir(tmp_path)
    out, _ = explain(pol, "a", "GET", "https://api.github.com/repos/acme/api")
    assert out["credentials"]["gh"].startswith("gh-app(repo=api, contents=read): ")
    out, _ = explain(pol, "a", "GET", "https://s3.eu-west-1.amazonaws.com/b/k")
    assert any(i.startswith("sign: aws(service=s3, region=eu-west-1) ") for i in out["inject"])
    assert out["credential_forms"] == {"aws-s3": "aws(service=s3, region=eu-west-1)"}
    out, _ = explain(pol, "a", "GET", "https://kv.example/")
    assert out["credential_forms"] == {}  # a kv secret is named, it has no form
    assert "gh-app(repo=api, contents=read), installation 2" in format_json(build_report(pol, "t"))


_KEY = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
_VAL = st.from_regex(r"[a-z0-9/._-]{1,8}", fullmatch=True)


@given(st.lists(st.tuples(_KEY, _VAL), max_size=5), st.randoms(), st.sampled_from(["", " ", "  "]))
def test_parse_form_ignores_order_and_spaces(pairs: list[tuple[str, str]], rnd: object,
                                             sp: str) -> None:
    canon = parse_form("gh-app(" + ", ".join(f"{k}={v}" for k, v in pairs) + ")")
    shuffled = list(pairs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    text = f"gh-app{sp}({sp}" + f"{sp},{sp}".join(f"{k}{sp}={sp}{v}" for k, v in shuffled) + ")"
    assert parse_form(text) == canon
    assert parse_form(canon) == canon  # the canonical form is a fixed point
