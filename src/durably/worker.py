"""The worker: claims runnable runs under a lease, executes them, recovers dead workers' runs.

A run whose worker died keeps its lease until ``lease_until``; after that any worker claims
it, and the runtime reconciles its in-flight effects before anything else (never a blind
re-execution). SIGTERM/SIGINT stop claiming new runs and let the current ones reach their
next boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from durably import runtime

if TYPE_CHECKING:
    from durably.app import App

log = logging.getLogger("durably.worker")


def worker_id(kind: str) -> str:
    """A lease owner name unique to this process and object: ``kind:host:pid:random``."""
    return f"{kind}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Worker:
    """Executes an app's runs: ``app.worker(concurrency=4).run()``."""

    def __init__(
        self,
        app: App,
        *,
        concurrency: int = 1,
        lease_ttl: timedelta = timedelta(seconds=30),
        poll_interval: timedelta = timedelta(milliseconds=500),
    ) -> None:
        self.app = app
        self.concurrency = concurrency
        self.lease_ttl_s = lease_ttl.total_seconds()
        self.poll_interval_s = poll_interval.total_seconds()
        self.worker_id = worker_id("worker")
        self.executed = 0
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Stop claiming; runs in progress finish their current boundary."""
        self._stopping.set()

    def run(self, *, until_idle: bool = False) -> int:
        """Block running the worker; returns how many run executions it performed."""
        return asyncio.run(self.run_async(until_idle=until_idle))

    async def run_async(self, *, until_idle: bool = False) -> int:
        await self.app.open()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.stop)
        slots = [asyncio.create_task(self._slot(until_idle)) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*slots)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
        return self.executed

    async def _slot(self, until_idle: bool) -> None:
        store = self.app.store
        workflows = self.app.workflows
        while not self._stopping.is_set():
            claim = await store.claim_next(self.worker_id, self.lease_ttl_s, workflows)
            if claim is not None:
                self.executed += 1
                try:
                    await runtime.drive(self.app, claim)
                except Exception:
                    log.exception("run %s: unexpected error in the runtime", claim.run.run_id)
                continue
            if until_idle:
                return
            wakeup = await store.next_wakeup(workflows)
            delay = self.poll_interval_s
            if wakeup is not None:
                delay = min(delay, max(wakeup - time.time(), 0.0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=max(delay, 0.01))
