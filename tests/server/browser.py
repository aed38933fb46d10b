"""Driving the console from Chromium (Playwright): the browser, and an App usable beside it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import durably

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


class OffLoop:
    """The test's own App over the server's database (a separate instance, like a CLI).

    Playwright's sync API keeps an event loop running on the test's thread, where the App's
    blocking methods refuse to run; each call here goes to a short-lived thread instead.
    """

    def __init__(self, app: durably.App) -> None:
        self._app = app

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._app, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with ThreadPoolExecutor(1) as pool:
                return pool.submit(method, *args, **kwargs).result()

        return call

    def work_until_idle(self) -> int:
        with ThreadPoolExecutor(1) as pool:
            handled: int = pool.submit(self._app.worker().run, until_idle=True).result()
        return handled
