"""Real agent CLIs (Claude Code, Codex, OpenCode, Gemini CLI) under the split without a hook
(docs/pattern1.md): `sandgate agent run` starts the CLI as the registered agent process,
Sandgate (`--agent-dir`) serves it with the policy template of policies/agents, and a stand-in
model API on the real host name scripts one shell tool call, a `curl` to the model API itself,
then a final answer.

Checked for each CLI: the model calls carry the key from OpenBao (the CLI holds a placeholder),
the curl its shell runs is refused as the tool identity (with the agent's token it inherited:
407; with no token: 403 for the tool identity), the stand-in never sees a call from the tool,
and the audit names the identity of each call.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    OPENAI_KEY,
    SANDGATE,
    SECRET_VALUES,
    Proxy,
)
from tests.integration.test_agent_claude_code import claude_binary
from tests.support.anthropic_api import StandInToolTurn
from tests.support.gemini_api import StandInGemini
from tests.support.openai_responses import StandInResponses
from tests.support.pki import make_pki
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.upstream import AppThread

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
TEMPLATES = ROOT / "policies" / "agents"
# this file's loopback addresses, pinned by --resolve: the stand-ins on the real host names
API_IP = "127.0.37.2"  # api.anthropic.com
OPENAI_IP = "127.0.37.3"  # api.openai.com
GEMINI_IP = "127.0.37.4"  # generativelanguage.googleapis.com
GEMINI_KEY = "fake-gemini-REAL-key-5c1d9e7b3a"  # put into OpenBao by this file
API = "https://api.anthropic.com/v1/messages"
OPENAI_API = "https://api.openai.com/v1/responses"
GEMINI_API = ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:"
              "generateContent")
AGENTS = ROOT / "tests" / "agents"
# Codex's native binary, exec'd directly: its npm wrapper (bin/codex.js) execs it in place only
# on Node >= 22.15 (process.execve), and otherwise starts it as a child, which would be the tool
CODEX = (AGENTS / "node_modules" / "@openai" / "codex-linux-x64" / "vendor" /
         "x86_64-unknown-linux-musl" / "bin" / "codex")


def template(name: str, secret: str, ip: str) -> str:
    """An agent's policy template as shipped, its model API rules allowed to dial the
    stand-in's loopback address (the one change: the real API is public)."""
    text = (TEMPLATES / f"{name}.yaml").read_text()
    marker = f"{{{{ secrets.{secret} }}}}\"}}}}\n"
    assert marker in text
    return text.replace(marker, f"{marker}        private_cidrs: [{ip}/32]\n")


@dataclass
class Stack:
    proxy: Proxy
    api: StandInToolTurn
    openai: StandInResponses
    gemini: StandInGemini
    agents: Path


def tool_command(proxy: Proxy, api: str = API, ca: str = "NODE_EXTRA_CA_CERTS") -> str:
    """What the model asks the shell tool to run: the model API, once as the agent's
    environment has it (the agent's token in HTTPS_PROXY), once with a proxy and no token."""
    # no command substitution: Gemini CLI refuses to run a command with one
    curl = f'curl -sS -o /dev/null --max-time 20 --cacert "${ca}" -d {{}} {api}'
    return (f'{curl} -w "inherited:%{{http_code}}/%{{http_connect}} "; '
            f'{curl} -w "bare:%{{http_code}}/%{{http_connect}}" '
            f'--proxy http://{proxy.host}:{proxy.port}')


@pytest.fixture(scope="module")
def stack(tmp_path_factory, proxy_stack) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("agent-split-clis")
    pki = make_pki(tmp / "pki", ["api.anthropic.com", "api.openai.com",
                                 "generativelanguage.googleapis.com"])
    gemini = StandInGemini(command="true")
    gemini_server = AppThread(gemini.app(), pki.cert, pki.key, GEMINI_IP).start()
    # Claude Code's, OpenCode's and deepagents' shell tools
    api = StandInToolTurn(tool=("Bash", "bash", "execute"), command="true")
    openai = StandInResponses(command="true")
    server = AppThread(api.app(), pki.cert, pki.key, API_IP).start()
    openai_server = AppThread(openai.app(), pki.cert, pki.key, OPENAI_IP).start()
    agents = tmp / "agents"
    agents.mkdir()
    os.chmod(agents, 0o755)
    running = proxy_stack(
        "agent-split-clis-proxy", pki, seed={"llm/gemini": {"api_key": GEMINI_KEY}},
        policy={"secrets.yaml": (TEMPLATES / "secrets.yaml").read_text(),
                "claude-code.yaml": template("claude-code", "anthropic", API_IP),
                "codex.yaml": template("codex", "openai", OPENAI_IP),
                "opencode.yaml": template("opencode", "anthropic", API_IP),
                "gemini.yaml": template("gemini", "gemini", GEMINI_IP),
                "deepagents.yaml": template("deepagents", "anthropic", API_IP)},
        resolve={"api.anthropic.com": API_IP, "api.openai.com": OPENAI_IP,
                 "generativelanguage.googleapis.com": GEMINI_IP},
        args=[f"--agent-dir={agents}", "--agent-split=claude-code=claude-code-tool",
              "--agent-split=codex=codex-tool", "--agent-split=opencode=opencode-tool",
              "--agent-split=gemini=gemini-tool", "--agent-split=deepagents=deepagents-tool"],
        secrets=[GEMINI_KEY], what="the proxy's log and audit")
    proxy = running.proxy
    api.command = tool_command(proxy)
    openai.command = tool_command(proxy, OPENAI_API, "SSL_CERT_FILE")
    gemini.command = tool_command(proxy, GEMINI_API)
    try:
        yield Stack(proxy, api, openai, gemini, agents)
    finally:
        try:
            running.stop()  # and no secret in its log or audit
        finally:
            server.stop()
            openai_server.stop()
            gemini_server.stop()


def agent_run(identity: str, tool: str, agents: Path, sandbox: str) -> list[str]:
    # this machine may lack Yama and runs everything as root: the test says so explicitly
    return [*SANDGATE, "agent", "run", "--identity", identity, "--tool-identity", tool,
            "--agent-dir", str(agents), "--sandbox", sandbox, "--allow-ptrace",
            "--allow-same-user", "--"]


def events(proxy: Proxy, sandbox: str, pred, timeout: float = 15) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in proxy.audit() if e.get("sandbox") == sandbox and pred(e)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def assert_split(stack: Stack, r: subprocess.CompletedProcess[str], stand_in: Any,
                 before: int, *, agent: str, sandbox: str, rule: str, header: str,
                 key: str, tool_path: str | None, secrets: Sequence[str] = SECRET_VALUES,
                 only_posts: bool = False, name: str) -> None:
    """What every agent's split run must show: no secret in its output; its shell tool ran and
    both of its curls were refused (the agent's token from a process the agent started: 407 at
    CONNECT; no token, the tool identity: 403 no_rule); every model call the stand-in saw
    carried the key Sandgate injected; the audit names the agent for its calls and the tool for
    the tool's."""
    assert_no_secret([r.stdout, r.stderr], secrets, f"{name}'s output")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    assert stand_in.results, f"the tool's result never came back: {r.stdout[-1500:]}"
    result = stand_in.results[-1]
    assert "inherited:000/407" in result and "bare:403/200" in result, result
    calls = [c for c in stand_in.calls[before:] if c.method == "POST" or not only_posts]
    assert len(calls) >= 2  # the tool call's turn and the final answer's
    for call in calls:
        assert_secret_equal(call.headers.get(header), key, "the injected key")
    allowed = events(stack.proxy, sandbox, lambda e: e.get("event") == "request"
                     and e.get("decision") == "allow")
    assert {(e["identity"], e["identity_source"], e["rule"]) for e in allowed} == {
        (agent, "process/agent", rule)}
    denied = events(stack.proxy, sandbox, lambda e: e.get("code") == "no_rule"
                    and e.get("event") == "request")
    tool = {(e["identity"], e["identity_source"], e["path"]) for e in denied}
    if tool_path is None:
        assert (f"{agent}-tool", "process/tool") in {t[:2] for t in tool}, denied
    else:
        assert (f"{agent}-tool", "process/tool", tool_path) in tool, denied


def test_claude_code_shell_tool_is_the_tool_identity(stack: Stack, tmp_path: Path) -> None:
    claude = claude_binary()
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": stack.proxy.proxy_url("claude-code"),
        "NODE_EXTRA_CA_CERTS": str(stack.proxy.ca),
        "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # as root, --dangerously-skip-permissions needs it
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # for `sandgate agent run` itself
    }
    before = len(stack.api.calls)
    with tempfile.TemporaryDirectory(prefix="sgcs-") as scratch:
        env["TMPDIR"] = scratch
        r = subprocess.run(
            [*agent_run("claude-code", "claude-code-tool", stack.agents, "cc-split"),
             str(claude), "-p", "Call the model API from the shell.",
             "--dangerously-skip-permissions", "--output-format", "text"],
            capture_output=True, text=True, env=env, cwd=home / "work", timeout=240,
            stdin=subprocess.DEVNULL)
    assert_split(stack, r, stack.api, before, agent="claude-code", sandbox="cc-split",
                 rule="messages", header="x-api-key", key=ANTHROPIC_KEY,
                 tool_path="/v1/messages", name="Claude Code")
    assert "The tool said:" in r.stdout
    denied = events(stack.proxy, "cc-split", lambda e: e.get("code") == "no_rule"
                    and e.get("event") == "request")
    # the agent's own refusals are the hosts and paths its template refuses, nothing else
    assert {e["path"] for e in denied if e["identity"] == "claude-code"} <= {
        "/api/claude_code/settings", "/api/claude_code/policy_limits"}, denied
    refused = [e for e in stack.proxy.audit()
               if "disagrees with the process" in (e.get("reason") or "")]
    assert refused, "the inherited token's refusal is not in the audit"


CODEX_CONFIG = """# Codex through Sandgate: the real API host, a placeholder key (injected)
model = "gpt-5-codex"
model_provider = "openai-sandgate"

[model_providers.openai-sandgate]
name = "OpenAI through Sandgate"
base_url = "https://api.openai.com/v1"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
# the stand-in speaks SSE only; the template allows the WebSocket transport too
supports_websockets = false
"""


def codex_binary() -> Path:
    """The pinned Codex's native binary. Missing is a failure, never a skip: CI installs it
    with `scripts/setup.sh --test`."""
    if not CODEX.exists():
        pytest.fail(f"Codex ({CODEX.relative_to(ROOT)}) is not installed: run "
                    "scripts/setup.sh --test (npm ci in tests/agents)")
    pinned = json.loads((AGENTS / "package.json").read_text())["dependencies"]["@openai/codex"]
    r = subprocess.run([str(CODEX), "--version"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == f"codex-cli {pinned}", r.stdout + r.stderr
    return CODEX


def codex_home(stack: Stack, tmp_path: Path, config: str) -> tuple[Path, dict[str, str]]:
    """A fresh HOME for Codex (its CODEX_HOME holding `config`), and the environment it runs
    in as a user would set it: the proxy with the agent's token, the CA, the placeholder key."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(config)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": stack.proxy.proxy_url("codex"),
        "SSL_CERT_FILE": str(stack.proxy.ca),
        "OPENAI_API_KEY": "sandgate-placeholder-openai",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # for `sandgate agent run` itself
    }
    return home, env


def test_codex_shell_tool_is_the_tool_identity(stack: Stack, tmp_path: Path) -> None:
    """Codex has no hook for its shell: the split holds all the same."""
    codex = codex_binary()
    home, env = codex_home(stack, tmp_path, CODEX_CONFIG)
    before = len(stack.openai.calls)
    r = subprocess.run(
        [*agent_run("codex", "codex-tool", stack.agents, "codex-split"), str(codex), "exec",
         "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         "Call the model API from the shell."],
        capture_output=True, text=True, env=env, cwd=home / "work", timeout=240,
        stdin=subprocess.DEVNULL)
    assert_split(stack, r, stack.openai, before, agent="codex", sandbox="codex-split",
                 rule="responses", header="authorization", key=f"Bearer {OPENAI_KEY}",
                 tool_path="/v1/responses", only_posts=True, name="Codex")
    assert "The tool said:" in r.stdout + r.stderr


CODEX_WS_CONFIG = CODEX_CONFIG.replace(
    "# the stand-in speaks SSE only; the template allows the WebSocket transport too\n"
    "supports_websockets = false\n",
    "# the Responses API over a WebSocket (GET /v1/responses with an upgrade), as the built-in\n"
    "# provider does; refused, Codex would fall back to SSE\n"
    "supports_websockets = true\n")


def test_codex_websocket_transport(stack: Stack, tmp_path: Path) -> None:
    """Codex's WebSocket transport of the Responses API end to end: the upgrade is allowed by
    the template's rule, the key injected on it, each `response.create` judged, and the answer's
    deltas, which carry the key cut in two, scrubbed as the client joins them."""
    codex = codex_binary()
    assert CODEX_WS_CONFIG != CODEX_CONFIG
    home, env = codex_home(stack, tmp_path, CODEX_WS_CONFIG)
    before, upgrades = len(stack.openai.calls), len(stack.openai.upgrades)
    stack.openai.leak = True
    try:
        r = subprocess.run(
            [*agent_run("codex", "codex-tool", stack.agents, "codex-ws"), str(codex), "exec",
             "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
             "Call the model API from the shell."],
            capture_output=True, text=True, env=env, cwd=home / "work", timeout=240,
            stdin=subprocess.DEVNULL)
    finally:
        stack.openai.leak = False
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "Codex's output")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    # every model call went over the WebSocket: none fell back to SSE
    calls = stack.openai.calls[before:]
    assert [c.method for c in calls if c.method != "GET"] and all(
        c.method == "WEBSOCKET" for c in calls), [(c.method, c.path) for c in calls]
    creates = [c for c in calls if c.body.get("type") == "response.create"]
    assert len(creates) >= 2  # the tool call's turn and the final answer's
    # the key from OpenBao on the upgrade, the only request of the WebSocket that has headers
    assert stack.openai.upgrades[upgrades:]
    for up in stack.openai.upgrades[upgrades:]:
        assert_secret_equal(up.headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                            "the injected key")
    # the tool's curls refused as ever, and the answer, its key scrubbed, printed
    result = stack.openai.results[-1]
    assert "inherited:000/407" in result and "bare:403/200" in result, result
    assert "The tool said:" in r.stdout + r.stderr
    assert "[REDACTED:openai]" in r.stdout + r.stderr
    # the audit: the upgrade allowed as a WebSocket, each response.create judged on it
    opened = events(stack.proxy, "codex-ws", lambda e: e.get("event") == "request"
                    and e.get("decision") == "allow")
    assert {(e["identity"], e["identity_source"], e["rule"], e["method"], e.get("websocket"))
            for e in opened} == {
        ("codex", "process/agent", "responses-websocket", "GET", True)}, opened
    judged = events(stack.proxy, "codex-ws", lambda e: e.get("event") == "websocket"
                    and e.get("llm") is not None)
    assert len(judged) >= 2 and {(e["decision"], e["rule"]) for e in judged} == {
        ("allow", "responses-websocket")}, judged
    denied = events(stack.proxy, "codex-ws", lambda e: e.get("code") == "no_rule"
                    and e.get("event") == "request")
    assert ("codex-tool", "process/tool", "/v1/responses") in {
        (e["identity"], e["identity_source"], e["path"]) for e in denied}, denied


OPENCODE = AGENTS / "node_modules" / "opencode-ai" / "bin" / "opencode.exe"  # its native binary


def test_opencode_shell_tool_is_the_tool_identity(stack: Stack, tmp_path: Path) -> None:
    """OpenCode's bash tool; `--pure` (no external plugins), `--auto` (no permission prompts).
    At start it still asks the npm registry for its plugin package: refused (its template)."""
    if not OPENCODE.exists():
        pytest.fail(f"OpenCode ({OPENCODE.relative_to(ROOT)}) is not installed: run "
                    "scripts/setup.sh --test (npm ci in tests/agents)")
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": stack.proxy.proxy_url("opencode"),
        "NODE_EXTRA_CA_CERTS": str(stack.proxy.ca),
        "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # for `sandgate agent run` itself
    }
    before = len(stack.api.calls)
    r = subprocess.run(
        [*agent_run("opencode", "opencode-tool", stack.agents, "opencode-split"),
         str(OPENCODE), "run", "--pure", "--auto", "-m", "anthropic/claude-sonnet-4-5",
         "Call the model API from the shell."],
        capture_output=True, text=True, env=env, cwd=home / "work", timeout=240,
        stdin=subprocess.DEVNULL)
    assert_split(stack, r, stack.api, before, agent="opencode", sandbox="opencode-split",
                 rule="messages", header="x-api-key", key=ANTHROPIC_KEY,
                 tool_path="/v1/messages", name="OpenCode")


GEMINI = AGENTS / "node_modules" / ".bin" / "gemini"  # a Node script: node is the agent


def test_gemini_shell_tool_is_the_tool_identity(stack: Stack, tmp_path: Path) -> None:
    """Gemini CLI's run_shell_command, in YOLO mode (no approval prompts)."""
    if not GEMINI.exists():
        pytest.fail(f"Gemini CLI ({GEMINI.relative_to(ROOT)}) is not installed: run "
                    "scripts/setup.sh --test (npm ci in tests/agents)")
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / ".gemini").mkdir()
    (home / ".gemini" / "settings.json").write_text(json.dumps({
        "privacy": {"usageStatisticsEnabled": False},
        "security": {"auth": {"selectedType": "gemini-api-key"}}}))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": stack.proxy.proxy_url("gemini"),
        "NODE_EXTRA_CA_CERTS": str(stack.proxy.ca),
        "GEMINI_API_KEY": "sandgate-placeholder-gemini",
        # it would start itself again as a child (more heap): the child would not be the agent
        "GEMINI_CLI_NO_RELAUNCH": "true",
        "GEMINI_CLI_TRUST_WORKSPACE": "true",  # headless: the work directory is trusted
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # for `sandgate agent run` itself
    }
    before = len(stack.gemini.calls)
    r = subprocess.run(
        [*agent_run("gemini", "gemini-tool", stack.agents, "gemini-split"), str(GEMINI),
         "-m", "gemini-2.5-pro", "--yolo", "-p", "Call the model API from the shell."],
        capture_output=True, text=True, env=env, cwd=home / "work", timeout=240,
        stdin=subprocess.DEVNULL)
    assert_split(stack, r, stack.gemini, before, agent="gemini", sandbox="gemini-split",
                 rule="generate", header="x-goog-api-key", key=GEMINI_KEY, tool_path=None,
                 secrets=[*SECRET_VALUES, GEMINI_KEY], only_posts=True, name="Gemini CLI")


# deepagents (PyPI, pinned in requirements) with langchain-anthropic: a Python program, so the
# agent is the interpreter's process; its shell backend runs `execute` in a subprocess (the tool)
DEEPAGENT = """
import os
from deepagents import create_deep_agent
from deepagents.backends import LocalShellBackend
from langchain_anthropic import ChatAnthropic

# inherit_env=True: the shell gets the proxy variables (without it, no proxy: nothing reachable)
backend = LocalShellBackend(root_dir=os.getcwd(), virtual_mode=False, inherit_env=True)
model = ChatAnthropic(model="claude-sonnet-4-5", max_tokens=1024, streaming=True)
agent = create_deep_agent(model=model, backend=backend)
out = agent.invoke({"messages": [{"role": "user",
                                  "content": "Call the model API from the shell."}]})
print(out["messages"][-1].content)
"""


def deepagents_python() -> Path:
    """The test run's own interpreter: deepagents and langchain-anthropic are in the dev
    environment (the `clients` extra, requirements/dev.lock). Missing is a failure, never a
    skip."""
    need_sdk("deepagents", "langchain_anthropic")
    return CLIENT_PY


def test_deepagents_shell_tool_is_the_tool_identity(stack: Stack, tmp_path: Path) -> None:
    python = deepagents_python()
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    script = home / "agent.py"
    script.write_text(DEEPAGENT)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": stack.proxy.proxy_url("deepagents"),
        "SSL_CERT_FILE": str(stack.proxy.ca),  # httpx (the anthropic SDK) and the tool's curl
        "ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
        "LANGSMITH_TRACING": "false",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # for `sandgate agent run` itself
    }
    before = len(stack.api.calls)
    command = stack.api.command
    stack.api.command = tool_command(stack.proxy, API, "SSL_CERT_FILE")
    try:
        r = subprocess.run(
            [*agent_run("deepagents", "deepagents-tool", stack.agents, "deepagents-split"),
             str(python), str(script)],
            capture_output=True, text=True, env=env,
            cwd=home / "work", timeout=240, stdin=subprocess.DEVNULL)
    finally:
        stack.api.command = command
    assert_split(stack, r, stack.api, before, agent="deepagents", sandbox="deepagents-split",
                 rule="messages", header="x-api-key", key=ANTHROPIC_KEY,
                 tool_path="/v1/messages", name="deepagents")
    assert "The tool said:" in r.stdout
