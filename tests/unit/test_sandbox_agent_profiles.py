"""`sandgate sandbox run --agent NAME`: the agent profiles, the gate and the host-pid lookup, and
the CLI's refusals (no Docker: tests/integration/docker/test_agent_sandbox.py runs the agents)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from sandgate.cli import main
from sandgate.proxyenv import ENV_NAMES
from sandgate.sandbox import agent_profiles as agents
from sandgate.sandbox.agentrun import GATE, agent_registration, child_of
from sandgate.sandbox.engine import SandboxError

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", sorted(agents.PROFILES))
def test_every_profile_has_its_template_and_tool(name: str) -> None:
    p = agents.profile(name)
    doc = yaml.safe_load((ROOT / p.template).read_text())
    ids = doc["identities"]
    assert p.identity in ids and p.tool_identity in ids
    assert ids[p.tool_identity]["narrower_than"] == p.identity
    # its variables never override the proxy and CA ones every sandbox gets, and hold no key
    assert not set(p.env) & ENV_NAMES
    for name_, value in p.env.items():
        if name_.endswith("_API_KEY"):
            assert value.startswith("sandgate-placeholder-")


def test_the_issue_variables_are_set() -> None:
    cc = agents.profile("claude-code").env
    assert cc["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and cc["IS_SANDBOX"] == "1"
    assert agents.profile("opencode").env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert agents.profile("deepagents").env["LANGSMITH_TRACING"] == "false"
    codex = tomllib.loads(agents.profile("codex").files[".codex/config.toml"])
    provider = codex["model_providers"][codex["model_provider"]]
    assert provider["base_url"] == "https://api.openai.com/v1"
    assert provider["env_key"] == "OPENAI_API_KEY"
    assert ".gemini/settings.json" in agents.profile("gemini-cli").files


def test_unknown_agent_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="claude-code, codex, gemini, opencode, deepagents"):
        agents.profile("aider")


def test_the_command_name_runs_the_agents_own_binary() -> None:
    codex = agents.profile("codex")
    mount = agents.CLI_MOUNT
    assert codex.argv(["codex", "exec", "hi"], mount) == [
        f"{mount}/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex", "exec",
        "hi"]
    assert codex.argv(["codex", "exec"], None) == ["codex", "exec"]  # an image's own install
    assert codex.argv(["/usr/bin/codex"], mount) == ["/usr/bin/codex"]  # a path: as given
    assert agents.profile("deepagents").argv(["python", "a.py"], mount) == ["python", "a.py"]


def test_the_pinned_binaries_are_where_the_profiles_say() -> None:
    modules = ROOT / "tests" / "agents" / "node_modules"
    if not modules.exists():
        pytest.skip("the pinned CLIs are not installed here (scripts/setup.sh --test)")
    for p in agents.PROFILES.values():
        if p.binary is not None:
            assert (modules / p.binary).is_file(), p.binary


def test_the_gate_holds_the_process_then_execs_in_place(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    proc = subprocess.Popen(["sh", "-c", GATE, str(gate), "sh", "-c", "echo $$"],
                            stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # held
        gate.touch()
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert int(out) == proc.pid  # the agent runs in the registered process, not a child


def test_child_of(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        kid = None
        for _ in range(100):
            kid = child_of(Path("/proc"), proc.pid)
            if kid is not None:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert kid is not None and kid != proc.pid
        assert child_of(Path("/proc"), kid) is None
    finally:
        proc.kill()
        proc.wait()


def test_child_of_refuses_two_children(tmp_path: Path) -> None:
    fake = tmp_path / "proc"
    (fake / "7" / "task" / "7").mkdir(parents=True)
    (fake / "7" / "task" / "7" / "children").write_text("8 9 ")
    with pytest.raises(SandboxError, match="several children"):
        child_of(fake, 7)


@pytest.mark.parametrize(("argv", "message"), [
    (["--agent", "aider", "--", "x"], "unknown agent"),
    (["--agent", "codex", "--pattern1", "--", "codex"], "give one of them"),
    (["--agent", "codex", "--cli-dir", "/nonexistent", "--", "codex"], "not a directory"),
    (["--identity", "x", "--cli-dir", "/tmp", "--", "true"], "go with --agent"),
    (["--", "true"], "--identity NAME (or --agent NAME) is required"),
])
def test_cli_refusals(argv: list[str], message: str,
                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sandbox", "run", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def _fake_process(proc: Path, pid: int, netns: str, start: int) -> None:
    (proc / str(pid) / "ns").mkdir(parents=True)
    (proc / str(pid) / "ns" / "net").symlink_to(netns)
    fields = ["S", *["0"] * 18, str(start)]  # field 22 (start time) is the 20th after the name
    (proc / str(pid) / "stat").write_text(f"{pid} (sh) {' '.join(fields)}\n")


def test_the_agent_is_registered_only_in_the_sandboxs_namespace(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_process(proc, 100, "net:[4026532001]", 5)  # the container's init
    _fake_process(proc, 140, "net:[4026532001]", 77)  # the gated agent shell
    _fake_process(proc, 150, "net:[4026531840]", 78)  # the host's namespace
    reg = agent_registration(proc, 140, 100, "codex", "codex-tool", "sbx-1")
    assert (reg.pid, reg.start, reg.identity, reg.tool_identity, reg.sandbox) == (
        140, 77, "codex", "codex-tool", "sbx-1")
    # another namespace, or a pid this /proc does not show (another PID namespace): refused
    for pid in (150, 999):
        with pytest.raises(SandboxError, match="Docker host's PID namespace"):
            agent_registration(proc, pid, 100, "codex", "codex-tool", "sbx-1")
