"""psycopg_pool's asyncio pool: maintenance workers that end when they are cancelled, and
connections that can be closed after the event loop that opened them has ended.

The pool's workers catch ``CancelledError`` in the task they run (a connection being
made, psycopg_pool's ``CLIENT_EXCEPTIONS``) and wait on their queue again. Cancelled at that
moment, by ``asyncio.run`` ending its loop (it cancels every task left and waits for them
all), a worker never ends and the program hangs at exit: a caller's loop that used
``app.run_async`` under a timeout while a connection was being replaced did.

A pool's own ``close()`` needs its loop. A caller's loop that used the store and ended
without closing it (``asyncio.run(app.run_async(...))``, then ``app.close()``) leaves the
pool's connections open on the server until the process exits: :meth:`Pool.abandon`
closes them without a loop.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.pool_async import StopWorker

log = logging.getLogger("durably")


Conn = AsyncConnection[dict[str, Any]]


class Pool(AsyncConnectionPool[Conn]):
    """:class:`psycopg_pool.AsyncConnectionPool` whose workers end once cancelled."""

    def __init__(
        self,
        *args: Any,
        configure: Callable[[Conn], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> None:
        self.opened: weakref.WeakSet[Conn] = weakref.WeakSet()

        async def configured(conn: Conn) -> None:
            self.opened.add(conn)
            if configure is not None:
                await configure(conn)

        super().__init__(*args, configure=configured, **kwargs)

    def abandon(self) -> None:
        """Close the connections of a pool whose event loop has ended (no ``await``)."""
        for conn in list(self.opened):
            if not conn.closed:
                conn.pgconn.finish()

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
