"""The event loop on its own thread where an App's blocking methods run."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from durably.errors import DurablyError, StoreUnavailable

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
        self._calls: set[asyncio.Task[Any]] = set()
        """The calls running on the loop (touched on the loop's thread only)."""
        self._cut: set[asyncio.Task[Any]] = set()
        """The calls cancelled because the loop is closing."""

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
        return asyncio.run_coroutine_threadsafe(self._tracked(coro), loop).result()

    async def _tracked(self, coro: Coroutine[Any, Any, R]) -> R:
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            raise StoreUnavailable(
                "the App was closed while this call ran: what it did is recorded, and a "
                "worker takes its run up again"
            ) from None
        finally:
            self._calls.discard(task)
            self._cut.discard(task)

    def stop(self, last: Coroutine[Any, Any, None] | None = None) -> None:
        """Cancel what still runs on the loop and let it end, then run ``last`` (closing
        the store those tasks record their stop in), then end the thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            asyncio.run_coroutine_threadsafe(self._wind_down(last), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
        elif last is not None:
            last.close()

    async def _wind_down(self, last: Coroutine[Any, Any, None] | None) -> None:
        # The calls still running (a run another thread executes) stop first and record
        # where they stopped; then ``last`` closes the store; then whatever else is left on
        # the loop (another App's pool used from code running here) is cancelled and let
        # finish, as asyncio.run does: a loop closed under pending tasks has them destroyed
        # mid-await when collected.
        self._cut.update(self._calls)
        await _cancel(list(self._calls))
        if last is not None:
            await last
        this = asyncio.current_task()
        await _cancel([task for task in asyncio.all_tasks() if task is not this])
        await asyncio.get_running_loop().shutdown_asyncgens()


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        # Bounded: a task that will not end when cancelled must not hang the App's close.
        done, _ = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: its caller was told (StoreUnavailable)
