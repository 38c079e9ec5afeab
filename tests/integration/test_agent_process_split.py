"""Pattern 1 without a hook in the agent: the real Sandgate process with --agent-dir, an agent
started by `sandgate agent run`, OpenBao and the TLS upstream standing in for the LLM API.

The agent (a Python program, so the test says exactly what it does) calls the LLM API from its
own process and from a thread (its identity, the key injected), then lets the processes it starts
try every way to the same API: the agent's token copied into their proxy URL, no token, a
grandchild through two shells, the agent's own binary re-executed, a proxy set by hand, and a
socket the agent leaked to a child without CLOEXEC. Each gets the tool identity (403) or is
refused (407), and the audit names the identity of each call.

The test's network namespace has only loopback (the kernel part for host-run agents: nothing
but the proxy is reachable; docs/pattern1.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SANDGATE,
    SECRET_VALUES,
    Proxy,
    start_proxy,
    stop_proxy,
)
from tests.support.secrets import assert_no_secret, assert_secret_equal

API = "https://api.anthropic.com/v1/messages"

AGENT = r'''
import json, os, socket, subprocess, sys, threading
from urllib import error, request

proxy, ca, api = os.environ["HTTPS_PROXY"], os.environ["SSL_CERT_FILE"], sys.argv[1]
out = {}

def post(url):  # urllib: HTTPS_PROXY with the token, the CA from SSL_CERT_FILE
    try:
        return request.urlopen(request.Request(url, data=b"{}"), timeout=20).status
    except error.HTTPError as e:
        return e.code
    except OSError as e:  # a refused CONNECT: "Tunnel connection failed: 407 ..."
        words = str(e).split("failed: ", 1)[-1].split()
        return int(words[0]) if words and words[0].isdigit() else 0

def call(name):
    out[name] = post(api)

if sys.argv[2:] == ["--once"]:  # re-executed by itself: one call, as the agent makes it
    print(post(api))
    sys.exit(0)
call("agent")
t = threading.Thread(target=call, args=("agent_thread",))
t.start(); t.join()

def curl(*args, env=None):
    r = subprocess.run(["curl", "-sS", "--max-time", "15", "--cacert", ca, "-o", "/dev/null",
                        "-w", "%{http_code} %{http_connect}", *args, "-d", "{}", api],
                       capture_output=True, text=True, env=env)
    return code(r.stdout)

def code(written):  # the response's status, else the refused CONNECT's
    return max(int(c) for c in (written.split() or ["0"]))

out["child_agent_token"] = curl()                         # HTTPS_PROXY has the agent's token
bare = proxy.split("@", 1)[1]
out["child_no_token"] = curl("--proxy", "http://" + bare)  # a proxy set by hand, no token
out["child_unset_proxy"] = curl("--noproxy", "*")          # no proxy: no route but the proxy
out["grandchild"] = code(subprocess.run(
    ["sh", "-c", "sh -c 'curl -sS --max-time 15 --cacert \"$SSL_CERT_FILE\" -o /dev/null "
     "-w \"%{http_code} %{http_connect}\" -d {} " + api + "'"], capture_output=True,
    text=True).stdout)
# the agent's own binary and code, re-executed: a new pid
out["reexec"] = json.loads(subprocess.run(
    [sys.executable, sys.argv[0], api, "--once"], capture_output=True, text=True).stdout or "0")

# a connection the agent opened, leaked to a child (inheritable: no CLOEXEC); the child speaks
# on it while the agent still holds it
host, port = bare.rsplit(":", 1)
s = socket.create_connection((host, int(port)))
s.set_inheritable(True)
user, tok = proxy.split("//", 1)[1].split("@", 1)[0].split(":", 1)
import base64
auth = base64.b64encode(f"{user}:{tok}".encode()).decode()
leak = subprocess.run(
    [sys.executable, "-c", "import socket, sys; s = socket.socket(fileno=int(sys.argv[1])); "
     "s.sendall(sys.argv[2].encode()); print(s.recv(200).split(b' ')[1].decode())",
     str(s.fileno()), f"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443"
     f"\r\nProxy-Authorization: Basic {auth}\r\n\r\n"],
    capture_output=True, text=True, close_fds=False)
out["leaked_fd_connect"] = int(leak.stdout.strip() or 0)
s.close()
print(json.dumps(out))
'''


AS_USER = r'''
import json, os, subprocess, sys
from urllib import error, request

api, agents = sys.argv[1], sys.argv[2]
out = {"uid": os.getuid()}
try:
    out["agent"] = request.urlopen(request.Request(api, data=b"{}"), timeout=20).status
except error.HTTPError as e:
    out["agent"] = e.code
# a process the agent started writes a registration for itself: the directory is root's
reg = subprocess.run([sys.executable, "-c", "import os, sys; open(os.path.join(sys.argv[1], "
                      "str(os.getpid()) + '.json'), 'w')", agents], capture_output=True, text=True)
out["tool_registers"] = "PermissionError" in reg.stderr
bare = os.environ["HTTPS_PROXY"].split("@", 1)[1]
r = subprocess.run(["curl", "-sS", "--max-time", "15", "--cacert", os.environ["SSL_CERT_FILE"],
                    "--proxy", "http://" + bare, "-o", "/dev/null", "-w", "%{http_code}",
                    "-d", "{}", api], capture_output=True, text=True)
out["child_no_token"] = int(r.stdout or 0)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def agent_proxy(tmp_path_factory, vault, upstream, pki) -> Iterator[tuple[Proxy, Path]]:
    tmp = tmp_path_factory.mktemp("agentsplit")
    agents = tmp / "agents"
    agents.mkdir()
    os.chmod(agents, 0o755)
    p = start_proxy(tmp, HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    f"--agent-dir={agents}", "--agent-split=coding-agent=bash-tool")
    yield p, agents
    stop_proxy(p)
    assert_no_secret([p.logs() + p.audit_file.read_text()], SECRET_VALUES, "the proxy logs")


def run_agent(proxy: Proxy, agents: Path, tmp: Path,
              *extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "agent.py"
    script.write_text(AGENT)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(HTTPS_PROXY=proxy.proxy_url("coding-agent"), SSL_CERT_FILE=str(proxy.ca))
    return subprocess.run(
        [*SANDGATE, "agent", "run", "--identity", "coding-agent", "--tool-identity",
         "bash-tool", "--agent-dir", str(agents), *extra, "--", sys.executable, str(script),
         API], capture_output=True, text=True, env=env, timeout=120)


def test_only_the_agents_own_process_is_the_agent(agent_proxy, upstream, tmp_path) -> None:
    proxy, agents = agent_proxy
    before = len(upstream.seen)
    r = run_agent(proxy, agents, tmp_path, "--allow-ptrace", "--allow-same-user",
                  "--sandbox", "hostrun-1")
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert got == {
        "agent": 200, "agent_thread": 200,  # the agent's process, any of its threads
        "child_agent_token": 407,  # the agent's token from a child: the owner decides
        "child_no_token": 403,  # the tool identity: no rule for the LLM API
        "child_unset_proxy": 0,  # no route: only the proxy is reachable
        # with the agent's token they inherited: refused, not downgraded (docs/pattern1.md)
        "grandchild": 407,
        "reexec": 407,  # the agent's binary and code again: a new pid, not the agent
        # the agent still holds the leaked socket at CONNECT: the agent's (docs/pattern1.md:
        # CLOEXEC, which every runtime the agents use sets, is what keeps its sockets its own)
        "leaked_fd_connect": 200,
    }, r.stderr
    seen = upstream.seen[before:]
    assert [s.path for s in seen] == ["/v1/messages", "/v1/messages"]  # the agent's two calls
    for s in seen:
        assert_secret_equal(s.headers.get("x-api-key"), ANTHROPIC_KEY, "the injected key")
    events = [e for e in proxy.audit() if e.get("sandbox") == "hostrun-1"]
    by = {(e["identity"], e["identity_source"], e["decision"], e.get("code")) for e in events}
    assert ("coding-agent", "process/agent", "allow", None) in by, events
    assert ("bash-tool", "process/tool", "deny", "no_rule") in by, events
    refused = [e for e in proxy.audit() if "disagrees with the process" in (e.get("reason") or "")]
    assert refused and all(e["code"] == "auth_invalid" for e in refused)
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the agent's output")


def test_without_a_live_agent_its_identity_is_refused(agent_proxy, upstream) -> None:
    """The agent has exited (or was never registered): its token gets nothing, from anyone."""
    proxy, _ = agent_proxy
    before = len(upstream.seen)
    r = subprocess.run(["curl", "-sS", "--max-time", "15", "--cacert", str(proxy.ca),
                        "--proxy", proxy.proxy_url("coding-agent"), "-w",
                        "\n%{http_connect}",
                        "-d", "{}", API], capture_output=True, text=True, timeout=30)
    _, _, code = r.stdout.rpartition("\n")
    assert code == "407", r.stdout + r.stderr
    ev = proxy.wait_audit(lambda e: "only to its registered agent" in (e.get("reason") or ""))
    assert ev["code"] == "auth_invalid" and ev["identity"] in (None, "coding-agent"), ev
    assert len(upstream.seen) == before
    # other identities are identified by their tokens as before
    ok = subprocess.run(["curl", "-sS", "--max-time", "15", "--cacert", str(proxy.ca),
                         "--proxy", proxy.proxy_url("bash-tool"), "-o", "/dev/null", "-w",
                         "%{http_code}", "https://upstream.test/docs/x"],
                        capture_output=True, text=True, timeout=30)
    assert ok.stdout == "200", ok.stderr


def test_the_launcher_refuses_where_the_split_would_not_hold(agent_proxy, tmp_path) -> None:
    proxy, agents = agent_proxy
    before = sorted(p.name for p in agents.iterdir())
    r = run_agent(proxy, agents, tmp_path, "--allow-ptrace")  # root may write the directory
    assert r.returncode == 2 and "--allow-same-user" in r.stderr, r.stderr
    assert "agent" not in r.stdout  # the agent never ran...
    assert sorted(p.name for p in agents.iterdir()) == before  # ...nor was registered
    if not Path("/proc/sys/kernel/yama/ptrace_scope").exists():
        r = run_agent(proxy, agents, tmp_path, "--allow-same-user")
        assert r.returncode == 2 and "ptrace_scope is absent" in r.stderr, r.stderr


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs a system Python that "
                    "another user may run")
def test_the_agent_as_another_user_and_its_tool_cannot_register_itself(agent_proxy,
                                                                        upstream) -> None:
    """`--user`: the launcher registers as root, then the agent runs as `nobody`, a user that
    cannot write the agent directory, so no process it starts can register itself."""
    proxy, agents = agent_proxy
    with tempfile.TemporaryDirectory(prefix="sgau-") as d:
        os.chmod(d, 0o755)
        script, ca = Path(d) / "agent.py", Path(d) / "ca.pem"
        script.write_text(AS_USER)
        ca.write_bytes(proxy.ca.read_bytes())
        os.chmod(script, 0o644)
        os.chmod(ca, 0o644)
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env.update(HTTPS_PROXY=proxy.proxy_url("coding-agent"), SSL_CERT_FILE=str(ca))
        before = len(upstream.seen)
        r = subprocess.run(
            [*SANDGATE, "agent", "run", "--identity", "coding-agent", "--tool-identity",
             "bash-tool", "--agent-dir", str(agents), "--user", "nobody", "--allow-ptrace",
             "--", "/usr/bin/python3", str(script), API, str(agents)],
            capture_output=True, text=True, env=env, timeout=120, cwd=d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout) == {"uid": 65534, "agent": 200, "tool_registers": True,
                                    "child_no_token": 403}
    assert [s.path for s in upstream.seen[before:]] == ["/v1/messages"]
    assert_secret_equal(upstream.seen[before].headers.get("x-api-key"), ANTHROPIC_KEY, "key")
