"""The launcher's side of pattern 1 with the split (docs/pattern1.md).

A split sandbox runs the agent image's entrypoint (sandgate.pattern1.entrypoint) as root with
just the capabilities it needs to set the sandbox up (NET_ADMIN for the rules, SETUID/SETGID/
SETPCAP to drop to the agent and start the runner, KILL for the runner, CHOWN for its socket);
the entrypoint leaves none of them to the agent. The launcher puts the CA in before start, opens
the tool and other listener ports in the host firewall besides the proxy port, waits until the
entrypoint reports the rules in place, and runs `exec` commands as the agent the same way (root
drops to the agent with an empty bounding set: a plain `docker exec --user agent` would keep the
container's capabilities in its bounding set).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandgate.sandbox.engine import SandboxError

ENTRYPOINT = "sandgate-split-entrypoint"
CAPS = ("NET_ADMIN", "SETUID", "SETGID", "SETPCAP", "KILL", "CHOWN")
IMAGE = "sandgate-agent:dev"
STATE_FILE = "/run/sandgate/split"
# root -> the agent: its groups, no capability (bounding set empty), no new privileges, umask 002
AS_AGENT = ["setpriv", "--reuid=agent", "--regid=agent", "--init-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--",
            "sh", "-c", 'umask 002 && exec "$@"', "sandgate-agent"]


@dataclass(frozen=True, slots=True)
class SplitPorts:
    """Where Sandgate's role listeners are, at the proxy's address (`sandgate run
    --role-listen tool=HOST:8081 --role-listen other=HOST:8082`)."""

    tool_port: int = 8081
    other_port: int = 8082

    def environment(self) -> dict[str, str]:
        return {"SANDGATE_SPLIT": "uid", "SANDGATE_SPLIT_TOOL_PORT": str(self.tool_port),
                "SANDGATE_SPLIT_OTHER_PORT": str(self.other_port)}

    def validate(self, proxy_port: int) -> None:
        ports = {proxy_port, self.tool_port, self.other_port}
        if len(ports) != 3 or not all(0 < p < 65536 for p in ports):
            raise SandboxError(f"the split needs three distinct ports: proxy {proxy_port}, "
                               f"tool {self.tool_port}, other {self.other_port}")


def container_options() -> dict[str, Any]:
    """What a split sandbox's container differs in (docker create keyword arguments)."""
    return {"user": "root", "entrypoint": [ENTRYPOINT], "cap_add": list(CAPS)}


def wait_ready(read_state: Callable[[], str | None], status: Callable[[], str],
               logs: Callable[[], str], timeout: float = 60) -> dict[str, Any]:
    """Wait for the entrypoint's report (the rules are in place, the runner runs). Raises
    SandboxError with the entrypoint's output when the container stops instead."""
    deadline = time.monotonic() + timeout
    while True:
        text = read_state()
        if text:
            state = json.loads(text)
            if not isinstance(state, dict) or state.get("split") != "uid":
                raise SandboxError(f"the sandbox started without the split: {text.strip()}")
            return state
        st = status()
        if st not in ("created", "running"):
            raise SandboxError(f"the split sandbox stopped ({st}): {logs().strip()[-800:]}")
        if time.monotonic() >= deadline:
            raise SandboxError(f"the split sandbox did not report ready in {timeout:g} s: "
                               f"{logs().strip()[-800:]}")
        time.sleep(0.2)
