"""Fixtures of the console tests: ``durably serve`` subprocesses, one Chromium per module and
a fresh page per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server.browser import CHROMIUM, CHROMIUM_ARGS
from tests.server.served import Served, serve_cli


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(10_000)
    pg = context.new_page()
    # Every action asks for confirmation: say yes, unless a test listens itself.
    pg.on("dialog", lambda dialog: dialog.accept())
    yield pg
    context.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Starts ``durably serve`` subprocesses (see :func:`serve_cli`), stopped after the test."""
    started: list[Served] = []

    def start(database_url: str, *args: str, **env: str | None) -> Served:
        served = serve_cli(database_url, tmp_path / f"serve-{len(started)}.log", *args, **env)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()
