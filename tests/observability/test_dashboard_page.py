"""Headless Chromium renders /dashboard from a real gateway in front of the simulated cluster."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import httpx
import pytest

from tests.observability.conftest import ARTIFACTS, require_binaries, require_module
from tests.observability.traffic import generate, mixed_traffic

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
    wait.until(lambda _: text("request-rate") != "–" and shown_rate(text("request-rate")) > 0)

    # The traffic's error fault may have opened a decode breaker: back after its cooldown.
    wait.until(lambda _: (text("usable-prefill"), text("usable-decode")) == ("1 of 1", "2 of 2"))
    assert text("ready") == "ready"
    states = [row.find_elements(By.TAG_NAME, "td")[4].text for row in rows()]
    assert states == ["in rotation"] * 3
    assert text("cache-hit").endswith("%")
    # the 502 and the 429s come late in the traffic: the poll that showed a rate may have
    # been taken before them, so wait for the next ones
    wait.until(lambda _: int(text("error-count").replace(",", "")) >= 1)  # the traffic's 502
    wait.until(lambda _: "429" in text("status-breakdown"))
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
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(observed.gateway + "/dashboard")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.2)
    mixed_traffic(observed)  # streams too: inter-token gaps

    def drawn(plot: str) -> dict:
        """The plot as drawn, read in one script: the page redraws its SVG every poll, and
        elements found one call apart can belong to two drawings (or be gone)."""
        return browser.execute_script("""
            const svg = document.getElementById(arguments[0] + "-plot");
            const dots = {};
            for (const q of ["p50", "p90", "p99"]) {
                dots[q] = [...svg.querySelectorAll(`circle[data-q="${q}"]`)]
                    .map(c => Number(c.getAttribute("cy")));
            }
            return {points: Number(svg.dataset.points), dots: dots,
                    caption: document.getElementById(arguments[0] + "-latest").textContent};
        """, plot)

    def complete(plot: dict) -> bool:
        return plot["points"] >= 1 and all(plot["dots"].values())

    plots: dict[str, dict] = {}

    def ready(_) -> bool:
        for name in ("ttft", "itl"):
            plots[name] = drawn(name)
        return all(complete(plot) for plot in plots.values())

    wait.until(ready)
    for name, plot in plots.items():
        for q, cys in plot["dots"].items():
            assert cys, f"{name}: no {q} drawn"
            assert all(0 <= cy <= 170 for cy in cys), (name, q, cys)
        assert plot["caption"].startswith("p50 ") and "samples" in plot["caption"], plot
    data = httpx.get(observed.gateway + "/dashboard/data", timeout=5).json()["latency"]
    assert sum(p["count"] for p in data["ttft"]) >= 1 and data["window"] == 10
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard-latency.png"))
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe



STREAMERS = 2  # clients, each sending one long stream after the other
WARM_UP = 12.0  # seconds of traffic before the readings: the page's rate window is 10 s
READ_FOR = 14.0


def streams(gateway: str, stop: threading.Event, started: list[float]) -> None:
    """Long streams one after another until `stop`; the time each one was sent."""
    with httpx.Client(base_url=gateway, timeout=60) as client:
        while not stop.is_set():
            started.append(time.monotonic())
            with client.stream("POST", "/generate",
                               json=generate(max_new_tokens=400, stream=True)) as r:
                assert r.status_code == 200
                for _ in r.iter_bytes():
                    pass


def shown_rate(text: str) -> float:
    """The number the request-rate card shows (requests per second)."""
    match = re.match(r"([\d.,]+) req/s$", text) or re.match(r"([\d.,]+)/s$", text)  # or older "X/s"
    assert match, text
    return float(match.group(1).replace(",", ""))


def test_the_request_rate_is_right_while_long_streams_flow(browser, observed):
    """Requests that each last seconds: the rate of answers over one 2 s poll read 0/s
    while traffic flowed. The rate shown is of requests received, over the last 10 s, and
    near the rate the clients sent them at every poll."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    browser.get(observed.gateway + "/dashboard")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.2)
    wait.until(lambda _: browser.find_element(By.ID, "last-update").text != "never")
    stop, started = threading.Event(), []
    senders = [threading.Thread(target=streams, args=(observed.gateway, stop, started))
               for _ in range(STREAMERS)]
    for sender in senders:
        sender.start()
    readings = []
    try:
        time.sleep(WARM_UP)
        begin = time.monotonic()
        last = None
        while time.monotonic() < begin + READ_FOR:
            stamp = browser.find_element(By.ID, "last-update").text
            if stamp != last:  # one reading per poll
                last = stamp
                readings.append((time.monotonic(),
                                 browser.find_element(By.ID, "request-rate").text))
            time.sleep(0.25)
        sent = [t for t in started if begin - 10 <= t <= begin + READ_FOR]
        real = len(sent) / (READ_FOR + 10)
    finally:
        stop.set()
        for sender in senders:
            sender.join(60)
    rates = [shown_rate(text) for _, text in readings]
    print(f"sent {real:.2f} requests/s; shown {readings}")
    assert len(rates) >= 5 and real > 0.2, (real, readings)
    assert min(rates) > 0, readings
    for (at, text), rate in zip(readings, rates, strict=True):
        # the page shows the last 10 s as of its latest poll (every 2 s): between the
        # requests sent in [at - 10, at - 2] and those sent in [at - 12, at]
        least = sum(1 for t in started if at - 10 <= t <= at - 2) / 10
        most = sum(1 for t in started if at - 12 <= t <= at) / 10
        assert least - 0.1 <= rate <= most + 0.1, (text, least, most, readings)


BARE_PAIR = re.compile(r"(?<![\w.])\d[\d,.]*\s*/\s*\d[\d,.]*(?![\w%])")  # "In flight 1 / 4"


def test_every_number_says_what_it_counts(browser, observed):
    """No bare "a / b": each number in the server table carries its unit, and the cards
    say "of" between a count and its bound."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from selenium.webdriver.support.ui import WebDriverWait  # noqa: PLC0415

    httpx.post(observed.gateway + "/generate", json=generate(), timeout=30).raise_for_status()
    browser.get(observed.gateway + "/dashboard")
    wait = WebDriverWait(browser, WAIT, poll_frequency=0.2)
    wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "#servers tbody tr[data-url]"))
    wait.until(lambda _: browser.find_element(By.ID, "request-rate").text != "–")
    page = browser.find_element(By.TAG_NAME, "main").text
    assert not BARE_PAIR.findall(page), BARE_PAIR.findall(page)
    for row in browser.find_elements(By.CSS_SELECTOR, "#servers tbody tr[data-url]"):
        cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        assert re.fullmatch(r"[\d,]+ req · [\d,]+ tok", cells[5]), cells
        assert re.fullmatch(r"\S+ running · \S+ waiting", cells[6]), cells
        for text in cells:
            assert not re.search(r"\d", text) or re.search(r"[A-Za-z%]", text), cells
    assert re.fullmatch(r"\d+ of \d+", browser.find_element(By.ID, "usable-decode").text)
