"""`narrower_than`, `diff` and lint know all of `llm:` (sandgate.policy.llmproofs): model globs
compared exactly, caps refused and lowered, budgets by their limits, own-credential modes."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.policy.llmproofs import model_gap, model_witnesses
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import LlmRule, glob_matches
from sandgate.policy.overlap import llm_covers
from sandgate.review.proofs import prove_narrower
from sandgate.review.reach_diff import exit_status, reach_diff

# small alphabets make collisions (and so interesting glob relations) likely
_glob = st.text(alphabet="ab-*?", min_size=0, max_size=6)
_name = st.text(alphabet="ab-c", min_size=0, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(_glob, min_size=1, max_size=4), _name)
def test_model_witnesses_stand_for_every_name(globs, name):
    """Every model name matches exactly the globs one witness matches, and each witness
    matches exactly the globs its key says."""
    got = model_witnesses(tuple(globs))
    vec = tuple(glob_matches(g, name) for g in globs)
    assert vec in got
    for key, witness in got.items():
        assert tuple(glob_matches(g, witness) for g in globs) == key


@settings(max_examples=300, deadline=None)
@given(st.lists(_glob, min_size=1, max_size=3), st.lists(_glob, min_size=1, max_size=3),
       st.lists(_name, max_size=20))
def test_model_gap_is_exact(wider, narrow, names):
    gap = model_gap(tuple(wider), tuple(narrow))
    if gap is None:  # a proof: no name passes narrow and not wider
        for n in names:
            assert not (any(glob_matches(g, n) for g in narrow)
                        and not any(glob_matches(g, n) for g in wider))
    else:  # a counter-example, checked by the matcher the decision uses
        (model,) = gap
        assert model is not None
        assert any(glob_matches(g, model) for g in narrow)
        assert not any(glob_matches(g, model) for g in wider)


def test_llm_covers_compares_globs_exactly():
    # `c?*` matches every name `claude-*` does (the former sound-only check said it did not)
    assert llm_covers(LlmRule(models=("c?*",)), LlmRule(models=("claude-*",)))
    assert llm_covers(LlmRule(models=("*-4*", "gpt-*")), LlmRule(models=("gpt-4o*",)))
    assert not llm_covers(LlmRule(models=("c-?",)), LlmRule(models=("c-*",)))
    assert not llm_covers(LlmRule(models=("claude-*",)), LlmRule(models=None))


BASE = """
version: v1
secrets:
  anthropic: {mount: secret, path: llm/anthropic, field: key, hosts: [api.anthropic.com]}
  compat: {mount: secret, path: llm/compat, field: key}
budgets:
  day: {output_tokens: 1000, cost_usd: 2.5, per: 1d}
  small: {output_tokens: 500, cost_usd: 1, per: 2d}
  big: {output_tokens: 5000, per: 1d}
  mine: {output_tokens: 500, cost_usd: 1, per: 1d, scope: sandbox}
identities:
  agent:
    rules:
      - name: claude
        hosts: [api.anthropic.com]
        methods: [POST]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
        llm: {models: ["claude-sonnet-*", "claude-haiku-*"], max_tokens: 4096, budget: day}
  free:
    narrower_than: agent
    rules:
      - name: claude
        hosts: [api.anthropic.com]
        methods: [POST]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
        llm: NARROW
"""


def prove(tmp_path: Path, narrow_llm: str, base: str = BASE):
    (tmp_path / "p.yaml").write_text(textwrap.dedent(base).replace("NARROW", narrow_llm))
    return prove_narrower(load_policy_dir(tmp_path), "free", "agent")


def test_narrower_llm_is_proved(tmp_path):
    """A subset of the models, a cap no higher, a budget no wider: proved (on main: `not
    proved`, as the proof did not compare `llm:`). (A lowering rule is not narrower than a
    refusing one: it lets through the calls without a cap, or over it, that one refuses.)"""
    for narrow in ('{models: ["claude-haiku-4*"], max_tokens: 1000, budget: day}',
                   '{models: ["claude-sonnet-4-5"], max_tokens: 4096, budget: small}'):
        r = prove(tmp_path, narrow)
        assert r.ok, (narrow, r.details)


def counterexample(tmp_path: Path, narrow: str, base: str = BASE) -> str:
    r = prove(tmp_path, narrow, base)
    assert not r.ok and r.counterexample, (narrow, r.details)
    assert "not proved" not in " ".join(r.details)
    return f"{r.counterexample} | {' | '.join(r.details)}"


def test_a_wider_model_glob_is_a_counterexample(tmp_path):
    out = counterexample(tmp_path, '{models: ["claude-*"], max_tokens: 4096, budget: day}')
    # a model the narrow glob lets through and neither of the other's does
    m = re.search(r"LLM call of model '([^']*)'", out)
    assert m and glob_matches("claude-*", m[1])
    assert not any(glob_matches(g, m[1]) for g in ("claude-sonnet-*", "claude-haiku-*"))
    assert "model_not_allowed" in out or "is not allowed" in out


def test_a_higher_cap_is_a_counterexample(tmp_path):
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 8000, '
                                   'budget: day}')
    assert "max_tokens 4097" in out and "over the cap of 4096" in out
    # lowered to a higher cap than the other refuses above: forwarded with more
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 8000, '
                                   'on_max_tokens: lower, budget: day}')
    assert "max_tokens" in out


def test_a_lowered_cap_forwards_no_more_than_the_other_lowers_to(tmp_path):
    base = BASE.replace("max_tokens: 4096, budget: day}",
                        "max_tokens: 100, on_max_tokens: lower, budget: day}")
    assert prove(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 50, '
                           'on_max_tokens: lower, budget: day}', base).ok
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 200, '
                                   'on_max_tokens: lower, budget: day}', base)
    assert "forwards the call with max_tokens 200" in out and "at most 100" in out


def test_a_wider_or_missing_budget_is_a_counterexample(tmp_path):
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 4096}')
    assert "no budget" in out and "'day'" in out
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 4096, '
                                   'budget: big}')
    assert "output_tokens 1000 -> 5000" in out and "cost_usd 2.5 -> unlimited" in out
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 4096, '
                                   'budget: mine}')
    assert "scope identity -> sandbox" in out


def test_own_credentials_replace_is_wider_than_refuse(tmp_path):
    out = counterexample(tmp_path, '{models: ["claude-haiku-*"], max_tokens: 4096, '
                                   'budget: day, own_credentials: replace}')
    assert "own key" in out


def test_calls_a_rule_does_not_recognise_are_not_judged(tmp_path):
    """On a host that is no provider's, a rule's `llm:` judges calls only when it declares
    the API: the narrow identity's undeclared allow-list judges nothing (its calls pass with
    any model), while the other's declared one refuses them."""
    base = """
    version: v1
    secrets:
      compat: {mount: secret, path: llm/compat, field: key}
    identities:
      agent:
        rules:
          - name: compat
            hosts: [llm.internal.example]
            methods: [POST]
            inject: {headers: {authorization: "Bearer {{ secrets.compat }}"}}
            llm: {api: openai, models: ["gpt-4o-mini"]}
      free:
        narrower_than: agent
        rules:
          - name: compat
            hosts: [llm.internal.example]
            methods: [POST]
            inject: {headers: {authorization: "Bearer {{ secrets.compat }}"}}
            llm: NARROW
    """
    assert prove(tmp_path, '{api: openai, models: ["gpt-4o-mini"]}', base).ok
    out = counterexample(tmp_path, '{models: ["gpt-4o-mini"]}', base)
    # an inference path, a model the other refuses
    assert "/chat/completions" in out or "/responses" in out


def test_diff_reports_each_widening_of_llm(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()

    def diff(new: str):
        (tmp_path / "old" / "p.yaml").write_text(textwrap.dedent(BASE).replace(
            "NARROW", '{models: ["claude-haiku-*"], max_tokens: 100, budget: day}'))
        (tmp_path / "new" / "p.yaml").write_text(textwrap.dedent(new).replace(
            "NARROW", '{models: ["claude-haiku-*"], max_tokens: 100, budget: day}'))
        return reach_diff(load_policy_dir(tmp_path / "old"), load_policy_dir(tmp_path / "new"))

    # a budget's own limits raised, its name kept (on main: no change seen at all)
    d = diff(BASE.replace("day: {output_tokens: 1000,", "day: {output_tokens: 9000,"))
    assert d.widened and exit_status(d, False) == 1
    assert "output_tokens 1000 -> 9000" in str(d.as_dict())
    # the same budget's limits lowered: a narrowing, not a widening
    d = diff(BASE.replace("day: {output_tokens: 1000,", "day: {output_tokens: 10,"))
    assert not d.widened and d.narrowed
    # own credentials replaced instead of refused
    d = diff(BASE.replace("budget: day}\n  free", "budget: day, own_credentials: replace}\n"
                          "  free"))
    assert d.widened and "own_credentials refuse -> replace" in str(d.as_dict())
    # a lowered cap raised
    old_lower = BASE.replace("max_tokens: 4096, budget: day}",
                             "max_tokens: 100, on_max_tokens: lower, budget: day}")
    (tmp_path / "old" / "p.yaml").write_text(textwrap.dedent(old_lower).replace(
        "NARROW", '{models: ["claude-haiku-*"], max_tokens: 100, budget: day}'))
    (tmp_path / "new" / "p.yaml").write_text(textwrap.dedent(old_lower.replace(
        "max_tokens: 100, on_max_tokens: lower, budget: day}\n  free",
        "max_tokens: 900, on_max_tokens: lower, budget: day}\n  free")).replace(
        "NARROW", '{models: ["claude-haiku-*"], max_tokens: 100, budget: day}'))
    d = reach_diff(load_policy_dir(tmp_path / "old"), load_policy_dir(tmp_path / "new"))
    assert d.widened and "forwarded cap at most 100 -> at most 900" in str(d.as_dict())
    # an exact glob comparison: `claude-s*` within `claude-sonnet-*`'s and `claude-haiku-*`'s
    # union? no: `claude-s` itself passes the new one only
    d = diff(BASE.replace('models: ["claude-sonnet-*", "claude-haiku-*"]',
                          'models: ["claude-s*", "claude-haiku-*"]'))
    assert d.widened and "now passes" in str(d.as_dict())


def test_report_shows_what_llm_lets_through_and_holds_calls_to(tmp_path):
    """`sandgate report`'s notes say a rule's `llm:` (on main: nothing)."""
    from sandgate.review.report import build_report, format_json

    (tmp_path / "p.yaml").write_text(textwrap.dedent(BASE).replace(
        "NARROW", '{models: ["claude-haiku-*"], max_tokens: 100, on_max_tokens: lower, '
                  'own_credentials: replace}'))
    doc = format_json(build_report(load_policy_dir(tmp_path), "t"))
    assert ("LLM calls judged (API by host): models claude-sonnet-*, claude-haiku-*; "
            "max_tokens 4096 (over it refused); budget day (output_tokens 1000, cost_usd 2.5 "
            "per 86400s per identity); a sandbox's own key refused.") in doc
    assert ("models claude-haiku-*; max_tokens 100 (lowered to it); a sandbox's own key "
            "replaced.") in doc


def test_rules_naming_no_method_are_judged_on_post(tmp_path):
    """Rules without `methods:` still see LLM calls (POSTs): the proof names POST rather than
    letting a fresh method stand for it."""
    base = BASE.replace("        methods: [POST]\n", "")
    assert prove(tmp_path, '{models: ["claude-haiku-4*"], max_tokens: 1000, budget: day}',
                 base).ok
    out = counterexample(tmp_path, '{models: ["claude-*"], max_tokens: 4096, budget: day}', base)
    assert out.startswith("POST ") and "LLM call of model" in out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["v1", "messages", "chat", "completions", "responses",
                                 "m:generateContent", ":streamGenerateContent", "x",
                                 "generateContent", "models"]), min_size=0, max_size=4),
       st.booleans())
def test_the_proofs_inference_paths_are_what_recognise_reads(segments, slash):
    """The path languages the proof adds (API_PATHS) hold exactly the paths llmcall.recognise
    takes for an inference call, per API family."""
    from sandgate.llm.llmcall import recognise
    from sandgate.policy.llmproofs import API_PATHS, FAMILY_APIS

    path = "/" + "/".join(segments) + ("/" if slash and segments else "")
    for family, apis in FAMILY_APIS.items():
        got = recognise("POST", "h.example", path, family)
        for api in apis:
            assert any(p.matches(path) for p in API_PATHS[api]) == (got == api), (path, api)


def test_a_providers_host_under_a_wildcard_is_its_own_witness(tmp_path):
    """`*.anthropic.com` covers api.anthropic.com, whose calls are judged without `api:`: the
    other identity's allow-list judges them there, so an identity without one is refuted
    (the wildcard's fresh witness alone is no provider's host: nothing judged)."""
    base = """
    version: v1
    identities:
      agent:
        rules:
          - name: claude
            hosts: ["*.anthropic.com"]
            methods: [POST]
            llm: {models: ["claude-haiku-*"]}
      free:
        narrower_than: agent
        rules:
          - name: claude
            hosts: ["*.anthropic.com"]
            methods: [POST]
            llm: NARROW
    """
    assert prove(tmp_path, '{models: ["claude-haiku-4*"]}', base).ok
    out = counterexample(tmp_path, '{max_tokens: 10}', base)
    assert "api.anthropic.com" in out and "LLM call" in out


def test_calls_on_the_responses_websocket_are_compared(tmp_path):
    """On a rule with `websocket: true`, a `response.create` on the WebSocket is judged by the
    rules' `llm:` (sandgate.stages.wsllm): a wider model list there refutes the claim, on the
    upgrade (GET) the POSTs never see."""
    base = """
    version: v1
    identities:
      agent:
        rules:
          - name: codex
            hosts: [api.openai.com]
            methods: [GET]
            paths: [/v1/responses]
            websocket: true
            llm: {models: ["gpt-5*"]}
      free:
        narrower_than: agent
        rules:
          - name: codex
            hosts: [api.openai.com]
            methods: [GET]
            paths: [/v1/responses]
            websocket: true
            llm: NARROW
    """
    assert prove(tmp_path, '{models: ["gpt-5-mini*"]}', base).ok
    out = counterexample(tmp_path, '{models: ["gpt-*"]}', base)
    assert out.startswith("GET ") and "WebSocket" in out and "LLM call of model" in out


def test_diff_calls_opening_the_responses_websocket_a_widening(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    rule = """
    version: v1
    identities:
      agent:
        rules:
          - name: codex
            hosts: [api.openai.com]
            methods: [GET, POST]
            paths: [/v1/responses]
            WS
            llm: {models: ["gpt-5*"]}
    """
    (tmp_path / "old" / "p.yaml").write_text(textwrap.dedent(rule).replace("WS", "# none"))
    (tmp_path / "new" / "p.yaml").write_text(textwrap.dedent(rule).replace(
        "WS", "websocket: true"))
    d = reach_diff(load_policy_dir(tmp_path / "old"), load_policy_dir(tmp_path / "new"))
    assert d.widened and "websocket: true" in str(d.as_dict())


def test_diff_a_budget_moved_in_its_file_is_no_change(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    text = textwrap.dedent(BASE).replace("NARROW", '{models: ["claude-haiku-*"], budget: day}')
    (tmp_path / "old" / "p.yaml").write_text(text)
    (tmp_path / "new" / "p.yaml").write_text(text.replace("budgets:\n", "budgets:\n\n\n"))
    d = reach_diff(load_policy_dir(tmp_path / "old"), load_policy_dir(tmp_path / "new"))
    assert d.changes == []
