"""The web console of a real `sandgate run --admin`, driven in a real headless Chromium.

Real OpenBao holding real secrets, a real TLS upstream, requests through the proxy with curl
(credentials injected, one echoed back and scrubbed), and Debian's Chromium through Selenium
and the system chromedriver. Shown: the login (cookie flags), a decision appearing live on the
decisions page without a reload, the filter, an explanation (the admin API's /v1/explain for
that request), the reach report and the refusals chart; the security headers on every answer,
no CSP violation in the browser, a POST without the CSRF token (or from another origin)
refused; no secret value in any form on any page or asset. Screenshots go to
test-artifacts/console/ (gitignored).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.integration.conftest import (
    SANDGATE,
    SECRET_VALUES,
    Proxy,
    curl,
    split_status,
    stop_proxy,
)
from tests.integration.console_support import (
    ADMIN_TOKEN,
    ROOT,
    click,
    crawl,
    csrf,
    css,
    driver_fixture,  # noqa: F401 (the driver fixture)
    encodings,
    login,
    rows,
    shot,
    start,
    upstream63_fixture,  # noqa: F401 (the upstream63 fixture)
    wait,
)
from tests.support.secrets import assert_no_secret

pytestmark = pytest.mark.integration

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


@pytest.fixture(scope="module")
def console(tmp_path_factory, vault, upstream63, pki) -> Iterator[tuple[Proxy, str]]:
    tmp = tmp_path_factory.mktemp("console")
    p, base = start(tmp, vault, pki)
    yield p, base
    stop_proxy(p)
    assert_no_secret([p.logs(), p.audit_file.read_text()], [*SECRET_VALUES, ADMIN_TOKEN],
                     "the proxy's logs or audit")


def _csp_violations(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser")
            if "Content Security Policy" in e["message"] or "Refused to" in e["message"]]


def _login(driver: Any, base: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/console/login")
    box = driver.find_element(By.ID, "token")
    box.clear()
    box.send_keys(token)
    driver.find_element(By.ID, "login").click()


def test_login_sets_a_strict_session_cookie(console, driver):
    _p, base = console
    driver.get(f"{base}/console/decisions")
    wait(driver, lambda d: d.current_url.endswith("/console/login"), "the login page")
    shot(driver, "01-login.png")
    _login(driver, base, "not-the-token")
    wait(driver, lambda d: css(d, "#problem"), "the wrong-token message")
    assert "wrong token" in css(driver, "#problem")[0].text
    assert not [c for c in driver.get_cookies() if c["name"] == "sandgate_console"]
    _login(driver, base, ADMIN_TOKEN)
    wait(driver, lambda d: css(d, "#policy-version"), "the overview")
    version = requests.get(f"{base}/v1/policy", timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["version"]
    assert css(driver, "#policy-version")[0].text == version
    assert "admin" in css(driver, "#who")[0].text
    cookie = next(c for c in driver.get_cookies() if c["name"] == "sandgate_console")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/console/" and cookie["secure"] is False  # plain HTTP here
    assert cookie["expiry"] > time.time() + 3600
    shot(driver, "02-overview.png")


def test_a_decision_appears_live_and_is_explained(console, driver, upstream63):
    from selenium.webdriver.common.by import By

    p, base = console
    driver.get(f"{base}/console/decisions")
    wait(driver, lambda d: css(d, "tbody#rows"), "the decisions table")
    driver.execute_script("window.consoleMarker = 'still-the-same-page'")
    r = curl(p, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
    assert upstream63.seen[-1].headers["x-api-key"] == SECRET_VALUES[0]  # really injected
    row = wait(driver, lambda d: [r for r in rows(d) if "/v1/messages" in r["cells"]],
               "the new decision's row")[0]
    assert driver.execute_script("return window.consoleMarker") == "still-the-same-page"
    assert {"allow", "coding-agent", "llm", "POST"} <= set(row["cells"])
    shot(driver, "03-decisions-live.png")
    click(driver, f'tr[data-id="{row["id"]}"] a.explain', "the explain link")
    wait(driver, lambda d: css(d, "#explanation"), "the explanation")
    shown = json.loads(driver.find_element(By.ID, "explain-json").get_attribute("textContent"))
    api = requests.post(f"{base}/v1/explain", timeout=10,
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                        json={"identity": "coding-agent", "method": "POST",
                              "url": "https://api.anthropic.com:443/v1/messages"}).json()
    assert shown == api  # the one decision function, as the admin API answers it
    assert shown["rule"] == "llm" and shown["decision"] == "allow"
    assert "rule_source" in css(driver, "#explanation")[0].text
    shot(driver, "04-explanation.png")


def test_filter_and_refusals_chart(console, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    p, base = console
    for url in ("https://upstream.test/admin/x", "https://upstream.test/admin/y"):
        assert split_status(curl(p, "coding-agent", url).stdout)[1] == 403
    assert split_status(curl(p, "web-fetch", "https://api.anthropic.com/v1/messages",
                             "-d", "{}").stdout)[1] == 403
    assert split_status(curl(p, "web-fetch", "https://upstream.test/docs/ok").stdout)[1] == 200
    driver.get(f"{base}/console/decisions")
    wait(driver, lambda d: len(rows(d)) >= 5, "the decisions")
    shot(driver, "05-decisions.png")  # docs/img/console.png is a copy of this one
    Select(driver.find_element(By.ID, "f-identity")).select_by_visible_text("coding-agent")
    Select(driver.find_element(By.ID, "f-code")).select_by_visible_text("denied_by_rule")
    click(driver, "#apply", "the filter button")
    wait(driver, lambda d: "code=denied_by_rule" in d.current_url, "the filtered page")
    got = wait(driver, rows, "filtered rows")
    assert len(got) == 2
    assert all({"denied_by_rule", "coding-agent"} <= set(r["cells"]) for r in got)
    # the live refresh keeps the filter
    poll = wait(driver, lambda d: d.find_element(By.ID, "rows").get_attribute("hx-get"),
                "the table's poll")
    assert "identity=coding-agent" in poll and "code=denied_by_rule" in poll
    shot(driver, "06-decisions-filtered.png")
    host = driver.find_element(By.ID, "f-host")
    host.clear()
    host.send_keys("upstream.test")
    Select(driver.find_element(By.ID, "f-identity")).select_by_visible_text("web-fetch")
    Select(driver.find_element(By.ID, "f-code")).select_by_visible_text("any")
    click(driver, "#apply", "the filter button")
    wait(driver, lambda d: "host=upstream.test" in d.current_url, "the host filter")
    got = wait(driver, rows, "host-filtered rows")
    # the tunnel's CONNECT and the request inside it: two decisions
    assert sorted(r["cells"][5] for r in got) == ["CONNECT", "GET"]
    assert all({"web-fetch", "upstream.test"} <= set(r["cells"]) for r in got)

    driver.get(f"{base}/console/refusals")
    bars = wait(driver, lambda d: css(d, "svg.chart rect.bar"), "the chart's bars")
    codes = {b.get_attribute("data-code") for b in bars}
    assert {"denied_by_rule", "no_rule"} <= codes
    legend = {li.get_attribute("data-code"): li.text for li in css(driver, "#legend li")}
    assert legend["denied_by_rule"].split()[-1] == "2"
    assert legend["no_rule"].split()[-1] == "1"
    shot(driver, "07-refusals.png")


def test_reach_report(console, driver):
    from selenium.webdriver.common.by import By

    p, base = console
    driver.get(f"{base}/console/reach")
    section = wait(driver, lambda d: css(d, "#reach-coding-agent"), "the reach report")[0]
    text = section.text
    assert "llm" in text and "api.anthropic.com" in text and "no-admin" in text
    # the same report `sandgate report --format json` prints for the directory
    out = subprocess.run([*SANDGATE, "report", "--format", "json",
                          str(p.confdir.parent / "policies")],
                         capture_output=True, text=True, check=True, cwd=str(ROOT))
    rep = json.loads(out.stdout)
    ours = next(i for i in rep["identities"] if i["name"] == "coding-agent")
    rows = section.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == \
        [r["rule"] for r in ours["rules"]]
    shot(driver, "08-reach.png")
    driver.get(f"{base}/console/reach?q=github")
    wait(driver, lambda d: "github" in d.current_url, "the filtered report")
    assert [s.get_attribute("id") for s in css(driver, "section.identity")] == \
        ["reach-coding-agent"]


def test_no_csp_violation_in_the_browser(console, driver):
    _p, base = console
    driver.get_log("browser")  # what came before
    for path in ("/console/", "/console/decisions", "/console/refusals", "/console/reach"):
        driver.get(base + path)
        wait(driver, lambda d: d.execute_script("return document.readyState") == "complete",
              path)
        # htmx loaded (from /console/static/) and polls: not blocked by the policy
        assert driver.execute_script("return typeof htmx") == "object"
    time.sleep(2.5)  # one poll of the decisions table and the chart (every 2 s / 5 s)
    assert _csp_violations(driver) == []


def test_security_headers_on_every_answer(console):
    _p, base = console
    s = login(base)
    pages = crawl(s, base)
    assert len(pages) >= 8, sorted(pages)
    anonymous = requests.get(f"{base}/console/decisions", allow_redirects=False, timeout=10)
    missing = requests.get(f"{base}/console/no-such-page", allow_redirects=False, timeout=10)
    for path, r in [*pages.items(), ("anonymous", anonymous), ("404", missing)]:
        h = r.headers
        assert h["Content-Security-Policy"] == CSP, path
        assert h["X-Content-Type-Options"] == "nosniff", path
        assert h["Referrer-Policy"] == "no-referrer", path
        assert h["Cache-Control"] == "no-store", path
        assert h["X-Frame-Options"] == "DENY", path
        if "text/html" in h.get("Content-Type", ""):
            # nothing inline: no <style>, no style=, no inline <script>, no on*= handlers
            assert not re.search(r"<style|\sstyle=|<script(?![^>]*\ssrc=)|\son[a-z]+=", r.text,
                                 re.I), path
    assert anonymous.status_code == 303 and anonymous.headers["Location"] == "/console/login"
    assert missing.status_code == 303  # not logged in: the login first, even for a 404


def test_state_changes_need_the_csrf_token_and_the_origin(console):
    _p, base = console
    s = login(base)
    page = s.get(f"{base}/console/", timeout=10).text
    token = csrf(page)
    r = s.post(f"{base}/console/logout", data={}, allow_redirects=False, timeout=10)
    assert r.status_code == 403 and "CSRF" in r.text
    r = s.post(f"{base}/console/logout", data={"csrf": token + "x"}, allow_redirects=False,
               timeout=10)
    assert r.status_code == 403
    r = s.post(f"{base}/console/logout", data={"csrf": token}, allow_redirects=False,
               headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 403 and "another site" in r.text
    r = s.post(f"{base}/console/logout", data={"csrf": token}, allow_redirects=False,
               headers={"Sec-Fetch-Site": "cross-site"}, timeout=10)
    assert r.status_code == 403
    assert s.get(f"{base}/console/", allow_redirects=False, timeout=10).status_code == 200
    # the login form too: without its own token, or from another site
    r = requests.post(f"{base}/console/login", data={"token": ADMIN_TOKEN},
                      allow_redirects=False, timeout=10)
    assert r.status_code == 403 and "sandgate_console=" not in r.headers.get("Set-Cookie", "")
    # and with both, logout ends the session for good
    r = s.post(f"{base}/console/logout", data={"csrf": token}, headers={"Origin": base},
               allow_redirects=False, timeout=10)
    assert r.status_code == 303
    assert s.get(f"{base}/console/", allow_redirects=False, timeout=10).status_code == 303


def test_the_bearer_token_alone_does_not_open_the_console(console):
    _p, base = console
    r = requests.get(f"{base}/console/", allow_redirects=False, timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 303  # the console's own session, whatever else comes along
    r = requests.get(f"{base}/v1/policy", timeout=10)
    assert r.status_code == 401  # and the admin API still needs its token


def test_no_secret_on_any_page_or_asset(console, upstream63):
    p, base = console
    # every secret goes out: headers, basic auth and a query parameter; one comes back and
    # is scrubbed; then the decisions of all of them are in the console
    calls = [("https://api.anthropic.com/v1/messages", ("-d", "{}")),
             ("https://api.openai.com/v1/chat/completions", ("-d", "{}")),
             ("https://upstream.test/github/repos?per_page=5", ()),
             ("https://api.anthropic.com/echo-key", ())]
    for url, args in calls:
        r = curl(p, "coding-agent", url, *args)
        assert split_status(r.stdout)[1] == 200, r.stdout + r.stderr
        assert_no_secret([r.stdout], SECRET_VALUES, "a scrubbed answer")
    seen = {h for s in upstream63.seen for h in s.headers.values()} | \
        {s.query for s in upstream63.seen}
    for secret in SECRET_VALUES:  # each one really reached the upstream
        assert any(secret in h for h in seen)
    s = login(base)
    pages = crawl(s, base)
    details = [path for path in pages if re.fullmatch(r"/console/decisions/\d+", path)]
    assert len(details) >= len(calls), sorted(pages)
    assert any(path.startswith("/console/static/") for path in pages)
    texts = [r.text for r in pages.values()]
    forms = [f for secret in SECRET_VALUES for f in encodings(secret)] + encodings(ADMIN_TOKEN)
    assert_no_secret(texts, forms, "a console page or asset")
    assert "REDACTED" in "".join(texts)  # the query value the proxy added is shown redacted


@pytest.fixture(scope="module")
def group(tmp_path_factory, vault, upstream63, pki) -> Iterator[tuple[Proxy, str]]:
    tmp = tmp_path_factory.mktemp("console-workers")
    p, base = start(tmp, vault, pki, "--workers", "2")
    yield p, base
    stop_proxy(p)


def test_workers_one_console_for_every_worker(group):
    """With --workers N the supervisor serves the console: every worker's decisions, merged
    newest first, each explained; refusals added up; the reach report from a worker."""
    p, base = group
    n = 8
    for i in range(n):  # one connection each: SO_REUSEPORT spreads them over the workers
        url = f"https://upstream.test/{'admin' if i % 2 == 0 else 'docs'}/w-{i}"
        assert split_status(curl(p, "coding-agent", url).stdout)[1] in (200, 403)
    deadline = time.monotonic() + 10  # the last audit line may follow the answer
    while len(audited := [e for e in p.audit() if e["event"] == "request"]) < n \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(audited) == n
    s = login(base)
    page = s.get(f"{base}/console/decisions", timeout=10).text
    ids = re.findall(r'<tr class="\w+" data-id="(w\d+-\d+)">', page)
    shown = {i.split("-")[0] for i in ids}
    assert shown == {f"w{e['worker']}" for e in audited}  # from every worker that served
    assert sum(f"/w-{i}<" in page for i in range(n)) == n
    times = re.findall(r'<td class="t">([\d:]+)</td>', page)
    assert times == sorted(times, reverse=True)  # merged newest first
    for event_id in ids[:2]:
        detail = s.get(f"{base}/console/decisions/{event_id}", timeout=10)
        assert detail.status_code == 200 and 'id="explanation"' in detail.text
    chart = s.get(f"{base}/console/refusals", timeout=10).text
    assert re.search(r'data-code="denied_by_rule">.*?<span class="n">4</span>', chart, re.S)
    reach = s.get(f"{base}/console/reach", timeout=10)
    assert reach.status_code == 200 and 'id="reach-coding-agent"' in reach.text
    overview = s.get(f"{base}/console/", timeout=10).text
    assert re.search(r"Workers</div><div class=\"v\">2 / 2", overview)

    # a request held in one worker, decided in the supervisor's console
    held = subprocess.Popen(
        ["curl", "-sS", "--max-time", "30", "--proxy", p.url, "--proxy-user",
         f"asker:{p.token('asker')}", "--cacert", str(p.ca), "-w", "\n%{http_code}",
         "https://upstream.test/ask/deploy"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 15
    while not (ids := re.findall(r'id="ap-(ap_[\w-]+)"',
                                 s.get(f"{base}/console/approvals", timeout=10).text)):
        assert time.monotonic() < deadline, "the held request never showed"
        time.sleep(0.1)
    page = s.get(f"{base}/console/approvals", timeout=10).text
    r = s.post(f"{base}/console/approvals/{ids[0]}", timeout=10, allow_redirects=False,
               data={"csrf": csrf(page), "decision": "approve", "scope": "request"})
    assert r.status_code == 303, r.text[:500]
    out, _ = held.communicate(timeout=30)
    assert split_status(out)[1] == 200
    detail = s.get(f"{base}/console/approvals/{ids[0]}", timeout=10).text
    assert re.search(r'id="state">(approved|used)<', detail) and "<td>admin</td>" in detail
