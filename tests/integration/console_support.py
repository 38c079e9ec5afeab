"""Helpers for the web console tests: a real `sandgate run --admin`, a real headless Chromium
(Debian's, driven by Selenium through the system chromedriver: nothing is downloaded), a
logged-in `requests` session, and every encoded form a secret could take on a page."""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import pytest
import requests

from tests.integration.conftest import HERE, UPSTREAM_IP, Proxy, free_port, start_proxy
from tests.support.upstream import UpstreamServer

ROOT = HERE.parent.parent
ADMIN_TOKEN = "test-console-admin-token-63a1"
CONSOLE_IP = "127.0.63.1"  # the proxy and its admin listener
UP_IP = "127.0.63.2"  # the TLS upstream of these tests
NAMES = ("api.anthropic.com", "api.openai.com", "upstream.test", "a.upstream.test",
         "tunnel.test")
ARTIFACTS = ROOT / "test-artifacts" / "console"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


# an identity whose requests under /ask/ wait for a person (the approvals page)
ASK_POLICY = f"""version: v1
identities:
  asker:
    rules:
      - name: ask-first
        action: ask
        hosts: [upstream.test]
        paths: [/ask/**]
        private_cidrs: [{UP_IP}/32]
        approval: {{timeout: 30}}
"""


def policies(tmp: Path) -> Path:
    d = tmp / "policies"
    d.mkdir()
    text = (HERE / "policies" / "test.yaml").read_text().replace(UPSTREAM_IP, UP_IP)
    (d / "test.yaml").write_text(text)
    (d / "ask.yaml").write_text(ASK_POLICY)
    return d


def start(tmp: Path, vault: Any, pki: Any, *extra: str) -> tuple[Proxy, str]:
    """The proxy on CONSOLE_IP with its admin listener (and so the console) beside it."""
    aport = free_port()
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
           "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    resolve = [f"--resolve={n}={UP_IP}" for n in NAMES]
    p = start_proxy(tmp, policies(tmp), env, pki, *resolve, "--admin",
                    f"{CONSOLE_IP}:{aport}", *extra, listen_host=CONSOLE_IP)
    base = f"http://{CONSOLE_IP}:{aport}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/readyz", timeout=2,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).ok:
                return p, base
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the admin listener did not get ready:\n{p.logs()[-3000:]}")


def login(base: str, token: str = ADMIN_TOKEN) -> requests.Session:
    """A `requests` session logged in through the login form, as a browser does it."""
    s = requests.Session()
    r = s.get(f"{base}/console/login", timeout=10)
    mac = re.search(r'name="login" value="([^"]+)"', r.text)
    assert mac, r.text
    r = s.post(f"{base}/console/login", data={"login": mac.group(1), "token": token},
               headers={"Origin": base}, allow_redirects=False, timeout=10)
    assert r.status_code == 303, (r.status_code, r.text[:500])
    return s


def csrf(page: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, page[:500]
    return m.group(1)


def crawl(s: requests.Session, base: str, limit: int = 300) -> dict[str, requests.Response]:
    """Every console page and asset reachable from the overview (links, scripts, styles,
    htmx polling targets), each fetched once."""
    seen: dict[str, requests.Response] = {}
    todo = ["/console/", "/console/login"]
    while todo and len(seen) < limit:
        path = todo.pop()
        if path in seen:
            continue
        r = s.get(base + path, timeout=30, allow_redirects=False)
        seen[path] = r
        if "text/html" not in r.headers.get("Content-Type", ""):
            continue
        for ref in re.findall(r'(?:href|src|hx-get)="([^"#]+)"', r.text):
            url = urlsplit(urljoin(base + path, ref.replace("&amp;", "&")))
            target = url.path + (f"?{url.query}" if url.query else "")
            if url.netloc == urlsplit(base).netloc and url.path.startswith("/console") \
                    and target not in seen:
                todo.append(target)
    return seen


def encodings(secret: str) -> list[str]:
    """The forms of a secret a client could undo: raw, base64 (standard and URL-safe, with and
    without padding), URL-encoded, hex (both cases)."""
    raw = secret.encode()
    b64 = base64.b64encode(raw).decode()
    b64u = base64.urlsafe_b64encode(raw).decode()
    forms = {secret, b64, b64.rstrip("="), b64u, b64u.rstrip("="), quote(secret, safe=""),
             quote(secret), raw.hex(), raw.hex().upper()}
    return sorted(forms)


def artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, through the system chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.add_argument("--headless=new")
    opts.add_argument("--window-size=1400,1000")
    opts.add_argument("--disable-gpu")
    opts.add_argument("--disable-dev-shm-usage")
    if os.geteuid() == 0:
        # Chromium will not start its sandbox as root (CI runs the suite as root): the pages
        # it loads are the console's own, from loopback
        opts.add_argument("--no-sandbox")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module", name="upstream63")
def upstream63_fixture(pki: Any) -> Iterator[UpstreamServer]:
    """The TLS upstream of a console test module (imported by each)."""
    server = UpstreamServer(UP_IP, 443, str(pki.cert), str(pki.key)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module", name="driver")
def driver_fixture() -> Iterator[Any]:
    """One headless Chromium per console test module (imported by each)."""
    yield from browser()


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def shot(driver: Any, name: str) -> Path:
    path = artifact(name)
    driver.save_screenshot(str(path))
    print(f"console screenshot: {path}")
    return path


def wait(driver: Any, pred: Any, what: str, timeout: float = 20) -> Any:
    """WebDriverWait with a screenshot of the page when it times out. An element that htmx
    swapped out while the predicate looked at it is looked for again."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=(StaleElementReferenceException,)).until(pred)
    except TimeoutException:
        path = shot(driver, f"timeout-{int(time.time())}.png")
        raise AssertionError(f"timed out waiting for {what} (screenshot: {path})") from None


# the live table is replaced every 2 s: its cells are read in one script, never element by element
_ROWS_JS = """return [...document.querySelectorAll('tbody#rows tr[data-id]')].map(tr =>
    ({id: tr.dataset.id, cells: [...tr.cells].map(td => td.textContent.trim())}));"""


def rows(driver: Any) -> list[dict[str, Any]]:
    """The decisions table as it is now: each row's id and cell texts."""
    return list(driver.execute_script(_ROWS_JS))


def click(driver: Any, selector: str, what: str) -> None:
    """Click what `selector` finds, again if htmx replaced it in between."""
    from selenium.webdriver.common.by import By

    def go(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, selector).click()
        return True
    wait(driver, go, what)
