"""deepagents' shell tool in a split sandbox: `execute` goes through the tool runner.

    from sandgate.pattern1.shell import runner_backend
    backend = runner_backend("/workspace", timeout=120)   # a deepagents LocalShellBackend
    agent = create_deep_agent(model=model, backend=backend)

The file tools (ls, read_file, write_file, edit_file, glob, grep) stay the agent's own, in
`root_dir` (the shared /workspace); every command the agent's `execute` tool runs is executed by
the root-owned runner as the tool user, so what it reaches is the tool identity's egress.
deepagents is imported only when this is called (the runner itself needs nothing but the
standard library).
"""

from __future__ import annotations

from typing import Any

from sandgate.pattern1.toolrunner import SOCKET, RunnerError, run_tool


def format_output(answer: dict[str, Any], max_bytes: int) -> tuple[str, bool]:
    """The runner's answer as deepagents shows a command's output: stdout, then stderr lines
    prefixed `[stderr]`, the exit code when non-zero; truncated at max_bytes."""
    parts = []
    stdout, stderr = str(answer.get("stdout", "")), str(answer.get("stderr", ""))
    if stdout:
        parts.append(stdout)
    if stderr:
        parts.extend(f"[stderr] {line}" for line in stderr.strip().split("\n"))
    output = "\n".join(parts) if parts else "<no output>"
    truncated = False
    raw = output.encode()
    if len(raw) > max_bytes:
        output = raw[:max_bytes].decode("utf-8", "ignore")
        output += f"\n\n... Output truncated at {max_bytes} bytes."
        truncated = True
    code = answer.get("exit_code")
    if answer.get("timed_out"):
        output = f"{output.rstrip()}\n\nError: the command timed out"
    if isinstance(code, int) and code != 0:
        output = f"{output.rstrip()}\n\nExit code: {code}"
    return output, truncated


def runner_backend(root_dir: str, timeout: int = 120, socket_path: str = SOCKET,
                   max_output_bytes: int = 100_000) -> Any:
    """A deepagents LocalShellBackend rooted at root_dir whose `execute` runs as the tool."""
    from deepagents.backends import LocalShellBackend
    from deepagents.backends.protocol import ExecuteResponse

    # (misc: Any where deepagents is not installed; the dev lock has it, typed)
    class RunnerShellBackend(LocalShellBackend):  # type: ignore[misc, unused-ignore]
        """LocalShellBackend, with `execute` through the split's tool runner."""

        def execute(self, command: str, *, timeout: int | None = None) -> Any:
            if not command or not isinstance(command, str):
                return ExecuteResponse(output="Error: Command must be a non-empty string.",
                                       exit_code=1, truncated=False)
            secs = timeout if timeout is not None else self._default_timeout
            if secs <= 0:
                raise ValueError(f"timeout must be positive, got {secs}")
            try:
                answer = run_tool(command, secs, str(self.cwd), socket_path)
            except RunnerError as e:
                return ExecuteResponse(output=f"Error: {e}", exit_code=1, truncated=False)
            output, truncated = format_output(answer, max_output_bytes)
            code = answer.get("exit_code")
            return ExecuteResponse(output=output, exit_code=code if isinstance(code, int) else
                                   None, truncated=truncated)

    return RunnerShellBackend(root_dir=root_dir, virtual_mode=False, timeout=timeout,
                              max_output_bytes=max_output_bytes)
