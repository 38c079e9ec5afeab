"""The console's Spend page in a real browser (headless Chromium, as tests/integration/
test_console.py): a `--workers 2` group sharing one Redis (`--state`), LLM calls through it to
a stand-in Anthropic API that answers with real usage (tests/support/llmapis.py), and the page
showing the one fleet window of the budget, its limit, what it counted and the spend per
model, as the workers' shared state holds it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
import requests

from tests.integration.conftest import Proxy, curl, free_port, split_status, start_proxy, stop_proxy
from tests.integration.console_support import (
    ADMIN_TOKEN,
    css,
    driver_fixture,  # noqa: F401 (the driver fixture)
    login,
    shot,
    wait,
)
from tests.support.llmapis import INPUT, OUTPUT, LlmServer
from tests.support.pki import make_pki

pytestmark = pytest.mark.integration

LLM_IP = "127.0.64.39"
REDIS_IP = "127.0.64.40"
CONSOLE_IP = "127.0.64.1"
NAME = "anthropic.llm.test"
LIMIT = 1000

POLICY = f"""version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
budgets:
  team-day: {{output_tokens: {LIMIT}, cost_usd: 5, per: 1h}}
prices:
  - {{model: "claude-sonnet-*", input: 3, output: 15}}
identities:
  spender:
    rules:
      - name: anthropic
        hosts: [{NAME}]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{LLM_IP}/32]
        llm: {{api: anthropic, models: ["claude-sonnet-*"], max_tokens: 64,
               budget: team-day}}
"""


@pytest.fixture(scope="module")
def group(tmp_path_factory, vault) -> Iterator[tuple[Proxy, str]]:
    from tests.support.redis import RedisServer

    tmp = tmp_path_factory.mktemp("consolespend")
    pki = make_pki(tmp / "pki", [NAME])
    server = LlmServer(LLM_IP, 443, str(pki.cert), str(pki.key)).start()
    redis = RedisServer(tmp / "redis", REDIS_IP, 6379).start()
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "spend.yaml").write_text(POLICY)
    aport = free_port()
    p = start_proxy(tmp, policies, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                                    "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}, pki,
                    f"--resolve={NAME}={LLM_IP}", "--admin", f"{CONSOLE_IP}:{aport}",
                    "--workers", "2", "--state", redis.url, "--state-prefix", "consolespend:",
                    "--no-watch", listen_host=CONSOLE_IP)
    base = f"http://{CONSOLE_IP}:{aport}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/readyz", timeout=2,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(0.2)
    try:
        yield p, base
    finally:
        stop_proxy(p)
        redis.stop()
        server.stop()


def call(p: Proxy, model: str) -> tuple[str, int]:
    body = json.dumps({"model": model, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "hi"}]})
    r = curl(p, "spender", f"https://{NAME}/v1/messages", "-H",
             "content-type: application/json", "-H", "anthropic-version: 2023-06-01",
             "-d", body)
    return split_status(r.stdout)


def test_spend_page_shows_the_fleet_window_once_with_its_spend_per_model(group, driver):
    from selenium.webdriver.common.by import By

    p, base = group
    # several calls: over two workers' connections, counted in the one Redis window
    for _ in range(4):
        body, status = call(p, "claude-sonnet-4-5")
        assert status == 200, body
    assert call(p, "claude-opus-4-1")[1] == 403  # refused: counts nothing
    driver.get(f"{base}/console/login")
    driver.find_element(By.ID, "token").send_keys(ADMIN_TOKEN)
    driver.find_element(By.ID, "login").click()
    wait(driver, lambda d: css(d, "#policy-version"), "the overview")
    driver.get(f"{base}/console/spend")
    sections = wait(driver, lambda d: css(d, "section.spend-window"), "the budget window")
    assert len(sections) == 1  # the fleet's window, once (both workers read it)
    text = sections[0].text
    shot(driver, "spend-01.png")
    assert "team-day: identity spender" in text and "counted by fleet" in text
    # settled spend: 4 calls of OUTPUT output tokens each, none in flight
    assert re.search(rf"output tokens {LIMIT} {4 * OUTPUT} 0 ", text), text
    assert re.search(rf"claude-sonnet-\* {4 * INPUT} {4 * OUTPUT} ", text), text
    assert "claude-opus" not in text
    # no CSP violation on the page
    assert not [e for e in driver.get_log("browser") if "Content Security Policy" in
                e["message"]]
    # the same through a plain session (the page as the server renders it)
    page = login(base).get(f"{base}/console/spend", timeout=10).text
    assert page.count('class="identity spend-window"') == 1


def test_spend_page_escapes_what_a_sandbox_chose(group, driver):
    """The window's `who` is the identity; model names are the policy's globs: nothing a
    sandbox sent reaches the page unescaped (a model it named is refused, never shown)."""
    p, base = group
    assert call(p, "claude-sonnet-<script>alert(1)</script>")[1] == 200
    page = login(base).get(f"{base}/console/spend", timeout=10).text
    assert "<script>alert" not in page and "alert(1)" not in page

