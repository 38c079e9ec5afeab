"""A narrower_than counter-example shows only the query values of the rules involved (issue 38:
it carried the values of rules on other hosts, since a proof's query cells name a value for
every parameter any rule of the two identities constrains)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.policy.loader import load_policy_dir
from sandgate.review.proofs import prove

pytestmark = pytest.mark.unit

POLICY = """\
version: v1
identities:
  agent:
    rules:
      - {name: pages, hosts: [a.example.com], methods: [GET],
         query: {page: {values: ["1"], optional: true}}}
      - {name: b, hosts: [b.example.com], methods: [GET], paths: [/docs/**]}
      - {name: d, hosts: [d.example.com], methods: [GET], query: {debug: absent}}
  tool:
    narrower_than: agent
    rules:
      - {name: c, hosts: [c.example.com], methods: [GET], query: {mode: [fast]}}
      - {name: b, hosts: [b.example.com], methods: [GET]}
  tool2:
    narrower_than: agent
    rules:
      - {name: d, hosts: [d.example.com], methods: [GET]}
"""


def _counterexamples(tmp_path: Path) -> dict[str, str | None]:
    (tmp_path / "p.yaml").write_text(POLICY)
    return {pr.claim.split()[0]: pr.counterexample
            for pr in prove(load_policy_dir(tmp_path)) if pr.kind == "narrower_than"}


def test_a_counterexample_carries_no_value_of_unrelated_rules(tmp_path):
    assert _counterexamples(tmp_path)["tool"] == "GET https://b.example.com:443/"


def test_a_value_the_rules_involved_need_is_kept(tmp_path):
    # agent's rule d refuses ?debug=...: the witness needs it, and only it
    got = _counterexamples(tmp_path)["tool2"]
    assert got is not None and got.startswith("GET https://d.example.com:443/?debug=")
    assert "page=" not in got and "mode=" not in got


def test_report_shows_every_query_constraint(tmp_path):
    """issue 38: `report` dropped the optional (and absent) query constraints."""
    import json

    from sandgate.review.report import build_report, format_json

    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  agent:\n    rules:\n"
        "      - {name: refs, hosts: [git.example.com], methods: [GET],\n"
        "         query: {service: [git-upload-pack], page: {values: ['1', '2'], "
        "optional: true}, debug: absent}}\n")
    doc = json.loads(format_json(build_report(load_policy_dir(tmp_path), "t")))
    text = json.dumps(doc)
    assert "service=git-upload-pack; page=1|2 (optional); debug absent" in text, text


_HOSTS = ["a.example.com", "b.example.com"]
_rule = st.fixed_dictionaries({
    "hosts": st.sampled_from(_HOSTS).map(lambda h: [h]),
    "methods": st.sampled_from([["GET"], ["GET", "POST"]]),
    "query": st.dictionaries(st.sampled_from(["p", "q", "r"]), st.one_of(
        st.sampled_from([["1"], ["1", "2"]]),
        st.sampled_from(["1", "2"]).map(lambda v: {"values": [v], "optional": True}),
        st.just("absent")), max_size=2),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(_rule, min_size=1, max_size=3), st.lists(_rule, min_size=1, max_size=3))
def test_counterexamples_show_only_involved_values_and_still_refute(agent, tool):
    """Whatever the rules, a shown counter-example is one decide() agrees with (prove() raises
    ProofError otherwise) and names only parameters that a rule on its host constrains."""
    import json
    import tempfile
    from urllib.parse import parse_qsl, urlsplit

    def rules(rs: list[dict]) -> list[dict]:
        return [{"name": f"r{i}", **{k: v for k, v in r.items() if k != "query" or v}}
                for i, r in enumerate(rs)]

    doc = {"version": "v1", "identities": {
        "agent": {"rules": rules(agent)},
        "tool": {"narrower_than": "agent", "rules": rules(tool)}}}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "p.yaml").write_text(json.dumps(doc))  # JSON is YAML
        results = prove(load_policy_dir(d))
    for pr in results:
        if pr.counterexample is None or pr.counterexample.startswith("CONNECT"):
            continue
        url = urlsplit(pr.counterexample.split(" ", 1)[1])
        near = {n for r in agent + tool if url.hostname in r["hosts"] for n in r["query"]}
        assert {n for n, _ in parse_qsl(url.query)} <= near, (pr.counterexample, doc)
