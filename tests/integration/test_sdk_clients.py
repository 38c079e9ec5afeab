"""The official anthropic and openai SDKs, holding only placeholder keys, through Sandgate."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.conftest import ANTHROPIC_KEY, OPENAI_KEY, SECRET_VALUES
from tests.support.sdk import CLIENT_PY, need_sdk
from tests.support.secrets import assert_no_secret, assert_secret_equal

pytestmark = pytest.mark.integration


ANTHROPIC_SCRIPT = """
import anthropic
client = anthropic.Anthropic()
msg = client.messages.create(model="claude-test", max_tokens=8,
                             messages=[{"role": "user", "content": "hi"}])
print("TEXT:", msg.content[0].text)
"""

OPENAI_SCRIPT = """
import openai
client = openai.OpenAI()
r = client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
print("TEXT:", r.choices[0].message.content)
"""


def _run(proxy, identity: str, script: str, env_extra: dict[str, str]):
    need_sdk("anthropic", "openai")
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and not k.startswith("VAULT")}
    env.update({
        "HTTPS_PROXY": proxy.proxy_url(identity),
        "NO_PROXY": "",
        "SSL_CERT_FILE": str(proxy.ca),
        **env_extra,
    })
    return subprocess.run([str(CLIENT_PY), "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)


def test_anthropic_sdk_with_placeholder_key(proxy, upstream):
    before = len(upstream.seen)
    r = _run(proxy, "coding-agent", ANTHROPIC_SCRIPT,
             {"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TEXT: hello from the test upstream" in r.stdout
    seen = upstream.seen[before:]
    assert [s.path for s in seen] == ["/v1/messages"]
    assert_secret_equal(seen[0].headers.get("x-api-key"), ANTHROPIC_KEY, "upstream x-api-key")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK output")


def test_openai_sdk_with_placeholder_key(proxy, upstream):
    before = len(upstream.seen)
    r = _run(proxy, "coding-agent", OPENAI_SCRIPT,
             {"OPENAI_API_KEY": "sandgate-placeholder-openai"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TEXT: hello from openai test" in r.stdout
    seen = upstream.seen[before:]
    assert_secret_equal(seen[0].headers.get("authorization"), f"Bearer {OPENAI_KEY}",
                        "upstream authorization")
    assert_no_secret([r.stdout, r.stderr], SECRET_VALUES, "the SDK output")


def test_anthropic_sdk_as_bash_tool_is_refused(proxy, upstream):
    before = len(upstream.seen)
    r = _run(proxy, "bash-tool", ANTHROPIC_SCRIPT,
             {"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    assert r.returncode != 0
    assert len(upstream.seen) == before


def test_a_rule_without_llm_only_reads_the_usage(proxy, upstream):
    """On a rule without `llm:` a provider's call is read for the audit's usage, and a body
    Sandgate cannot read as a call (a key given twice, not JSON) is forwarded as before, never
    refused for it (docs/spend.md)."""
    from tests.integration.conftest import curl, split_status

    r = _run(proxy, "coding-agent", ANTHROPIC_SCRIPT,
             {"ANTHROPIC_API_KEY": "sandgate-placeholder-anthropic"})
    assert r.returncode == 0, r.stderr[-2000:]
    ev = proxy.wait_audit(lambda e: e.get("identity") == "coding-agent" and "llm" in e)
    assert ev["llm"]["model"] == "claude-test" and ev["llm"]["usage"]["output_tokens"] == 1
    before = len(upstream.seen)
    for body in ('{"model": "a", "model": "b", "max_tokens": 1}', "not json"):
        out = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages",
                   "-X", "POST", "-H", "content-type: application/json", "--data", body)
        assert split_status(out.stdout)[1] == 200, out.stdout
    assert len(upstream.seen) == before + 2
