"""GET /dashboard in a real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium).

`make test` installs both packages; without them these tests fail, naming them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import API_KEY, LiveServer, run_own_server
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from skippy_cache.server import ServerSettings
from skippy_cache.server.tenants import hash_key

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("the dashboard tests need Debian's chromium and chromium-driver packages (`make test` "
                    "installs them as root: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1000"):
        options.add_argument(arg)
    # The driver named explicitly: Selenium never downloads one.
    chrome = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    yield chrome
    chrome.quit()


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    yield from run_own_server(ServerSettings(ctx_size=2048, lanes=2, cache_dir=None, fast=True))


def loads(browser: webdriver.Chrome) -> int:
    return int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") or 0)


def wait_for(condition, what: str, timeout: float = 30.0):  # noqa: ANN001, ANN201 - a test helper
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


def test_the_page_draws_the_pool_and_follows_requests(browser: webdriver.Chrome, server: LiveServer) -> None:
    browser.get(f"{server.url}/dashboard")
    wait_for(lambda: loads(browser) >= 1, "its first refresh")
    columns = browser.find_elements(By.CSS_SELECTOR, "#strip > div")
    assert len(columns) == 512
    requests_card = browser.find_element(By.ID, "card-requests").text
    before_loads = loads(browser)

    prompt = " ".join(["the cache keeps the state of every prefix"] * 30)
    client = server.openai()
    for _ in range(2):
        client.completions.create(model="skippy-cache", prompt=prompt, max_tokens=4, temperature=0)

    wait_for(lambda: loads(browser) > before_loads + 1, "a refresh after the requests")
    # The card's detail line (lookups) can change a refresh before its count does: wait for the count.
    count_before = requests_card.splitlines()[1]
    wait_for(lambda: browser.find_element(By.ID, "card-requests").text.splitlines()[1] != count_before,
             "the request count change")

    # The second request reused the first's prompt: its entry holds cells, it tops the list, and
    # the first request's miss is counted. Read from one refresh that succeeded: on a loaded
    # machine a refresh can land between the two requests, or fail and be retried 2 s later.
    def settled() -> bool:
        held = browser.find_elements(By.CSS_SELECTOR, "#strip > div.kind-2, #strip > div.kind-3")
        top = browser.find_elements(By.CSS_SELECTOR, "#top tr")
        return bool(held and top and "the cache keeps the state" in top[0].text
                    and "never_seen" in browser.find_element(By.ID, "misses").text
                    and browser.find_element(By.ID, "error").text == "")

    wait_for(settled, "a cache entry in the pool strip, the top prefix and the miss")


def test_with_an_api_key_the_data_needs_it(browser: webdriver.Chrome) -> None:
    settings = ServerSettings(ctx_size=512, lanes=1, cache_dir=None, api_key=API_KEY, fast=True)
    for server in run_own_server(settings):
        assert httpx.get(f"{server.url}/v1/dashboard", timeout=30).status_code == 401
        browser.get(f"{server.url}/dashboard")
        login = wait_for(lambda: (f := browser.find_element(By.ID, "login")).is_displayed() and f, "the key form")
        login.find_element(By.ID, "key").send_keys(API_KEY)
        login.find_element(By.TAG_NAME, "button").click()
        wait_for(lambda: loads(browser) >= 1, "the data once the key was given")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#strip > div")) == 512


def test_a_user_key_sees_its_own_tenant_and_no_prefix_text(browser: webdriver.Chrome, tmp_path: Path) -> None:
    user, admin = "sk-dash-user", "sk-dash-admin"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{hash_key(user)} alice user\n{hash_key(admin)} ops admin\n")
    settings = ServerSettings(ctx_size=1024, lanes=1, cache_dir=None, api_keys=keys, fast=True)
    for server in run_own_server(settings):
        prompt = " ".join(["a prefix only its tenant may read"] * 20)
        for _ in range(2):
            server.openai(api_key=user).completions.create(model="skippy-cache", prompt=prompt, max_tokens=2,
                                                           temperature=0)

        def log_in(key: str) -> None:
            browser.get(f"{server.url}/dashboard")
            browser.execute_script("sessionStorage.clear()")
            browser.get(f"{server.url}/dashboard")
            login = wait_for(lambda: (f := browser.find_element(By.ID, "login")).is_displayed() and f, "the key form")
            login.find_element(By.ID, "key").send_keys(key)
            login.find_element(By.TAG_NAME, "button").click()
            wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#top tr"), "the top prefixes")

        log_in(user)
        row = browser.find_element(By.CSS_SELECTOR, "#top tr").text
        assert "alice" in row and "(hidden)" in row and "only its tenant" not in row
        assert "your entries" in browser.find_element(By.ID, "cards").text
        log_in(admin)
        wait_for(lambda: "a prefix only its tenant may read" in browser.find_element(By.CSS_SELECTOR, "#top tr").text,
                 "the prefix text for an admin")
