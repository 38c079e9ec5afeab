#!/usr/bin/env python3
"""Pattern 1: a deepagents agent that runs INSIDE the Sandgate agent container.

    python3 run_deepagent.py "summarise /workspace/README.md"
    echo "task" | python3 run_deepagent.py --model claude-sonnet-4-6 -

The model is `ChatAnthropic` with the key in ANTHROPIC_API_KEY, which in a Sandgate sandbox is a
placeholder: the SDK's requests leave through HTTPS_PROXY (Sandgate), trust the Sandgate CA
(SSL_CERT_FILE), and Sandgate swaps the real key in on the way to api.anthropic.com when the
sandbox's policy allows it. The agent's own tools (`execute`, `ls`, `read_file`, `write_file`,
`edit_file`, `glob`, `grep`) run right here, in the container: whatever they reach goes through
Sandgate too. In a split sandbox (docs/pattern1.md) `execute` runs as the `tool` user through the
runner, so generated code gets the bash tool's identity and never the agent's egress. Prints the
agent's final answer on stdout.

Needs `deepagents` and `langchain-anthropic` in the container's Python.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

DEFAULT_MODEL = "claude-sonnet-4-6"
RUNNER_SOCKET = "/run/sandgate/runner.sock"  # the split's tool runner (sandgate.pattern1)
SYSTEM_PROMPT = (
    "You are an agent running in a network-restricted sandbox. Work in {workdir}. Every "
    "network request leaves through an egress proxy that may refuse it: if a request is "
    "refused, say so instead of retrying around it."
)


def build_agent(model: Any, workdir: str, timeout: int = 120) -> Any:
    """The deep agent, its tools on this machine (the sandbox) rooted at `workdir`."""
    from deepagents import create_deep_agent

    return create_deep_agent(
        model=model, backend=shell_backend(workdir, timeout),
        system_prompt=SYSTEM_PROMPT.format(workdir=workdir),
    )


def shell_backend(workdir: str, timeout: int = 120) -> Any:
    """The tools' backend. In a split sandbox (docs/pattern1.md: the runner's socket exists) the
    `execute` tool runs every command through the root-owned runner as the `tool` user, whose
    traffic Sandgate sees as the bash tool's identity; without the split, here as the agent."""
    if os.path.exists(RUNNER_SOCKET):
        from sandgate.pattern1.shell import runner_backend

        return runner_backend(workdir, timeout)
    from deepagents.backends import LocalShellBackend

    return LocalShellBackend(
        root_dir=workdir,
        virtual_mode=False,  # the container is the boundary: real paths, as the shell sees them
        timeout=timeout,
        inherit_env=True,  # the proxy and CA variables the sandbox set, for the tools' requests
    )


def anthropic_model(model: str, base_url: str | None, max_tokens: int) -> Any:
    from langchain_anthropic import ChatAnthropic

    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key:
        raise SystemExit("ANTHROPIC_API_KEY is not set (in a Sandgate sandbox it is a placeholder)")
    kwargs: dict[str, Any] = {"model": model, "api_key": key, "max_tokens": max_tokens}
    if base_url:
        kwargs["base_url"] = base_url
    return ChatAnthropic(**kwargs)


def final_answer(result: dict[str, Any]) -> str:
    """The text of the last AI message of a finished run."""
    for message in reversed(result.get("messages", [])):
        if getattr(message, "type", None) != "ai":
            continue
        content = message.content
        if isinstance(content, str):
            text = content
        else:  # content blocks
            text = "".join(
                b.get("text", "") if isinstance(b, dict) else str(b) for b in content
            )
        if text.strip():
            return text.strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", help="what the agent should do ('-': read it from stdin)")
    parser.add_argument("--model", default=os.environ.get("SANDGATE_AGENT_MODEL", DEFAULT_MODEL))
    parser.add_argument("--base-url", default=None,
                        help="Anthropic API base URL (default: the SDK's, or ANTHROPIC_BASE_URL)")
    parser.add_argument("--workdir", default=os.environ.get("SANDGATE_WORKDIR", "/workspace"))
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--recursion-limit", type=int, default=50,
                        help="maximum graph steps (model and tool calls) before giving up")
    args = parser.parse_args(argv)

    task = sys.stdin.read() if args.task == "-" else args.task
    if not task.strip():
        parser.error("empty task")
    try:
        agent = build_agent(anthropic_model(args.model, args.base_url, args.max_tokens),
                            args.workdir)
    except ImportError as exc:
        print(f"run_deepagent: {exc}: this image needs deepagents and langchain-anthropic",
              file=sys.stderr)
        return 2
    result = agent.invoke(
        {"messages": [{"role": "user", "content": task}]},
        config={"recursion_limit": args.recursion_limit},
    )
    answer = final_answer(result)
    print(answer)
    return 0 if answer else 1


if __name__ == "__main__":
    sys.exit(main())
