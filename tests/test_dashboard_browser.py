"""`pgque dashboard` in a real browser: headless Chromium from Debian's packages,
driven by Selenium through Debian's chromedriver (`make system-deps` installs
both; without them these tests skip, saying so). In the recommended
deployment, as tests/test_dashboard.py.

With PGQUE_SCREENSHOTS=<folder> (`make screenshots`), the main pages are
saved there as PNG files (the README shows them)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for

import pgque
from pgque.dashboard import DashboardServer
from pgque.testing import Deployment

QUEUE = "orders"
GROUP = "charge"
SLOTS = 8
SHOTS = os.environ.get("PGQUE_SCREENSHOTS")

pytestmark = pytest.mark.skipif(
    shutil.which("chromedriver") is None or shutil.which("chromium") is None,
    reason="no chromium and chromedriver here (make system-deps installs them)")


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    options.binary_location = str(shutil.which("chromium"))
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SHOTS) / f"dashboard-{name}.png"))


def _texts(driver: Any, css: str) -> list[str]:
    """The text of every element the selector finds, read in one script: the
    live pages replace their <main> every interval, so an element found in one
    call may be gone by the next."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText"
        " || e.textContent)", css))


def _click(driver: Any, by: str, value: str) -> None:
    """Click the element, finding it again if a refresh replaced it meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException

    def attempt() -> bool | None:
        try:
            driver.find_element(by, value).click()
            return True
        except StaleElementReferenceException:
            return None
    wait_for(attempt, timeout=10, what=f"a click on {value!r}")


def _traffic(deployment: Deployment, *, seconds: float) -> None:
    """About 200 events a second for a while (for the screenshots' charts)."""
    import time

    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            producer.send_batch(QUEUE, [("Order", {"n": n + i}, f"customer-{(n + i) % 50}")
                                        for i in range(20)])
            n += 20
            time.sleep(0.1)


def test_the_pages_in_a_browser_live_and_escaped(pgque_deployment: Deployment,
                                                  browser: Any) -> None:

    deployment = pgque_deployment
    with pgque.connect(deployment.dsn(deployment.owner)) as owner:
        owner.create_queue(QUEUE, ticker_max_lag=0)
        owner.create_queue("invoices", ticker_max_lag=0)
    team = deployment.teams[0]
    dsn = deployment.dsn(deployment.login(team))
    with pgque.connect(dsn) as client:
        client.conn.execute(f"set role {team}")
        client.subscribe_slots(QUEUE, GROUP, slots=SLOTS)
    hostile = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    calls: list[int] = []
    lock = threading.Lock()

    def handle(message: pgque.Message[Any]) -> None:
        with lock:
            calls.append(message.id)
        if message.type == "Hostile":
            raise pgque.NonRetryable(hostile)

    with pgque.connect(deployment.dsn(deployment.producer)) as producer:
        sent = producer.send_batch(QUEUE, [("Order", {"n": n}, f"customer-{n % 50}")
                                           for n in range(400)])
        hostile_id = producer.send(QUEUE, "Hostile", {"html": hostile}, partition_key=hostile)
    ticker = pgque.Ticker(deployment.dsn(deployment.ticker), name="ticker-a")
    ticker.start()
    try:
        with pgque.Worker(dsn, queue=QUEUE, consumer=GROUP, slots=SLOTS, handler=handle,
                          ticker=False, poll_interval=0.05, name="billing-1") as worker, \
                DashboardServer(dsn, interval=0.5) as dashboard:
            assert worker.wait(lambda: len(calls) >= len(sent) + 1, timeout=60)
            if SHOTS:  # a chart with a line in it: some seconds of sending first
                _traffic(deployment, seconds=12)
            browser.get(dashboard.url + f"/queues/{QUEUE}/groups/{GROUP}")
            wait_for(lambda: ((slots := _texts(browser, ".slot")) and all(
                "behind\n0\n" in text for text in slots)) or None, timeout=30,
                what="every slot caught up")
            browser.get(dashboard.url + "/")
            wait_for(lambda: QUEUE in _texts(browser, "tbody td a") or None, timeout=30,
                     what="the queue's row")
            assert _texts(browser, "svg.spark")
            _shot(browser, "queues")
            _click(browser, "link text", QUEUE)
            _click(browser, "link text", GROUP)
            owned = wait_for(lambda: [t for t in _texts(browser, ".slot")
                                      if "billing-1-lane" in t] or None,
                             timeout=30, what="the slots owned by the worker")
            assert len(_texts(browser, ".slot")) == SLOTS == len(owned)
            _shot(browser, "group")
            # A dead letter with a hostile payload, reason and key: shown as text.
            browser.get(f"{dashboard.url}/dead-letters?queue={QUEUE}")
            row = wait_for(lambda: _texts(browser, "td.reason") or None,
                           timeout=30, what="the dead letter's row")
            assert hostile in row[0]
            _shot(browser, "dead-letters")
            _click(browser, "css selector", "tbody a")
            payload = wait_for(lambda: _texts(browser, "pre.payload") or None, timeout=30,
                               what="the dead letter's payload")
            assert "<script>window.pwned = 1</script>" in payload[0]
            assert browser.execute_script("return window.pwned") is None
            _shot(browser, "dead-letter")
            # Replayed from the page: its button, then the confirmation's; the
            # handler is called with it again (and it fails again, as before).
            before = calls.count(hostile_id)
            _click(browser, "xpath", "//button[text()='Replay']")
            wait_for(lambda: "Replay 1 dead letter of" in " ".join(_texts(browser, "h1"))
                     or None, timeout=30, what="the confirmation")
            _click(browser, "css selector", "form button.action")
            wait_for(lambda: "replay: 1" in " ".join(_texts(browser, "main")) or None,
                     timeout=30, what="the replay done")
            assert worker.wait(lambda: calls.count(hostile_id) > before, timeout=30)
            # The live tail: an event sent after the page opened shows, as text.
            browser.get(f"{dashboard.url}/queues/{QUEUE}/tail")
            wait_for(lambda: "Following" in " ".join(_texts(browser, "#tail-state")) or None,
                     timeout=30, what="the tail to follow")
            with pgque.connect(deployment.dsn(deployment.producer)) as producer:
                tailed = producer.send(QUEUE, "Tailed", {"html": hostile}, partition_key="t")
            row = wait_for(lambda: [t for t in _texts(browser, "#tail tbody tr")
                                    if str(tailed) in t] or None, timeout=30,
                           what="the tailed event's row")
            assert "<script>window.pwned = 1</script>" in row[0]
            assert browser.execute_script("return window.pwned") is None
            _shot(browser, "tail")
            # Live: the tickers page changes without a reload when the ticker stops.
            browser.get(dashboard.url + "/tickers")
            assert "ticker-a" in " ".join(_texts(browser, "main"))
            browser.execute_script("window.notReloaded = true")
            ticker.stop()
            wait_for(lambda: "No ticker is active" in " ".join(_texts(browser, "main")) or None,
                     timeout=30, what="the page to update")
            assert browser.execute_script("return window.notReloaded") is True
            assert "Active:" not in " ".join(_texts(browser, "main"))
    finally:
        ticker.stop()
