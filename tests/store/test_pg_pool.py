"""The PostgreSQL pools of event loops other than the App's own: a loop that ends while its
pool is busy ends (``asyncio.run`` cancels every task left and waits for them all, and
psycopg_pool's workers swallow a cancellation that reaches them inside a task, then wait on
their queue for good), and the connections of a loop that ended are closed with the App."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import uuid

import psycopg
import pytest

import durably
from durably.store.pg_pool import Pool
from tests.conftest import POSTGRES_URL, postgres_schema_url


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


def test_the_connections_of_loops_that_ended_are_closed_with_the_app(postgres_schema: str) -> None:
    """``asyncio.run(app.run_async(...))`` opens a pool for that loop, and the loop ends
    without closing it (its ``close()`` needs the loop): ``app.close()`` closes them."""
    name = f"durably_{uuid.uuid4().hex[:12]}"
    app = durably.App(f"{postgres_schema_url(postgres_schema)}&application_name={name}")

    @app.workflow()
    async def wf() -> int:
        return 1

    def connections() -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            row = conn.execute(query, (name,)).fetchone()
            assert row is not None
            return int(row[0])

    def settle_at(expected: int) -> int:
        # The server drops a closed connection from pg_stat_activity soon, not at once.
        deadline = time.monotonic() + 10
        while connections() > expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return connections()

    for _ in range(3):
        assert asyncio.run(app.run_async(wf)).result == 1
    assert settle_at(1) == 1  # each loop's new pool closed the ended loops' pools
    app.close()
    assert settle_at(0) == 0


def test_an_apps_loop_closed_under_another_apps_pool_ends_that_pools_tasks(
    postgres_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A workflow awaits another App's async method: that App opens a pool on this App's
    loop. Closing this App ends the loop; the pool's tasks end with it (cancelled, as
    ``asyncio.run`` does), not destroyed pending once collected."""
    url = postgres_schema_url(postgres_schema)
    app, other = durably.App(url), durably.App(url)

    @app.workflow()
    async def wf() -> str:
        return (await other.get_run_async(durably.current_run().run_id)).status.value

    assert app.run(wf).result == "running"
    app.close()
    other.close()
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text
