"""The event loop on its own thread where an App's blocking methods run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from durably.errors import DurablyError

R = TypeVar("R")

CLOSE_WAIT_S = 5.0
"""How long closing the loop waits for the tasks left on it to end once cancelled."""


class LoopThread:
    """One event loop on a daemon thread, where an App's blocking methods run.

    Every blocking call shares it, so a store's connection pool (bound to a loop) lives as
    long as the App instead of being rebuilt, and leaked, on each ``asyncio.run``.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._loop is not None

    def call(self, coro: Coroutine[Any, Any, R]) -> R:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise DurablyError(
                "a blocking App method was called inside a running event loop; await its "
                "_async variant instead (e.g. await app.run_async(...))"
            )
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="durably-app-loop", daemon=True
                )
                self._thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            # What is left on the loop (another App's pool used from code running here, a
            # caller's own task) is cancelled and let finish, as asyncio.run does: a loop
            # closed under pending tasks has them destroyed mid-await when collected.
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


async def _cancel_the_rest() -> None:
    this = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not this]
    for task in rest:
        task.cancel()
    if rest:
        # Bounded: a task that will not end when cancelled must not hang the App's close.
        done, _ = await asyncio.wait(rest, timeout=CLOSE_WAIT_S)
        for task in done:
            # Ending under a closed store is expected here: not "never retrieved" noise.
            if not task.cancelled():
                task.exception()
    await asyncio.get_running_loop().shutdown_asyncgens()
