"""The dashboard in a real headless browser (Debian's ``chromium`` and ``chromium-driver``
through selenium), against a server on a free 127.0.0.1 port that ran a scripted
workload on the generated tiny model: the page loads with no console error, its
figures are those of ``/v1/kvtier/stats``, each request's strip has as many cells of
each source as its usage said, and the actions ask first and then work."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from .dashboard_server import WORKLOAD, served  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # starts a server and a browser

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no headless browser here: install Debian's chromium and chromium-driver (.ci/run does, as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,2000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _settled_stats(http: httpx.Client) -> dict:
    """``/v1/kvtier/stats`` once two reads a quarter second apart agree (L3's writer
    thread may still be committing), without the rate that moves with the clock."""
    previous = None
    for _ in range(80):
        stats = http.get("/v1/kvtier/stats").json()
        stats.pop("windowed", None)
        if stats == previous:
            return stats
        previous = stats
        time.sleep(0.25)
    raise AssertionError("the server's stats never settled")


def _fresh_page(driver, url: str) -> None:
    """Load the page and wait for a poll that started after now."""
    driver.get(url + "/dashboard")
    since = time.time() * 1000
    WebDriverWait(driver, 30).until(lambda d: float(_attribute(d, "#status", "data-updated") or 0) > since)


def _wait_poll(driver) -> None:
    since = time.time() * 1000
    WebDriverWait(driver, 30).until(lambda d: float(_attribute(d, "#status", "data-updated") or 0) > since)


def _attribute(driver, css: str, name: str) -> str | None:
    """One attribute of the element ``css`` names, read in one script: the page redraws
    its tables at each poll, so an element found in one call may be gone by the next."""
    return driver.execute_script("return document.querySelector(arguments[0])?.getAttribute(arguments[1])", css, name)


def _value(driver, css: str) -> str:
    return _attribute(driver, css, "data-value")


def test_the_page_shows_the_stats_without_console_errors(served, browser, tmp_path):
    stats = _settled_stats(served.http)
    _fresh_page(browser, served.url)
    for tier, row in stats["tiers"].items():
        for field in ("bytes_used", "pages", "hit_pages", "evictions"):
            column = {"bytes_used": 2, "pages": 3, "hit_pages": 4, "evictions": 5}[field]
            shown = _value(browser, f'#tiers tr[data-tier="{tier}"] > :nth-child({column})')
            assert int(shown) == row[field], (tier, field)
    engine = stats["engine"]
    assert int(_value(browser, "#served")) == engine["requests"] == len(WORKLOAD)
    assert int(_value(browser, "#prompt-tokens")) == engine["prompt_tokens"]
    restored = sum(engine["sources"][s] for s in ("L1", "L2", "L3"))
    assert float(_value(browser, "#reuse")) == pytest.approx(restored / engine["prompt_tokens"])
    for link, row in stats["links"].items():
        assert int(_value(browser, f'#links tr[data-link="{link}"] > :nth-child(2)')) == row["bytes"], link
    assert int(_value(browser, "#waiting")) == stats["server"]["waiting"]
    browser.save_screenshot(str(tmp_path / "dashboard.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def test_each_strip_has_the_cells_its_usage_said(served, browser):
    _fresh_page(browser, served.url)
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
    assert len(rows) == len(WORKLOAD)
    rids = sorted(int(r.get_attribute("data-rid")) for r in rows)  # submitted one after another: in order
    seen = set()
    for rid, usage in zip(rids, served.usages):
        counts = browser.execute_script(
            "const c = {}; for (const s of document.querySelectorAll(`.strip[data-rid='${arguments[0]}'] > span`))"
            " c[s.dataset.source] = (c[s.dataset.source] || 0) + 1; return c;",
            rid,
        )
        sources = usage["prompt_tokens_details"]["sources"]
        assert counts == {s: n for s, n in sources.items() if n}, rid
        seen |= set(counts)
    assert seen == {"L1", "L2", "L3", "recomputed"}  # the workload reaches every source


def test_hovering_a_strip_shows_its_tokens_text(served, browser):
    from selenium.webdriver import ActionChains

    _fresh_page(browser, served.url)
    strip = browser.find_element(By.CSS_SELECTOR, "#requests tbody tr:last-child .strip")  # the first request
    ActionChains(browser).move_to_element(strip).perform()
    first = strip.find_element(By.CSS_SELECTOR, "span:first-child")
    WebDriverWait(browser, 10).until(lambda d: ":" in (first.get_attribute("title") or ""))
    assert first.get_attribute("title") == f'recomputed: "{WORKLOAD[0][0]}"'


def _confirm(browser, accept: bool) -> None:
    alert = WebDriverWait(browser, 10).until(lambda d: d.switch_to.alert)
    alert.accept() if accept else alert.dismiss()


def _feed(served) -> dict:
    return served.http.get("/v1/kvtier/dashboard").json()


def test_pin_asks_first_then_pins_and_unpins(served, browser):
    _fresh_page(browser, served.url)
    button = browser.find_element(By.CSS_SELECTOR, "#requests tbody tr:first-child button")
    rid = int(browser.find_element(By.CSS_SELECTOR, "#requests tbody tr:first-child").get_attribute("data-rid"))
    button.click()
    _confirm(browser, accept=False)
    assert _feed(served)["pins"] == []
    button.click()
    _confirm(browser, accept=True)
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "action-status").get_attribute("data-ok"))
    assert [p["rid"] for p in _feed(served)["pins"]] == [rid]
    _wait_poll(browser)
    browser.find_element(By.CSS_SELECTOR, "#requests tbody tr:first-child button").click()
    _confirm(browser, accept=True)
    WebDriverWait(browser, 10).until(lambda d: not _feed(served)["pins"])


def test_resize_and_clear_ask_first_then_act(served, browser):
    WebDriverWait(browser, 30).until(lambda d: _feed(served)["namespaces"])  # L3's writer has committed
    _fresh_page(browser, served.url)
    box = browser.find_element(By.ID, "resize-mib")
    box.send_keys("64")
    browser.find_element(By.CSS_SELECTOR, "#resize button").click()
    _confirm(browser, accept=True)
    WebDriverWait(browser, 10).until(lambda d: _feed(served)["stats"]["tiers"]["L3"]["capacity"] == 64 << 20)

    _wait_poll(browser)
    pages = _feed(served)["namespaces"][0]["pages"]
    browser.find_element(By.CSS_SELECTOR, "#namespaces tbody tr:first-child button").click()
    _confirm(browser, accept=False)
    assert _feed(served)["namespaces"][0]["pages"] == pages
    browser.find_element(By.CSS_SELECTOR, "#namespaces tbody tr:first-child button").click()
    _confirm(browser, accept=True)
    WebDriverWait(browser, 10).until(lambda d: _feed(served)["namespaces"] == [])
    assert "clear:" in browser.find_element(By.ID, "action-status").text
