"""A loop that ends while the PostgreSQL pool is busy ends: ``asyncio.run`` cancels every
task left and waits for them all, and psycopg_pool's workers swallow a cancellation that
reaches them inside a task (a connection being made), then wait on their queue for good."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from durably.store.pg_pool import Pool
from tests.conftest import postgres_schema_url


class _Swallowing:
    """A pool maintenance task that, like psycopg_pool's connecting task, catches a
    cancellation and returns."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def run(self) -> None:
        self.entered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)


def test_a_loop_ended_while_a_pool_worker_runs_a_task_ends(postgres_schema: str) -> None:
    ended = threading.Event()

    async def main() -> None:
        pool = Pool(postgres_schema_url(postgres_schema), min_size=1, open=False)
        await pool.open(wait=True)
        busy = _Swallowing()
        pool.run_task(busy)  # type: ignore[arg-type]
        await busy.entered.wait()
        # Returns with the pool open and its worker in the middle of the task: the loop's
        # end cancels it there.

    def run() -> None:
        asyncio.run(main())
        ended.set()

    threading.Thread(target=run, daemon=True).start()
    assert ended.wait(15), "asyncio.run never returned: a pool worker outlived the cancel"
