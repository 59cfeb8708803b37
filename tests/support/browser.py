"""A real browser for the console's tests: Playwright driving Debian's Chromium.

``make test`` installs Chromium (apt) and Playwright (the dev extra); Playwright's own browser
download does not work on a closed network, so the browser is ``/usr/bin/chromium`` with flags
that keep it from calling out (without them it floods refused connections). axe-core comes
bundled in the ``axe-playwright-python`` package and is evaluated in the page (evaluate runs
through the DevTools protocol, so the page's CSP does not block it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright

CHROMIUM = Path(os.environ.get("CONSUMER_PROXY_CHROMIUM", "/usr/bin/chromium"))
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium() -> Iterator[Browser]:
    """Chromium under Playwright; a missing browser fails the test (make test installs it)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Tab:
    """One page and what its console said."""

    page: Page
    errors: list[str] = field(default_factory=list)

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)


@contextmanager
def tab(browser: Browser, url: str) -> Iterator[Tab]:
    """A fresh context and page at ``url``; collects console errors and page errors."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    opened = Tab(page)
    page.on("console", opened.on_console)
    page.on("pageerror", lambda error: opened.errors.append(f"page error: {error}"))
    try:
        page.goto(url)
        yield opened
    finally:
        context.close()


def axe_violations(page: Page, impacts: tuple[str, ...] = ("serious", "critical")) -> list[Any]:
    """axe-core's violations of ``impacts`` on the page as it is now."""
    source = resources.files("axe_playwright_python").joinpath("axe.min.js").read_text()
    page.evaluate(source)
    result = page.evaluate("async () => await axe.run(document)")
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["html"] for n in v["nodes"]][:3]}
        for v in result["violations"]
        if v["impact"] in impacts
    ]
