"""psycopg_pool's asyncio pool, with maintenance workers that end when they are cancelled.

The pool's workers catch ``CancelledError`` in the task they run (a connection being
made, psycopg_pool's ``CLIENT_EXCEPTIONS``) and wait on their queue again. Cancelled at that
moment, by ``asyncio.run`` ending its loop (it cancels every task left and waits for them
all), a worker never ends and the program hangs at exit: a caller's loop that used
``app.run_async`` under a timeout while a connection was being replaced did.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.pool_async import StopWorker

log = logging.getLogger("durably")


class Pool(AsyncConnectionPool[AsyncConnection[dict[str, Any]]]):
    """:class:`psycopg_pool.AsyncConnectionPool` whose workers end once cancelled."""

    @classmethod
    async def worker(cls, q: Any) -> None:
        this = asyncio.current_task()
        while True:
            task = await q.get()
            if isinstance(task, StopWorker):
                return
            try:
                await task.run()
            except Exception as exc:
                log.warning("connection pool task %s failed: %r", task, exc)
            if this is not None and this.cancelling():
                raise asyncio.CancelledError  # the task it ran swallowed it
