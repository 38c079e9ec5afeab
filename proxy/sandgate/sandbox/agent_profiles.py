"""What each coding agent needs in a sandbox (`sandgate sandbox run --agent NAME`, docs/agents.md).

One profile per agent: its identity and its tool's (the names of policies/agents/NAME.yaml and of
`sandgate run --agent-split`), the variables its runtime needs besides the proxy and CA ones every
sandbox gets (sandgate.proxyenv: HTTPS_PROXY, NODE_EXTRA_CA_CERTS, SSL_CERT_FILE, ...): its
placeholder key, telemetry and self-update off; the files it reads its settings from (relative to
the sandbox user's home); and where its own binary is in an npm install of the pinned CLIs
(tests/agents), because the agent must be the process that runs it: a launcher that starts the
binary as a child makes the binary the tool (fail closed).

Pure data and functions: no Docker here, so the unit tests cover every profile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Where `--cli-dir` (a node_modules directory of the pinned CLIs) is mounted, read-only.
CLI_MOUNT = "/opt/sandgate-agents/node_modules"

CODEX_CONFIG = """# Codex through Sandgate: the real API host, a placeholder key (injected)
model = "gpt-5-codex"
model_provider = "openai-sandgate"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.openai-sandgate]
name = "OpenAI through Sandgate"
base_url = "https://api.openai.com/v1"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
# SSE: the Responses API over a WebSocket needs the template's responses-websocket rule
supports_websockets = false
"""

GEMINI_SETTINGS = json.dumps({
    "privacy": {"usageStatisticsEnabled": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
}, indent=2) + "\n"


@dataclass(frozen=True, slots=True)
class AgentProfile:
    name: str  # --agent NAME; also the agent identity and its template's file name
    tool_identity: str
    env: Mapping[str, str]  # besides the proxy and CA variables every sandbox gets
    files: Mapping[str, str] = field(default_factory=dict)  # home-relative path -> content
    command: str | None = None  # the name users type (claude, codex, ...): resolved in --cli-dir
    binary: str | None = None  # its own binary, relative to node_modules
    why: Mapping[str, str] = field(default_factory=dict)  # variable -> why (docs, --help)

    @property
    def identity(self) -> str:
        return self.name

    @property
    def template(self) -> str:
        return f"policies/agents/{self.name}.yaml"

    def argv(self, cmd: Sequence[str], cli_mount: str | None) -> list[str]:
        """The command to run as the agent: the profile's command name, as the first word,
        becomes the path of its own binary in the mounted CLIs (an npm wrapper would start the
        binary as a child, which is the tool)."""
        out = list(cmd)
        if out and cli_mount is not None and self.binary is not None and out[0] == self.command:
            out[0] = f"{cli_mount}/{self.binary}"
        return out


_PROFILES = (
    AgentProfile(
        "claude-code", "claude-code-tool",
        env={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
             "IS_SANDBOX": "1"},
        command="claude", binary="@anthropic-ai/claude-code/bin/claude.exe",
        why={"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "no telemetry, error reports or "
             "update checks", "DISABLE_AUTOUPDATER": "no self-update",
             "IS_SANDBOX": "--dangerously-skip-permissions also as root"}),
    AgentProfile(
        "codex", "codex-tool",
        env={"OPENAI_API_KEY": "sandgate-placeholder-openai"},
        files={".codex/config.toml": CODEX_CONFIG},
        command="codex",
        binary="@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
        why={".codex/config.toml": "the real API host with the placeholder key, no update "
             "check, no analytics (CODEX_HOME is ~/.codex)"}),
    AgentProfile(
        "gemini", "gemini-tool",
        env={"GEMINI_API_KEY": "sandgate-placeholder-gemini", "GEMINI_CLI_NO_RELAUNCH": "true",
             "GEMINI_CLI_TRUST_WORKSPACE": "true"},
        files={".gemini/settings.json": GEMINI_SETTINGS},
        command="gemini", binary="@google/gemini-cli/bundle/gemini.js",
        why={"GEMINI_CLI_NO_RELAUNCH": "it would restart itself as a child, which is the tool",
             ".gemini/settings.json": "no usage statistics, no update, the API key auth"}),
    AgentProfile(
        "opencode", "opencode-tool",
        env={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic",
             "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"},
        command="opencode", binary="opencode-ai/bin/opencode.exe",
        why={"OPENCODE_DISABLE_MODELS_FETCH": "no model list from models.dev"}),
    AgentProfile(
        "deepagents", "deepagents-tool",
        env={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic", "LANGSMITH_TRACING": "false"},
        why={"LANGSMITH_TRACING": "no tracing of prompts and tool output to a third party"}),
)
PROFILES: Mapping[str, AgentProfile] = {p.name: p for p in _PROFILES}
# --agent accepts the CLI's package-ish names too
ALIASES = {"gemini-cli": "gemini", "claude": "claude-code"}


def profile(name: str) -> AgentProfile:
    """The profile of --agent NAME. Raises ValueError naming the known ones."""
    found = PROFILES.get(ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"--agent {name!r}: unknown agent; one of {', '.join(PROFILES)} "
                         "(gemini-cli is gemini)")
    return found
