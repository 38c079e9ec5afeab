"""The agent policy templates (policies/agents, docs/agents.md): each agent's tool identity is
proven narrower than the agent, each key goes only to its model API, the fixtures pass and lint
is clean, and the tool is refused the model API that its agent reaches with the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.cli import main as cli_main
from sandgate.decision import decide_request
from sandgate.policy.loader import load_policy_dir
from sandgate.request import parse_url
from sandgate.review.proofs import prove, prove_narrower

TEMPLATES = Path(__file__).parents[2] / "policies" / "agents"
AGENTS = {  # agent -> a model call it makes (the key injected)
    "claude-code": "https://api.anthropic.com/v1/messages",
    "codex": "https://api.openai.com/v1/responses",
    "gemini": "https://generativelanguage.googleapis.com/v1beta/models/m:generateContent",
    "opencode": "https://api.anthropic.com/v1/messages",
    "deepagents": "https://api.anthropic.com/v1/messages",
}


def test_every_agent_has_a_template_and_a_narrower_tool() -> None:
    assert {p.stem for p in TEMPLATES.glob("*.yaml")} == {*AGENTS, "secrets"}
    pol = load_policy_dir(TEMPLATES)
    assert set(pol.identities) == {*AGENTS, *(f"{a}-tool" for a in AGENTS)}
    proofs = [str(r) for r in prove(pol)]
    for agent in AGENTS:
        assert pol.identities[f"{agent}-tool"].narrower_than == agent
        assert f"proof ok: {agent}-tool narrower than {agent}" in proofs
        assert not prove_narrower(pol, agent, f"{agent}-tool").ok  # and not the other way
    assert all(p.startswith("proof ok") for p in proofs), proofs


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_the_agent_gets_the_key_and_its_tool_is_refused(agent: str) -> None:
    pol = load_policy_dir(TEMPLATES)
    info = parse_url("POST", AGENTS[agent])
    d = decide_request(pol, agent, info)
    assert d.allowed and d.rule is not None and d.rule.inject is not None
    tool = decide_request(pol, f"{agent}-tool", info)
    assert not tool.allowed and tool.code == "no_rule"


def test_check_and_strict_lint_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", str(TEMPLATES)]) == 0
    assert "0 failed" in capsys.readouterr().out
    assert cli_main(["lint", "--strict", str(TEMPLATES)]) == 0
    # ...and the policy directory they sit in stays lint-clean: they are a policy of their own
    assert cli_main(["lint", "--strict", str(TEMPLATES.parent)]) == 0
