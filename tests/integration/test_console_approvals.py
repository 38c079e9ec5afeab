"""The console's pending approvals, in a real headless Chromium: a request held by an
`action: ask` rule appears live, an approver approves it (and another is denied) with the
console's forms, a viewer sees it but cannot decide, a POST without the CSRF token is refused.

A real `sandgate run --admin --admin-users` (OpenBao for the injected key), curl through the
proxy held until the decision, Debian's Chromium through Selenium and the system chromedriver.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.integration.conftest import (
    SECRET_VALUES,
    Proxy,
    free_port,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.integration.console_support import (
    ADMIN_TOKEN,
    CONSOLE_IP,
    UP_IP,
    crawl,
    csrf,
    css,
    driver_fixture,  # noqa: F401 (the driver fixture)
    encodings,
    login,
    shot,
    upstream63_fixture,  # noqa: F401 (the upstream63 fixture)
    wait,
)
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

TOKENS = {"alice": "test-console-alice-token-1", "vic": "test-console-viewer-token-2"}
POLICY = f"""
version: v1
secrets:
  anthropic: {{vault: secret/data/llm/anthropic, field: api_key}}
identities:
  agent:
    rules:
      - name: messages
        action: ask
        description: model calls need a human
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {{headers: {{x-api-key: "{{{{ secrets.anthropic }}}}"}}}}
        private_cidrs: [{UP_IP}/32]
        approval: {{timeout: 30, remember: [request, sandbox, identity]}}
"""


@pytest.fixture(scope="module")
def held(tmp_path_factory, vault, upstream63, pki) -> Iterator[tuple[Proxy, str]]:
    tmp = tmp_path_factory.mktemp("console-approvals")
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "ask.yaml").write_text(POLICY)
    users = tmp / "users.yaml"
    users.write_text("users:\n" + "".join(
        f"  {n}: {{role: {'viewer' if n == 'vic' else 'approver'}, token_sha256: "
        f"{hashlib.sha256(t.encode()).hexdigest()}}}\n" for n, t in TOKENS.items()))
    aport = free_port()
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
           "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    p = start_proxy(tmp, pol, env, pki, f"--resolve=api.anthropic.com={UP_IP}", "--admin",
                    f"{CONSOLE_IP}:{aport}", "--admin-users", str(users),
                    listen_host=CONSOLE_IP)
    base = f"http://{CONSOLE_IP}:{aport}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/healthz", timeout=2).ok:
                break
        except requests.RequestException:
            time.sleep(0.1)
    yield p, base
    stop_proxy(p)
    assert_no_secret([p.logs(), p.audit_file.read_text()],
                     [*SECRET_VALUES, ADMIN_TOKEN, *TOKENS.values()], "the proxy's logs or audit")


def _login(driver: Any, base: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/console/login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "login").click()
    wait(driver, lambda d: css(d, "#policy-version"), "the overview after login")


def _hold(p: Proxy, body: str, sandbox: str | None = None, *headers: str
          ) -> subprocess.Popen[str]:
    token = p.token("agent", sandbox=sandbox)
    return subprocess.Popen(
        ["curl", "-sS", "--max-time", "40", "--proxy", p.url, "--proxy-user",
         f"agent:{token}", "--cacert", str(p.ca), "-w", "\n%{http_code}",
         "https://api.anthropic.com/v1/messages", "-d", body,
         *[a for h in headers for a in ("-H", h)]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(c: subprocess.Popen[str]) -> tuple[str, int]:
    out, errs = c.communicate(timeout=60)
    assert c.returncode == 0, errs
    return split_status(out)


def test_a_viewer_sees_a_held_request_but_cannot_decide_it(held, driver):
    p, base = held
    _login(driver, base, TOKENS["vic"])
    assert "viewer" in css(driver, "#who")[0].text
    driver.get(f"{base}/console/approvals")
    wait(driver, lambda d: css(d, "#no-approvals"), "the empty approvals page")
    driver.execute_script("window.consoleMarker = 'same-page'")
    c = _hold(p, '{"n": 1}', None, "x-target-env: <production>",
              "x-note: sandgate-placeholder-anthropic", "x-api-key: sandgate-placeholder-x")
    try:
        section = wait(driver, lambda d: css(d, "section.approval"), "the held request")[0]
        assert driver.execute_script("return window.consoleMarker") == "same-page"  # live
        assert "POST https://api.anthropic.com" in section.text and "agent" in section.text
        assert "messages" in section.text and "model calls need a human" in section.text
        # the headers the approval binds, as text (escaped); placeholders named; the injected
        # header by name only
        assert "x-target-env <production>" in section.text, section.text
        assert "x-note [PLACEHOLDER:anthropic]" in section.text
        assert "x-api-key injected by Sandgate" in section.text
        assert "sandgate-placeholder" not in driver.page_source
        assert not css(driver, "form.decide button")  # a viewer gets no form
        shot(driver, "10-approvals-viewer.png")
        approval = section.get_attribute("id").removeprefix("ap-")
        s = login(base, TOKENS["vic"])
        token = csrf(s.get(f"{base}/console/approvals", timeout=10).text)
        r = s.post(f"{base}/console/approvals/{approval}", timeout=10, allow_redirects=False,
                   data={"csrf": token, "decision": "approve", "scope": "request"})
        assert r.status_code == 403 and "cannot decide" in r.text
        api = requests.get(f"{base}/v1/approvals/{approval}", timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        assert api["state"] == "pending" and api["votes"] == []
    finally:
        # approved as the admin through the API, so the held curl ends
        requests.post(f"{base}/v1/approvals/{approval}", timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                      json={"decision": "deny"})
        assert _finish(c)[1] == 403


def test_an_approver_approves_and_denies_in_the_console(held, driver, upstream63):
    from selenium.webdriver.common.by import By

    p, base = held
    _login(driver, base, TOKENS["alice"])
    c = _hold(p, '{"n": 2}', sandbox="sb-7")
    driver.get(f"{base}/console/approvals")
    section = wait(driver, lambda d: css(d, "section.approval"), "the held request")[0]
    approval = section.get_attribute("id").removeprefix("ap-")
    # a POST without the session's CSRF token is refused, and decides nothing
    s = login(base, TOKENS["alice"])
    r = s.post(f"{base}/console/approvals/{approval}", data={"decision": "approve"},
               timeout=10, allow_redirects=False)
    assert r.status_code == 403 and "CSRF" in r.text
    shot(driver, "11-approvals-approver.png")
    from selenium.webdriver.support.ui import Select

    Select(section.find_element(By.NAME, "scope")).select_by_value("sandbox")
    ttl = section.find_element(By.NAME, "ttl")
    ttl.clear()
    ttl.send_keys("600")
    section.find_element(By.NAME, "note").send_keys("looks fine")
    section.find_element(By.CSS_SELECTOR, "button.approve").click()
    wait(driver, lambda d: css(d, "#state"), "the decided approval")
    # approved, and by now perhaps already used by the held request that went on
    assert css(driver, "#state")[0].text in ("approved", "used")
    votes = css(driver, "#votes tbody tr")[0].text
    assert "alice" in votes and "approve" in votes and "sandbox 600" in votes
    shot(driver, "12-approval-approved.png")
    body, status = _finish(c)
    assert status == 200, body
    assert upstream63.seen[-1].headers["x-api-key"] == SECRET_VALUES[0]
    ev = p.wait_audit(lambda e: e["event"] == "approval" and e.get("action") == "decided")
    assert ev["approver"] == "alice" and ev["decision"] == "approve"

    c = _hold(p, '{"n": 3}')
    driver.get(f"{base}/console/approvals")
    section = wait(driver, lambda d: css(d, "section.approval"), "the next held request")[0]
    section.find_element(By.CSS_SELECTOR, "button.deny").click()
    wait(driver, lambda d: css(d, "#state"), "the denied approval")
    assert css(driver, "#state")[0].text == "denied"
    body, status = _finish(c)
    assert status == 403 and "approval_denied" in body
    driver.get(f"{base}/console/decisions?identity=agent")
    rows = wait(driver, lambda d: css(d, "tbody#rows tr[data-id]"), "the decisions")
    assert any("approval_denied" in r.text for r in rows)
    # no secret on any page, the approvals' and their decisions' included
    pages = crawl(s, base)
    assert any(path.startswith("/console/approvals/ap_") for path in pages), sorted(pages)
    forms = [f for v in [*SECRET_VALUES, ADMIN_TOKEN, *TOKENS.values()] for f in encodings(v)]
    assert_no_secret([r.text for r in pages.values()], forms, "a console page or asset")
