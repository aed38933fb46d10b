"""Driving the console from Chromium (Playwright): the browser, and an App usable beside it.

The browser is ``$DURABLY_TEST_CHROMIUM`` if set, else ``/usr/bin/chromium``, else
``chromium-browser`` or ``chromium`` on ``$PATH``. When there is none, :func:`chromium`
installs Debian's (``apt-get install chromium``) if it runs as root where apt exists, and
otherwise fails saying what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import durably

DEBIAN_CHROMIUM = "/usr/bin/chromium"
NOT_FOUND = (
    "Chromium is not installed (looked for /usr/bin/chromium, chromium-browser and chromium "
    "on $PATH), and it cannot be installed from here ({why}): install it with `apt-get "
    "install chromium`, or set DURABLY_TEST_CHROMIUM to a Chromium executable."
)


class ChromiumMissing(RuntimeError):
    """No Chromium to drive, and none could be installed."""


def find_chromium(candidates: Sequence[str] | None = None) -> str | None:
    """The Chromium executable to drive, or None. ``$DURABLY_TEST_CHROMIUM``, when set, is
    the only one considered."""
    chosen = os.environ.get("DURABLY_TEST_CHROMIUM")
    if chosen:
        candidates = [chosen]
    elif candidates is None:
        candidates = [DEBIAN_CHROMIUM, "chromium-browser", "chromium"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def install_chromium(
    log: Callable[[str], None],
    candidates: Sequence[str] | None = None,
    apt_get: str = "apt-get",
) -> str:
    """The Chromium executable, installed with ``apt_get`` first if there is none (as root
    only); :class:`ChromiumMissing` otherwise."""
    found = find_chromium(candidates)
    if found:
        return found
    chosen = os.environ.get("DURABLY_TEST_CHROMIUM")
    if chosen:
        raise ChromiumMissing(f"$DURABLY_TEST_CHROMIUM={chosen} is not an executable")
    apt = shutil.which(apt_get)
    if apt is None or os.geteuid() != 0:
        why = "no apt-get" if apt is None else "not running as root"
        raise ChromiumMissing(NOT_FOUND.format(why=why))
    log("Chromium is missing: installing it for the browser tests (apt-get install chromium)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for argv in ([apt, "update", "-q"], [apt, "install", "-y", "-q", "chromium"]):
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=1200, check=False
        )
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-3000:]
            raise ChromiumMissing(f"`{' '.join(argv)}` failed ({done.returncode}):\n{output}")
    found = find_chromium(candidates)
    if found is None:
        raise ChromiumMissing(NOT_FOUND.format(why="apt-get installed no chromium executable"))
    log(f"Chromium installed: {found}")
    return found


_outcome: str | ChromiumMissing | None = None


def chromium(log: Callable[[str], None] = print) -> str:
    """The Chromium executable to drive (see :func:`install_chromium`); tried once per
    process, later calls repeat its outcome."""
    global _outcome  # noqa: PLW0603 - one installation attempt per test session
    if _outcome is None:
        try:
            _outcome = install_chromium(log)
        except ChromiumMissing as exc:
            _outcome = exc
    if isinstance(_outcome, ChromiumMissing):
        raise _outcome
    return _outcome


CHROMIUM = find_chromium() or DEBIAN_CHROMIUM
"""Where Chromium is, or will be once :func:`chromium` installed it."""
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
