"""`sandgate sandbox run --agent NAME`: a real agent CLI in a real Docker sandbox, one command.

The pinned CLIs (tests/agents/node_modules, `--cli-dir`, mounted read-only) run in the
sandgate-bash-tool image on the internal sandbox network; Sandgate runs on this host at the
network's gateway with the agent's policy template (policies/agents), OpenBao, and
`--agent-dir`/`--agent-split`; a stand-in of the model API on its real host name scripts one
shell tool call and a final answer. No network at test time: the CLIs come from the lock.

Checked for Claude Code, Codex, OpenCode and Gemini CLI: the model calls carry the key from
OpenBao and the sandbox holds only the placeholder; the CLI's shell tool is the tool identity
(its inherited token: 407; no token: 403 for NAME-tool; no proxy: nothing reachable; a raw
connection with the agent's token: 407; a raw socket: EPERM); the stand-in never sees the
tool; the audit names process/agent and process/tool.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from sandgate.sandbox.network import SandboxNetwork, ensure_network_info
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    OPENAI_KEY,
    SANDGATE,
    SECRET_VALUES,
    Proxy,
    start_proxy,
    stop_proxy,
)
from tests.integration.docker.conftest import docker_with_images
from tests.integration.test_agent_split_clis import (
    AGENTS,
    API,
    GEMINI_API,
    GEMINI_KEY,
    OPENAI_API,
    TEMPLATES,
    claude_binary,
    codex_binary,
    template,
)
from tests.support.anthropic_api import StandInToolTurn
from tests.support.gemini_api import StandInGemini
from tests.support.openai_responses import StandInResponses
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret, assert_secret_equal
from tests.support.upstream import AppThread

# this file's loopback addresses (the host's namespace: Docker needs it): the stand-ins
API_IP = "127.0.137.2"  # api.anthropic.com
OPENAI_IP = "127.0.137.3"  # api.openai.com
GEMINI_IP = "127.0.137.4"  # generativelanguage.googleapis.com
CLI_DIR = AGENTS / "node_modules"


@dataclass
class Stack:
    proxy: Proxy
    api: StandInToolTurn
    openai: StandInResponses
    gemini: StandInGemini
    agents: Path
    network: SandboxNetwork


def sandbox_tool_command(proxy: Proxy, api: str) -> str:
    """What the model asks the shell tool to run in the sandbox: the model API with the
    agent's token it inherited, with a proxy and no token, with no proxy at all, a raw
    connection to the proxy port with the agent's token, and a raw socket."""
    host = api.split("/")[2]
    curl = (f'curl -sS -o /dev/null --max-time 20 --cacert "$NODE_EXTRA_CA_CERTS" -d {{}} '
            f'{api}')
    return (f'{curl} -w "inherited:%{{http_code}}/%{{http_connect}} "; '
            f'{curl} -w "bare:%{{http_code}}/%{{http_connect}} " '
            f'--proxy http://{proxy.host}:{proxy.port}; '
            f'env -u HTTPS_PROXY -u https_proxy -u ALL_PROXY -u all_proxy {curl} --noproxy "*" '
            f'--connect-timeout 5 -w "direct:%{{http_code}} "; '
            f"python3 -c '{raw_connect(host)}'; "
            'python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 6)" '
            '2>/dev/null && echo rawsock:open || echo rawsock:denied')


def raw_connect(host: str) -> str:
    """A raw TCP connection to the proxy port, the agent's token (from the environment the
    tool inherited) written by hand: one line of Python, in single quotes."""
    return ('import os, socket, base64, urllib.parse as u; '
            'p = u.urlsplit(os.environ["HTTPS_PROXY"]); '
            's = socket.create_connection((p.hostname, p.port), 10); '
            'a = base64.b64encode((u.unquote(p.username) + ":" + u.unquote(p.password))'
            '.encode()).decode(); '
            f's.sendall(("CONNECT {host}:443 HTTP/1.1\\r\\nHost: {host}:443\\r\\n'
            'Proxy-Authorization: Basic " + a + "\\r\\n\\r\\n").encode()); '
            'print("raw:" + s.recv(100).split()[1].decode(), end=" ")')


@pytest.fixture(scope="module")
def agent_client() -> Iterator[docker.DockerClient]:
    yield from docker_with_images("bash-tool")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, vault, agent_client) -> Iterator[Stack]:
    claude_binary(), codex_binary()  # pinned and installed, or a failure that says how
    network = ensure_network_info(agent_client)
    assert network.host_firewall
    tmp = tmp_path_factory.mktemp("agent-sandbox")
    pki = make_pki(tmp / "pki", ["api.anthropic.com", "api.openai.com",
                                 "generativelanguage.googleapis.com"])
    vault.put_kv2("llm/gemini", {"api_key": GEMINI_KEY})
    api = StandInToolTurn(tool=("Bash", "bash"), command="true")  # Claude Code's, OpenCode's
    openai = StandInResponses(command="true")
    gemini = StandInGemini(command="true")
    gemini_server = AppThread(gemini.app(), pki.cert, pki.key, GEMINI_IP).start()
    server = AppThread(api.app(), pki.cert, pki.key, API_IP).start()
    openai_server = AppThread(openai.app(), pki.cert, pki.key, OPENAI_IP).start()
    (tmp / "policies").mkdir()
    (tmp / "policies" / "secrets.yaml").write_text((TEMPLATES / "secrets.yaml").read_text())
    (tmp / "policies" / "claude-code.yaml").write_text(
        template("claude-code", "anthropic", API_IP))
    (tmp / "policies" / "codex.yaml").write_text(template("codex", "openai", OPENAI_IP))
    (tmp / "policies" / "opencode.yaml").write_text(template("opencode", "anthropic", API_IP))
    (tmp / "policies" / "gemini.yaml").write_text(template("gemini", "gemini", GEMINI_IP))
    agents = tmp / "agents"
    agents.mkdir()
    os.chmod(agents, 0o755)
    proxy = start_proxy(tmp, tmp / "policies", {"VAULT_ADDR": vault.addr,
                                                "VAULT_TOKEN": vault.root_token}, pki,
                        f"--resolve=api.anthropic.com={API_IP}",
                        f"--resolve=api.openai.com={OPENAI_IP}",
                        f"--resolve=generativelanguage.googleapis.com={GEMINI_IP}",
                        f"--agent-dir={agents}",
                        "--agent-split=claude-code=claude-code-tool",
                        "--agent-split=codex=codex-tool",
                        "--agent-split=opencode=opencode-tool",
                        "--agent-split=gemini=gemini-tool",
                        listen_host=network.gateway)
    api.command = sandbox_tool_command(proxy, API)
    openai.command = sandbox_tool_command(proxy, OPENAI_API)
    gemini.command = sandbox_tool_command(proxy, GEMINI_API)
    try:
        yield Stack(proxy, api, openai, gemini, agents, network)
    finally:
        stop_proxy(proxy)
        server.stop()
        openai_server.stop()
        gemini_server.stop()
    assert_no_secret([proxy.logs(), proxy.audit_file.read_text()], [*SECRET_VALUES, GEMINI_KEY],
                     "the proxy's log and audit")


def sandbox_run(stack: Stack, agent: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """The one command a user types (this machine has no Yama: --allow-ptrace says so)."""
    r = subprocess.run(
        [*SANDGATE, "sandbox", "run", "--agent", agent, "--cli-dir", str(CLI_DIR),
         "--agent-dir", str(stack.agents), "--confdir", str(stack.proxy.confdir),
         "--proxy-port", str(stack.proxy.port), "--memory", "2g", "--timeout", "240",
         "--allow-ptrace", "--", *cmd],
        capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    # the launcher's own stderr is clean: no finalizer noise from the exec's socket
    assert "Exception ignored" not in r.stderr, r.stderr[-1500:]
    return r


def audit_of(proxy: Proxy, identities: set[str]) -> list[dict]:
    return [e for e in proxy.audit() if e.get("identity") in identities
            and e.get("event") == "request"]


def check_tool_result(result: str) -> None:
    # the inherited agent token is refused at CONNECT (the owner decides), no token is the
    # tool identity (403), and without a proxy nothing is reachable from the sandbox
    assert "inherited:000/407" in result and "bare:403/200" in result, result
    assert "direct:000" in result, result
    assert "raw:407" in result and "rawsock:denied" in result, result


def test_claude_code_in_a_sandbox_with_the_split(stack: Stack) -> None:
    before = len(stack.api.calls)
    r = sandbox_run(stack, "claude-code", "claude", "-p", "Call the model API from the shell.",
                    "--dangerously-skip-permissions", "--output-format", "text")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "Claude Code's output")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    assert stack.api.results, f"the tool's result never came back: {r.stdout[-1500:]}"
    check_tool_result(stack.api.results[-1])
    assert "The tool said:" in r.stdout
    calls = stack.api.calls[before:]
    assert len(calls) >= 2
    for call in calls:
        assert_secret_equal(call.headers.get("x-api-key"), ANTHROPIC_KEY, "the injected key")
    events = audit_of(stack.proxy, {"claude-code", "claude-code-tool"})
    allowed = {(e["identity"], e["identity_source"], e["rule"]) for e in events
               if e.get("decision") == "allow"}
    assert allowed == {("claude-code", "process/agent", "messages")}, events
    assert ("claude-code-tool", "process/tool", "/v1/messages") in {
        (e["identity"], e["identity_source"], e["path"]) for e in events
        if e.get("code") == "no_rule"}, events
    assert any(e.get("sandbox", "").startswith("sbx-") for e in events)
    # its other hosts: refused as its template says, nothing else
    assert {e["path"] for e in events if e["identity"] == "claude-code"
            and e.get("decision") == "deny"} <= {"/api/claude_code/settings",
                                                 "/api/claude_code/policy_limits"}, events
    # the registration is gone with the agent
    assert not list(stack.agents.glob("*.json"))


def test_codex_in_a_sandbox_with_the_split(stack: Stack) -> None:
    """Codex has no hook for its shell: the split holds in the sandbox all the same."""
    before = len(stack.openai.calls)
    r = sandbox_run(stack, "codex", "codex", "exec", "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox",
                    "Call the model API from the shell.")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "Codex's output")
    assert r.returncode == 0, (f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-3000:]}"
                               f"{audit_of(stack.proxy, {'codex', 'codex-tool'})}")
    assert stack.openai.results, f"the tool's output never came back: {r.stderr[-1500:]}"
    check_tool_result(stack.openai.results[-1])
    assert "The tool said:" in r.stdout + r.stderr
    calls = [c for c in stack.openai.calls[before:] if c.method == "POST"]
    assert len(calls) >= 2
    for call in calls:
        assert_secret_equal(call.headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                            "the injected key")
    events = audit_of(stack.proxy, {"codex", "codex-tool"})
    allowed = {(e["identity"], e["identity_source"], e["rule"]) for e in events
               if e.get("decision") == "allow"}
    assert allowed == {("codex", "process/agent", "responses")}, events
    assert ("codex-tool", "process/tool", "/v1/responses") in {
        (e["identity"], e["identity_source"], e["path"]) for e in events
        if e.get("code") == "no_rule"}, events
    # its other hosts (plugins, models, metrics, the update check): refused as its template
    # says, and the git fetch of its plugins is a process it starts, so the tool's
    assert {e["host"] for e in events if e.get("decision") == "deny"} <= {
        "api.openai.com", "chatgpt.com", "ab.chatgpt.com", "api.github.com", "github.com"}, events
    assert all(e["identity"] == "codex-tool" for e in events if e["host"] == "github.com")


def test_opencode_in_a_sandbox_with_the_split(stack: Stack) -> None:
    before = len(stack.api.calls)
    r = sandbox_run(stack, "opencode", "opencode", "run", "--pure", "--auto", "-m",
                    "anthropic/claude-sonnet-4-5", "Call the model API from the shell.")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "OpenCode's output")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    assert stack.api.results, f"the tool's result never came back: {r.stdout[-1500:]}"
    check_tool_result(stack.api.results[-1])
    calls = stack.api.calls[before:]
    assert len(calls) >= 2
    for call in calls:
        assert_secret_equal(call.headers.get("x-api-key"), ANTHROPIC_KEY, "the injected key")
    events = audit_of(stack.proxy, {"opencode", "opencode-tool"})
    assert {(e["identity"], e["identity_source"], e["rule"]) for e in events
            if e.get("decision") == "allow"} == {("opencode", "process/agent", "messages")}
    assert ("opencode-tool", "process/tool", "/v1/messages") in {
        (e["identity"], e["identity_source"], e["path"]) for e in events
        if e.get("code") == "no_rule"}, events


def test_gemini_cli_in_a_sandbox_with_the_split(stack: Stack) -> None:
    before = len(stack.gemini.calls)
    r = sandbox_run(stack, "gemini-cli", "gemini", "-m", "gemini-2.5-pro", "--yolo", "-p",
                    "Call the model API from the shell.")
    assert_no_secret([r.stdout, r.stderr], [*SECRET_VALUES, GEMINI_KEY], "Gemini CLI's output")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
    assert stack.gemini.results, f"the tool's result never came back: {r.stdout[-1500:]}"
    check_tool_result(stack.gemini.results[-1])
    calls = [c for c in stack.gemini.calls[before:] if c.method == "POST"]
    assert len(calls) >= 2
    for call in calls:
        assert_secret_equal(call.headers.get("x-goog-api-key"), GEMINI_KEY, "the injected key")
    events = audit_of(stack.proxy, {"gemini", "gemini-tool"})
    assert {(e["identity"], e["identity_source"], e["rule"]) for e in events
            if e.get("decision") == "allow"} == {("gemini", "process/agent", "generate")}
    assert ("gemini-tool", "process/tool") in {
        (e["identity"], e["identity_source"]) for e in events
        if e.get("code") == "no_rule"}, events
