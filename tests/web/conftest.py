"""A headless Chromium driven by selenium, for the manager's status page.

Debian's ``chromium`` and ``chromium-driver`` packages are used as they are (``.ci/run``
installs them): no driver download, no internet. Without them a local run skips, and a run
with ``CI`` set fails: CI must have installed them.

Selenium blocks, and the manager under test serves the page from the test's own event loop,
so tests call the driver through :func:`asyncio.to_thread` (see ``StatusPage`` in
``test_status_page.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1366, 900)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture
def chrome() -> Iterator[webdriver.Chrome]:
    """A headless Chromium, closed after the test."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        if _in_ci():
            pytest.fail(
                f"{' and '.join(missing)} not found, and CI is set: the CI setup must install "
                "Debian's chromium and chromium-driver (.ci/run does).",
                pytrace=False,
            )
        pytest.skip(
            f"{' and '.join(missing)} not found: install Chromium and its driver with "
            "`apt-get install chromium chromium-driver`."
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
