"""Both patterns end to end in real containers behind the real Sandgate process.

The sandboxes sit on the internal Docker network; Sandgate listens on its gateway and learns who
is calling from the container labels (Docker event stream), optionally confirmed by a token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from sandgate.sandbox import Sandbox
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SECRET_VALUES,
    Proxy,
    start_proxy,
    stop_proxy,
)
from tests.support.secrets import assert_no_secret, assert_secret_equal

ANTHROPIC_SCRIPT = """
import anthropic
client = anthropic.Anthropic(max_retries=0)
msg = client.messages.create(model="claude-test", max_tokens=8,
                             messages=[{"role": "user", "content": "hi"}])
print("TEXT:", msg.content[0].text)
"""


@pytest.fixture(scope="module")
def gw_proxy(tmp_path_factory, vault, upstream, pki, sandbox_network) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("gw"), HERE / "policies",
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}, pki,
                    "--docker-network", sandbox_network.name,
                    listen_host=sandbox_network.gateway)
    yield p
    stop_proxy(p)
    text = p.logs() + p.audit_file.read_text()
    assert_no_secret([text], SECRET_VALUES, "the proxy logs")


@pytest.fixture
def sandbox(docker_client, make_spec, gw_proxy) -> Iterator:
    made: list[Sandbox] = []

    def make(identity: str, image: str = "sandgate-bash-tool:dev", token: str | None = None,
             **kw) -> Sandbox:
        spec = make_spec(identity=identity, image=image, token=token,
                         proxy_url=gw_proxy.url, ca_pem=gw_proxy.ca.read_text(), **kw)
        sbx = Sandbox.create(docker_client, spec)
        made.append(sbx)
        return sbx

    yield make
    for s in made:
        s.close()


def _no_secret_inside(sbx: Sandbox) -> None:
    r = sbx.exec("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                 "grep -rIl -e test-anthropic-REAL -e test-openai-REAL / --exclude-dir=proc "
                 "--exclude-dir=sys 2>/dev/null | head -5", timeout=120)
    blob = r.stdout + r.stderr
    assert_no_secret([blob], SECRET_VALUES, "the sandbox")


def test_pattern1_agent_container_calls_llm_without_holding_the_key(sandbox, gw_proxy, upstream):
    agent = sandbox("coding-agent", image="sandgate-agent:dev",
                    placeholders={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    before = len(upstream.seen)
    r = agent.exec(["python", "-c", ANTHROPIC_SCRIPT], timeout=60)
    assert r.exit_code == 0, r.stderr[-2000:]
    assert "TEXT: hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [s.path for s in seen] == ["/v1/messages"]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the sandbox output")
    ev = gw_proxy.wait_audit(lambda e: e.get("rule") == "llm" and e.get("identity_source")
                             == "docker")
    assert ev["sandbox"] == agent.id
    _no_secret_inside(agent)


def test_pattern2_bash_tool_gets_narrower_rights_than_web_fetch(sandbox, gw_proxy, upstream):
    fetch = sandbox("web-fetch")
    tool = sandbox("bash-tool")
    cmd = "curl -sS --max-time 20 -w '\\n%{http_code}' https://upstream.test/page"
    ok = fetch.exec(cmd, timeout=60)
    assert ok.stdout.strip().endswith("200"), ok.stdout + ok.stderr
    before = len(upstream.seen)
    no = tool.exec(cmd, timeout=60)
    body, _, code = no.stdout.strip().rpartition("\n")
    assert code == "403", no.stdout + no.stderr
    doc = json.loads(body)
    assert doc["identity"] == "bash-tool" and doc["code"] == "no_rule"
    assert len(upstream.seen) == before


def test_token_and_label_that_disagree_are_refused(sandbox, gw_proxy):
    tool = sandbox("bash-tool")
    tok = gw_proxy.token("coding-agent")
    # user and token agree with each other (coding-agent) but not with the container's label
    r = tool.exec(f"curl -sS --max-time 20 -o /dev/null -w '%{{http_code}}' "
                  f"--proxy-user coding-agent:{tok} https://upstream.test/docs/x; echo",
                  timeout=60)
    assert "407" in r.stdout + r.stderr
    ev = gw_proxy.wait_audit(lambda e: "disagrees" in (e.get("reason") or ""))
    assert ev["decision"] == "deny" and ev["code"] == "auth_invalid"


def test_unknown_identity_label_is_refused(sandbox, gw_proxy, upstream):
    ghost = sandbox("no-such-identity")
    before = len(upstream.seen)
    r = ghost.exec("curl -sS --max-time 20 -w '\\n%{http_code}' https://upstream.test/docs/x",
                   timeout=60)
    assert "403" in r.stdout + r.stderr
    assert len(upstream.seen) == before


def test_vault_and_proxy_internals_unreachable_from_sandbox(sandbox, gw_proxy, vault,
                                                           sandbox_network):
    tool = sandbox("bash-tool")
    vault_port = vault.addr.rsplit(":", 1)[1]
    gw = sandbox_network.gateway
    # directly, ignoring the proxy: the gateway's Vault port, the host loopback
    for url in (f"http://{gw}:{vault_port}/v1/sys/health",
                f"http://127.0.0.1:{vault_port}/v1/sys/health"):
        r = tool.exec(f"curl --noproxy '*' -sS --max-time 5 {url}", timeout=30)
        assert r.exit_code != 0, url
    # through the proxy: loopback and the gateway are inside addresses
    for url in (f"http://127.0.0.1:{vault_port}/v1/sys/health",
                f"http://{gw}:{vault_port}/v1/sys/health"):
        r = tool.exec(f"curl -sS --max-time 10 -w '\\n%{{http_code}}' {url}", timeout=30)
        assert r.stdout.strip().endswith("403"), r.stdout + r.stderr
    _no_secret_inside(tool)


def test_pattern1_deepagents_agent_in_container_calls_llm_without_key(sandbox, gw_proxy,
                                                                      upstream):
    agent = sandbox("coding-agent", image="sandgate-agent:dev",
                    placeholders={"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    before = len(upstream.seen)
    r = agent.exec(["python", "/opt/agent/run_deepagent.py", "--model", "claude-test",
                    "say hello"], timeout=120)
    assert r.exit_code == 0, r.stderr[-3000:]
    assert "hello from the test upstream" in r.stdout
    llm_calls = [s for s in upstream.seen[before:] if s.path == "/v1/messages"]
    assert llm_calls
    for s in llm_calls:
        assert_secret_equal(s.headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the sandbox output")
