"""Debian's Chromium driven by Playwright (never `playwright install`, which downloads a browser)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # the dev extra is not installed
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless browser for the length of the block; skips the test when there is none to drive."""
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium) for the browser tests")
    if sync_playwright is None:
        pytest.skip("the playwright package (the dev extra) is not installed")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
