"""Headless Chromium renders /dashboard from a real gateway in front of the simulated cluster."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.observability.conftest import ARTIFACTS, require_binaries, require_module
from tests.observability.traffic import mixed_traffic

pytestmark = pytest.mark.browser

WINDOW = (1440, 1200)
WAIT = 20.0  # seconds; the page polls every 2 s


@pytest.fixture(scope="module")
def browser():
    paths = require_binaries("chromium", "chromedriver")
    require_module("selenium")
    from selenium import webdriver  # noqa: PLC0415 - optional test dependency
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    options = webdriver.ChromeOptions()
    options.binary_location = paths["chromium"]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-extensions", "--no-first-run", "--hide-scrollbars",
                f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(paths["chromedriver"]), options=options)
    try:
        yield driver
    finally:
        with contextlib.suppress(Exception):
            driver.quit()


def test_dashboard_shows_servers_and_updates(browser, observed):
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(observed.gateway + "/dashboard")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.2)

    def rows():
        return browser.find_elements(By.CSS_SELECTOR, "#servers tbody tr[data-url]")

    wait.until(lambda _: len(rows()) == 3)
    shown = {row.get_attribute("data-url"): row.get_attribute("data-role") for row in rows()}
    expected = {url: "prefill" for url, _ in observed.prefill}
    expected.update({url: "decode" for url in observed.decode})
    assert shown == expected

    def last_update() -> str:
        return browser.find_element(By.ID, "last-update").text

    first = last_update()
    assert first and first != "never"
    wait.until(lambda _: last_update() != first)  # the page keeps polling

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    mixed_traffic(observed)  # figures, a 502 and client errors to show
    # The first poll after the traffic derives a request rate from the new totals.
    wait.until(lambda _: text("request-rate") not in ("–", "0/s"))

    # The traffic's error fault may have opened a decode breaker: back after its cooldown.
    wait.until(lambda _: (text("usable-prefill"), text("usable-decode")) == ("1 / 1", "2 / 2"))
    assert text("ready") == "ready"
    states = [row.find_elements(By.TAG_NAME, "td")[4].text for row in rows()]
    assert states == ["in rotation"] * 3
    assert text("cache-hit").endswith("%")
    assert int(text("error-count").replace(",", "")) >= 1  # the 502 of the traffic
    assert "429" in text("status-breakdown")
    assert not browser.find_element(By.ID, "banner").is_displayed()
    if httpx.get(observed.gateway + "/dashboard/data", timeout=5).json()["recent_errors"]:
        # Once the gateway keeps its recent errors, the traffic's 502 is listed.
        wait.until(lambda _: "502" in browser.find_element(By.ID, "errors").text)

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    browser.save_screenshot(str(shot))
    print(f"dashboard screenshot: {shot}")

    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe


def test_latency_plots_draw_the_traffic(browser, observed):
    """TTFT and inter-token latency percentiles, drawn as SVG from /dashboard/data."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(observed.gateway + "/dashboard")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.2)
    mixed_traffic(observed)  # streams too: inter-token gaps

    def points(plot: str) -> int:
        return int(browser.find_element(By.ID, f"{plot}-plot").get_attribute("data-points"))

    wait.until(lambda _: points("ttft") >= 1 and points("itl") >= 1)
    for plot in ("ttft", "itl"):
        svg = browser.find_element(By.ID, f"{plot}-plot")
        for q in ("p50", "p90", "p99"):
            dots = svg.find_elements(By.CSS_SELECTOR, f'circle[data-q="{q}"]')
            assert dots, f"{plot}: no {q} drawn"
            assert all(0 <= float(d.get_attribute("cy")) <= 170 for d in dots)
        caption = browser.find_element(By.ID, f"{plot}-latest").text
        assert caption.startswith("p50 ") and "samples" in caption, caption
    data = httpx.get(observed.gateway + "/dashboard/data", timeout=5).json()["latency"]
    assert sum(p["count"] for p in data["ttft"]) >= 1 and data["window"] == 10
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard-latency.png"))
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe
