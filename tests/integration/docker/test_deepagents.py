"""deepagents with its tools in a Sandgate sandbox (pattern 2): SandgateSandboxBackend.

The agent side runs as a process of its own (the dev environment's interpreter: deepagents is
in the `clients` extra, requirements/dev.lock) with the repo on PYTHONPATH. The model is a
deterministic fake that makes REAL tool calls through deepagents' tools (execute, write_file,
read_file, edit_file, ls); the assertions check their results came from the container: its
hostname, files persisting across calls, no direct way out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import docker
import pytest

from sandgate.sandbox import LABEL_SANDBOX, SandboxSpec
from tests.integration.conftest import SECRET_VALUES
from tests.support.sdk import CLIENT_PY, need_sdk

REPO = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.docker, pytest.mark.integration]

# Runs as the agent host's process. Reads {"spec": {...}, "marker": str} on stdin, prints one
# JSON line.
AGENT_SCRIPT = r'''
import json, sys
from typing import Any

from deepagents import __version__ as deepagents_version, create_deep_agent
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from sandgate.integrations.deepagents_backend import SandgateSandboxBackend
from sandgate.sandbox import SandboxSpec, connect

req = json.load(sys.stdin)
marker = req["marker"]
spec = SandboxSpec(**req["spec"])


def call(n: int, name: str, **args: Any) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call{n}"}])


# One tool call per turn (parallel calls would make the order nondeterministic).
STEPS = [
    call(0, "execute", command=f"echo hi-{marker} > /workspace/f && cat /workspace/f && hostname"),
    call(1, "write_file", file_path="/workspace/notes.txt",
         content=f"note {marker}\nsecond line\n"),
    call(2, "read_file", file_path="/workspace/f"),
    call(3, "edit_file", file_path="/workspace/notes.txt", old_string="second line",
         new_string="edited line"),
    call(4, "execute", command="cat /workspace/notes.txt; echo sandbox=$SANDGATE_SANDBOX; "
         "echo user=$(id -un)"),
    call(5, "execute", command="curl --noproxy '*' -sS --connect-timeout 3 -m 5 "
         "https://1.1.1.1/ -o /dev/null; echo direct_rc=$?"),
    call(6, "ls", path="/workspace"),
    # Too big for the context: deepagents leaves it in the sandbox and returns a preview.
    call(7, "execute", command="seq 1 300000"),
    call(8, "execute", command="wc -l < /large_tool_results/call7"),
]


class ScriptedModel(BaseChatModel):
    """Answers turn n (n = ToolMessages so far) with STEPS[n], then a final answer."""

    bound_tools: list[str] = []

    @property
    def _llm_type(self) -> str:
        return "sandgate-scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> "ScriptedModel":
        names = []
        for t in tools:
            names.append(t.get("name") if isinstance(t, dict) else getattr(t, "name", str(t)))
        self.bound_tools = names
        return self

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        n = sum(isinstance(m, ToolMessage) for m in messages)
        msg = STEPS[n] if n < len(STEPS) else AIMessage(content=f"final answer {marker}")
        return ChatResult(generations=[ChatGeneration(message=msg)])


model = ScriptedModel()
with SandgateSandboxBackend.create(connect(), spec) as backend:
    agent = create_deep_agent(model=model, backend=backend)
    result = agent.invoke({"messages": [{"role": "user", "content": "run the script"}]},
                          config={"recursion_limit": 40})
    sandbox_id = backend.id
    container = backend.sandbox.container.name

tools = [{"name": m.name, "content": m.content if isinstance(m.content, str)
          else json.dumps(m.content), "status": m.status}
         for m in result["messages"] if isinstance(m, ToolMessage)]
print(json.dumps({
    "deepagents": deepagents_version,
    "sandbox_id": sandbox_id,
    "container": container,
    "bound_tools": model.bound_tools,
    "tools": tools,
    "final": result["messages"][-1].content,
}))
'''

# Runs as the agent host's process: the backend's protocol methods directly, no agent.
BACKEND_SCRIPT = r'''
import json, sys
from sandgate.integrations.deepagents_backend import SandgateSandboxBackend
from sandgate.sandbox import SandboxSpec, connect

spec = SandboxSpec(**json.load(sys.stdin)["spec"])
out = {}
with SandgateSandboxBackend.create(connect(), spec) as b:
    r = b.execute("echo out; echo err >&2; exit 7")
    out["execute"] = [r.output, r.exit_code, r.truncated]
    r = b.execute("sleep 10", timeout=1)
    out["timeout"] = [r.output, r.exit_code]
    r = b.execute("echo $PATH; pwd")
    out["env"] = r.output
    blob = bytes(range(256)) * 4096  # 1 MiB, binary
    ups = b.upload_files([("/workspace/deep/dir/blob.bin", blob), ("/etc/passwd", b"x"),
                          ("/workspace", b"x"), ("rel.txt", b"relative")])
    out["upload"] = [u.error for u in ups]
    r = b.execute("stat -c '%U %s' /workspace/deep/dir/blob.bin; cat /workspace/rel.txt")
    out["uploaded"] = r.output
    downs = b.download_files(["/workspace/deep/dir/blob.bin", "/nope", "/workspace",
                              "/etc/shadow", "rel.txt"])
    out["download_ok"] = downs[0].content == blob
    out["download"] = [d.error for d in downs[1:]]
    out["read_missing"] = b.read("/workspace/missing.txt").error
    big = b.execute_with_offload("seq 1 200000", "/tmp/big.out", max_inline_bytes=10000)
    out["offload"] = [big.offloaded, big.response.exit_code,
                      b.execute("wc -l < /tmp/big.out").output]
    out["delete"] = [b.delete("/workspace/rel.txt").error, b.delete("/workspace/rel.txt").error]
    out["id"] = b.id
print(json.dumps(out))
'''


def run_client(script: str, payload: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    need_sdk("deepagents", "docker")
    env = {k: v for k, v in os.environ.items()
           if "KEY" not in k and not k.startswith("VAULT") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "proxy"), str(REPO)])  # sandgate, tests
    res = subprocess.run([str(CLIENT_PY), "-c", script], input=json.dumps(payload),
                         capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert res.returncode == 0, (
        f"client script failed (exit {res.returncode})::\n--- stdout\n{res.stdout}\n"
        f"--- stderr\n{res.stderr[-6000:]}"
    )
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def spec_payload(spec: SandboxSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["placeholders"], d["labels"] = dict(spec.placeholders), dict(spec.labels)
    return d


def test_deep_agent_tools_run_in_the_sandbox(
    docker_client: docker.DockerClient, make_spec: Callable[..., SandboxSpec]
) -> None:
    marker = uuid.uuid4().hex[:12]
    spec = make_spec(identity="deepagents-tool")
    out = run_client(AGENT_SCRIPT, {"spec": spec_payload(spec), "marker": marker})

    # deepagents saw a sandbox backend: the execute tool was offered to the model.
    assert {"execute", "ls", "read_file", "write_file", "edit_file"} <= set(out["bound_tools"])
    tools = out["tools"]
    assert [t["name"] for t in tools] == [
        "execute", "write_file", "read_file", "edit_file", "execute", "execute", "ls",
        "execute", "execute"]
    assert all(t["status"] == "success" for t in tools), tools
    first, _write, read, edit, cat, curl, ls, big, count = (t["content"] for t in tools)

    # The command ran in the container: its hostname is the sandbox id, not this host's.
    sandbox_id = out["sandbox_id"]
    assert f"hi-{marker}" in first
    assert sandbox_id in first and sandbox_id.startswith("sbx-")
    assert socket.gethostname() not in first
    # State persists across tool calls in the same sandbox: read_file sees execute's file,
    # execute sees write_file's file with edit_file's change.
    assert f"hi-{marker}" in read
    assert "1 replacement" in edit or "notes.txt" in edit, edit
    assert f"note {marker}" in cat and "edited line" in cat and "second line" not in cat
    assert f"sandbox={sandbox_id}" in cat and "user=sandbox" in cat
    assert "notes.txt" in ls and "/workspace/f" in ls
    # Nothing of it landed on this host.
    assert not Path("/workspace/notes.txt").exists() or marker not in Path(
        "/workspace/notes.txt").read_text(errors="replace")
    # No direct way out: only the proxy (a dummy address here) could carry traffic.
    assert "direct_rc=0" not in curl and "direct_rc=" in curl, curl
    # Large output was captured in the sandbox (not shipped whole to the agent).
    assert "/large_tool_results/call7" in big and len(big) < 100_000, big[:500]
    assert count.strip().startswith("300000"), count
    assert out["final"] == f"final answer {marker}"
    for secret in SECRET_VALUES:
        assert secret not in json.dumps(out)

    # The backend owned the sandbox and removed it.
    left = docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_SANDBOX}={sandbox_id}"})
    assert left == [], f"sandbox {out['container']} left behind"


def test_backend_protocol_against_a_real_sandbox(
    docker_client: docker.DockerClient, make_spec: Callable[..., SandboxSpec]
) -> None:
    spec = make_spec(identity="deepagents-backend")
    out = run_client(BACKEND_SCRIPT, {"spec": spec_payload(spec)})

    assert out["execute"] == ["out\n[stderr] err", 7, False]
    output, code = out["timeout"]
    assert code in (124, 137) and "timed out after 1 s" in output
    path_line, cwd = out["env"].splitlines()
    assert path_line.startswith("/opt/venv/bin:") and cwd == "/workspace"  # the image's PATH
    # Uploads are written as the sandbox's user, with its permissions.
    assert out["upload"] == [None, "permission_denied", "is_directory", None]
    assert out["uploaded"].splitlines() == [f"sandbox {256 * 4096}", "relative"]
    assert out["download_ok"] is True
    assert out["download"] == ["file_not_found", "is_directory", "permission_denied", None]
    assert "file_not_found" in out["read_missing"]
    offloaded, code, lines = out["offload"]
    assert offloaded is True and code == 0 and lines.strip() == "200000"
    assert out["delete"][0] is None and "not found" in out["delete"][1]
    left = docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_SANDBOX}={out['id']}"})
    assert left == []


def test_backend_module_imports_without_deepagents() -> None:
    """Sandgate does not depend on deepagents (the image's requirements/proxy.lock has none):
    without it the module still imports (for mypy, for listing), and using the backend says
    what is missing. Run where deepagents cannot be imported."""
    script = (
        "import sys; sys.modules['deepagents'] = None  # import deepagents now fails\n"
        "from sandgate.integrations import deepagents_backend\n"
        "try:\n"
        "    deepagents_backend.SandgateSandboxBackend(object())\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "proxy"))
    res = subprocess.run([str(CLIENT_PY), "-c", script], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ImportError: SandgateSandboxBackend needs deepagents"), res.stdout
