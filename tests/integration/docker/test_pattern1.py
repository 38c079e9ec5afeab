"""Pattern 1 with the split, end to end: one real container of the real agent image, the real
Sandgate process, a real TLS upstream standing in for the LLM API (tests/integration/conftest).

Inside ONE sandbox the agent's LLM call gets the injected key, while everything its bash tool
runs (through the root-owned runner, as the `tool` user) is the bash-tool identity whatever it
tries: curl, Python requests, a raw socket, the agent's token from the environment or /proc,
the agent's listener directly, another destination, changing the rules. Any other user's traffic
is refused and audited; a sandbox without the split is audited as unsplit.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import docker
import pytest

from sandgate.sandbox import Sandbox, SandboxSpec
from sandgate.sandbox.network import SandboxNetwork, ensure_network_info
from sandgate.sandbox.split import SplitPorts
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SECRET_VALUES,
    Proxy,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.integration.docker.conftest import SESSION, TEST_LABEL, docker_with_images
from tests.integration.docker.test_proxy_sandboxes import ANTHROPIC_SCRIPT as LLM_SCRIPT
from tests.support.secrets import assert_no_secret, assert_secret_equal

AGENT_IMAGE = "sandgate-agent:dev"
TOOL_IDENTITY = "bash-tool"  # the test policy's narrow identity: GET upstream.test/docs/** only



@pytest.fixture(scope="session")  # its teardown removes every container of the session
def p1_client() -> Iterator[docker.DockerClient]:
    """Docker with the agent image (only it: the split needs nothing else)."""
    yield from docker_with_images("agent")


@pytest.fixture(scope="module")
def p1_network(p1_client: docker.DockerClient) -> SandboxNetwork:
    info = ensure_network_info(p1_client)
    assert info.host_firewall, "the host firewall for the sandbox network could not be installed"
    return info


@pytest.fixture(scope="module")
def split_ports() -> SplitPorts:
    return SplitPorts(tool_port=free_port(), other_port=free_port())


@pytest.fixture(scope="module")
def p1_proxy(tmp_path_factory, vault, upstream, pki, p1_network, split_ports) -> Iterator[Proxy]:
    gw = p1_network.gateway
    p = start_proxy(tmp_path_factory.mktemp("p1"), HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--docker-network", p1_network.name,
                    "--role-listen", f"tool={gw}:{split_ports.tool_port}",
                    "--role-listen", f"other={gw}:{split_ports.other_port}",
                    "--tool-identity", f"coding-agent={TOOL_IDENTITY}",
                    listen_host=gw)
    yield p
    stop_proxy(p)
    assert_no_secret([p.logs() + p.audit_file.read_text()], SECRET_VALUES, "the proxy logs")


def _spec(proxy: Proxy, sandbox_id: str, split: SplitPorts | None) -> SandboxSpec:
    return SandboxSpec(
        identity="coding-agent", image=AGENT_IMAGE, sandbox_id=sandbox_id,
        proxy_url=proxy.url, ca_pem=proxy.ca.read_text(), split=split,
        token=proxy.token("coding-agent", sandbox=sandbox_id),
        placeholders={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"},
        labels={TEST_LABEL: SESSION},
    )


@pytest.fixture(scope="module")
def agent(p1_client, p1_proxy, split_ports) -> Iterator[Sandbox]:
    sbx = Sandbox.create(p1_client, _spec(p1_proxy, f"p1-{SESSION}", split_ports))
    yield sbx
    sbx.close()


def tool(agent: Sandbox, cmd: str) -> tuple[int, str]:
    """Run `cmd` the way the agent's bash tool does: the agent asks the runner."""
    r = agent.exec(["sandgate-tool", "--timeout", "60", "--", cmd], timeout=90)
    return r.exit_code, r.stdout + r.stderr


def _status_and_doc(out: str) -> tuple[str, dict]:
    """curl -w '\\n%{http_code}' after a JSON refusal: (status, refusal)."""
    body, _, status = out.strip().rpartition("\n")
    try:
        doc = json.loads(body[body.index("{"):body.rindex("}") + 1])
    except ValueError:
        doc = {}
    return status.strip(), doc


def test_agent_llm_call_gets_the_key_and_its_tool_gets_the_tool_identity(agent, p1_proxy,
                                                                        upstream):
    assert agent.split_state is not None and agent.split_state["split"] == "uid"
    before = len(upstream.seen)
    r = agent.exec(["python", "-c", LLM_SCRIPT], timeout=60)
    assert r.exit_code == 0, r.stderr[-2000:]
    assert "TEXT: hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [s.path for s in seen] == ["/v1/messages"]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")

    # The same call by the bash tool: the tool identity has no LLM rule.
    before = len(upstream.seen)
    code, out = tool(agent, "python3 -c '" + LLM_SCRIPT.replace("'", '"') + "'")
    assert code != 0 and "403" in out and TOOL_IDENTITY in out, out
    code, out = tool(agent, "id -un; id -Gn; curl -sS --max-time 20 -w '\\n%{http_code}' "
                            "https://upstream.test/page")
    assert out.startswith("tool\n") and "workspace" in out.splitlines()[1], out
    status, doc = _status_and_doc(out)
    assert status == "403", out
    assert doc.get("identity") == TOOL_IDENTITY and doc.get("code") == "no_rule", out
    # ... and what the tool identity may do, it does
    code, out = tool(agent, "curl -sS --max-time 20 -o /dev/null -w '%{http_code}' "
                            "https://upstream.test/docs/x")
    assert out.strip() == "200", out
    assert [s.path for s in upstream.seen[before:]] == ["/docs/x"]
    assert_no_secret([out], SECRET_VALUES, "the tool output")

    # The audit shows the two identities for the one sandbox.
    a = p1_proxy.wait_audit(lambda e: e.get("sandbox") == agent.id and e.get("rule") == "llm")
    assert a["identity"] == "coding-agent" and a["identity_source"] == "docker/agent"
    t = p1_proxy.wait_audit(lambda e: e.get("sandbox") == agent.id
                            and e.get("identity") == TOOL_IDENTITY and e.get("code") == "no_rule")
    assert t["identity_source"] == "docker/tool"
    for ev in (a, t):  # the proof in docs/pattern1.md
        print(json.dumps({k: ev.get(k) for k in ("identity", "sandbox", "identity_source",
                                                 "host", "path", "decision", "code", "rule",
                                                 "secrets")}))


def test_the_agents_token_gives_the_tool_nothing(agent, p1_proxy, upstream, split_ports):
    token = agent.spec.token
    assert token
    gw, port = p1_proxy.host, p1_proxy.port
    # The agent's environment and /proc are not the tool's to read...
    _, out = tool(agent, "env; for p in /proc/[0-9]*; do cat $p/environ 2>/dev/null "
                            "| tr '\\0' '\\n'; done")
    assert token not in out
    # ... and even holding the token (leaked any way), presenting it is refused.
    agent_proxy = f"http://coding-agent:{token}@{gw}:{port}"
    before = len(upstream.seen)
    _, out = tool(agent, f"curl -sS --max-time 20 -w '\\n%{{http_code}}' --proxy "
                            f"{agent_proxy} https://api.anthropic.com/v1/messages -d '{{}}'")
    assert out.strip().endswith("407") or "407" in out, out
    _code, out = tool(agent, "python3 - <<'EOF'\n"
                            "import requests\n"
                            f"p = {{'https': '{agent_proxy}', 'http': '{agent_proxy}'}}\n"
                            "try:\n"
                            "    r = requests.get('https://upstream.test/page', proxies=p, "
                            "timeout=20)\n"
                            "    print('STATUS', r.status_code)\n"
                            "except requests.exceptions.ProxyError as e:\n"
                            "    print('PROXYERROR', e)\n"
                            "EOF")
    assert "PROXYERROR" in out and "407" in out, out
    basic = base64.b64encode(f"coding-agent:{token}".encode()).decode()
    raw = ("python3 - <<'EOF'\n"
           "import socket, sys\n"
           f"s = socket.create_connection((sys.argv[1] if len(sys.argv) > 1 else '{gw}', "
           f"{port}), 10)\n"
           "s.sendall(b'GET http://upstream.test/docs/x HTTP/1.1\\r\\nHost: upstream.test\\r\\n'"
           f" b'Proxy-Authorization: Basic {basic}\\r\\nConnection: close\\r\\n\\r\\n')\n"
           "print(s.recv(200).split(b'\\r\\n')[0].decode())\n"
           "EOF")
    _, out = tool(agent, raw)
    assert "407" in out, out
    assert len(upstream.seen) == before
    ev = p1_proxy.wait_audit(lambda e: e.get("code") == "auth_invalid"
                             and "disagrees" in (e.get("reason") or "")
                             and e.get("client", "").startswith(agent.ip + ":"))
    assert ev["decision"] == "deny"
    assert_no_secret([json.dumps(p1_proxy.audit())], [token], "the audit log")


def test_no_way_around_the_tool_listener(agent, p1_proxy, upstream, split_ports):
    gw = p1_proxy.host
    before = len(upstream.seen)
    # Without a proxy, to any address and port: the kernel sends it to the tool listener,
    # where a plain request is the tool identity's (refused: no rule for it).
    _, out = tool(agent, "python3 - <<'EOF'\n"
                            "import socket\n"
                            "for addr in [('203.0.113.7', 80), ('" + gw + "', 22)]:\n"
                            "    s = socket.create_connection(addr, 10)\n"
                            "    s.sendall(b'GET http://upstream.test/page HTTP/1.1\\r\\n'\n"
                            "              b'Host: upstream.test\\r\\n'\n"
                            "              b'Connection: close\\r\\n\\r\\n')\n"
                            "    print(addr[1], s.recv(200).split(b'\\r\\n')[0].decode())\n"
                            "EOF")
    assert out.count("403") == 2, out
    # The rules cannot be changed, no raw socket, no DNS, no capability at all.
    _code, out = tool(agent, "iptables -t nat -F 2>&1; echo rc=$?; printf '*filter\\n"
                            ":OUTPUT ACCEPT [0:0]\\nCOMMIT\\n' | iptables-restore 2>&1; "
                            "echo rc=$?; grep CapBnd /proc/self/status; "
                            "python3 -c 'import socket; socket.socket(socket.AF_INET, "
                            "socket.SOCK_RAW, socket.IPPROTO_TCP)' 2>&1 | tail -1; "
                            "getent hosts upstream.test; echo dns=$?")
    assert "rc=0" not in out and "CapBnd:\t0000000000000000" in out, out
    assert "PermissionError" in out and "dns=2" in out, out
    rules = agent.exec(["iptables-save"], user="root", timeout=30).stdout  # the host looks
    assert "sandgate-split" in rules and ":OUTPUT DROP" in rules, rules
    # The tool cannot reach the runner (the agent's), nor become the agent or root.
    _, out = tool(agent, "python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); "
                            "s.connect(\"/run/sandgate/runner.sock\")' 2>&1 | tail -1; "
                            "su -c id 2>&1 </dev/null; echo su=$?")
    assert "PermissionError" in out and "su=0" not in out, out
    # The agent cannot become the tool user or root either, and holds no capability.
    r = agent.exec("grep CapBnd /proc/self/status; setpriv --reuid=tool id 2>&1; "
                   "echo setpriv=$?; find / -xdev -perm /6000 -type f 2>/dev/null | wc -l; "
                   "iptables -S 2>&1; echo ipt=$?", timeout=60)
    assert "CapBnd:\t0000000000000000" in r.stdout and "setpriv=0" not in r.stdout, r.stdout
    assert "\n0\n" in r.stdout and "ipt=0" not in r.stdout, r.stdout
    # The agent reaching the tool listener directly (or anything but its proxy) is rejected.
    r = agent.exec(f"curl -sS --max-time 20 --proxy http://{gw}:{split_ports.tool_port} "
                   "https://upstream.test/docs/x; echo rc=$?", timeout=60)
    assert "rc=7" in r.stdout, r.stdout + r.stderr  # connection refused, in the sandbox
    # Any other user (here: nobody, through docker exec) is refused and audited.
    r = agent.exec("curl -sS --max-time 20 -w '\\n%{http_code}' https://upstream.test/docs/x",
                   user="nobody", timeout=60)
    assert "response 407" in r.stderr, r.stdout + r.stderr
    ev = p1_proxy.wait_audit(lambda e: "neither the agent nor its bash tool"
                             in (e.get("reason") or "") and agent.id in e["reason"])
    assert ev["decision"] == "deny" and ev["code"] == "auth_invalid"
    assert len(upstream.seen) == before


def test_files_are_shared_through_the_workspace(agent):
    code, out = tool(agent, "echo from-tool > /workspace/shared.txt && ls -l /workspace/shared.txt")
    assert code == 0, out
    r = agent.exec("cat /workspace/shared.txt && echo from-agent >> /workspace/shared.txt && "
                   "echo ok", timeout=30)
    assert r.stdout.split() == ["from-tool", "ok"], r.stdout + r.stderr
    code, out = tool(agent, "cat /workspace/shared.txt; ls /home/agent 2>&1; echo rc=$?")
    assert out.startswith("from-tool\nfrom-agent\n") and "rc=0" not in out, out


def test_a_sandbox_without_the_split_is_audited_as_unsplit(p1_client, p1_proxy, upstream):
    sbx = Sandbox.create(p1_client, _spec(p1_proxy, f"p1-unsplit-{SESSION}", None))
    try:
        r = sbx.exec(["python", "-c", LLM_SCRIPT], timeout=60)
        assert r.exit_code == 0, r.stderr[-2000:]
        ev = p1_proxy.wait_audit(lambda e: e.get("sandbox") == sbx.id and e.get("rule") == "llm")
        assert ev["identity_source"] == "docker/unsplit"
    finally:
        sbx.close()


DEEPAGENTS_SHELL = """
import sys
sys.path.insert(0, "/opt/agent")
from run_deepagent import shell_backend
backend = shell_backend("/workspace", 60)
print("BACKEND", type(backend).__name__)
r = backend.execute("id -un; curl -sS --max-time 20 https://upstream.test/page")
print("EXIT", r.exit_code)
print(r.output)
"""


def test_the_deepagents_agent_runs_its_shell_tool_through_the_runner(agent, p1_proxy, upstream):
    r = agent.exec(["python", "-c", DEEPAGENTS_SHELL], timeout=120)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert "BACKEND RunnerShellBackend" in r.stdout and "\ntool\n" in r.stdout, r.stdout
    assert '"identity": "bash-tool"' in r.stdout and '"code": "no_rule"' in r.stdout, r.stdout
    # and the agent's own LLM calls still carry the injected key
    before = len(upstream.seen)
    r = agent.exec(["python", "/opt/agent/run_deepagent.py", "--model", "claude-test",
                    "say hello"], timeout=120)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert "hello from the test upstream" in r.stdout
    calls = [s for s in upstream.seen[before:] if s.path == "/v1/messages"]
    assert calls
    for s in calls:
        assert_secret_equal(s.headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")


def test_cli_sandbox_run_pattern1(p1_proxy, p1_network, split_ports):
    """`sandgate sandbox run --pattern1`: the command is the agent's, `sandgate-tool` the tool's."""
    import subprocess

    from tests.integration.conftest import SANDGATE

    cmd = [*SANDGATE, "sandbox", "run", "--pattern1", "--identity", "coding-agent",
           "--confdir", str(p1_proxy.confdir), "--proxy-url", p1_proxy.url,
           "--proxy-port", str(p1_proxy.port), "--tool-port", str(split_ports.tool_port),
           "--other-port", str(split_ports.other_port), "--",
           "sh", "-c", "id -un; sandgate-tool -- id -un; grep CapBnd /proc/self/status"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["agent", "tool", "CapBnd:\t0000000000000000"], r.stdout
