"""Debian's chromium driven by Selenium through Debian's chromedriver (no browser or driver download)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_available() -> bool:
    """Whether chromium, chromedriver and selenium are installed."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)


@contextmanager
def chromium(width: int = 1360, height: int = 900) -> Iterator[Any]:
    """A headless chromium session; quit (and its profile removed) on exit."""
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never try to download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={width},{height}",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.set_page_load_timeout(20)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
