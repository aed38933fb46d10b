"""The PostgreSQL store while its server restarts under it, on a throwaway cluster of this
test's own (the suite's shared server is never restarted): every operation answers or
raises StoreUnavailable — never psycopg's errors, never a hang — and the store works once
the server is back, its statements prepared again on the new connections."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time

import psycopg
import pytest

from durably.errors import StoreUnavailable
from durably.store.base import NewRun
from durably.store.postgres import PostgresStore
from tests.conftest import postgres_schema_url
from tests.pg import throwaway_cluster


@pytest.mark.parametrize("mode", ["immediate", "fast"])
def test_operations_through_server_restarts_answer_or_raise_store_unavailable(mode: str) -> None:
    with throwaway_cluster() as cluster:
        store = PostgresStore(cluster.url, pool_size=4, connect_timeout_s=30)
        restarted = threading.Event()
        failures: list[BaseException] = []
        unavailable: list[StoreUnavailable] = []
        answered = [0]

        async def client(n: int) -> None:
            rng = random.Random(n)
            for i in range(10_000):
                run_id = f"c{n}-{i}"
                new = NewRun(run_id, "default", "wf", "1", {}, "{}", "h", 2)
                try:
                    await store.create_run(new)
                    assert await store.get_run(run_id) is not None
                    answered[0] += 1
                except StoreUnavailable as exc:
                    unavailable.append(exc)
                    await asyncio.sleep(rng.random() / 10)
                except BaseException as exc:
                    failures.append(exc)
                    raise
                if restarted.is_set() and i % 50 == 0:
                    return

        async def main() -> None:
            await store.migrate()
            try:
                clients = [asyncio.ensure_future(client(n)) for n in range(4)]
                await asyncio.sleep(0.5)
                for _ in range(2):
                    done = await asyncio.to_thread(cluster.pg_ctl, "restart", "-m", mode)
                    assert done.returncode == 0, done.stdout + done.stderr
                    await asyncio.sleep(0.5)
                restarted.set()
                await asyncio.wait_for(asyncio.gather(*clients), 120)
                started = time.monotonic()
                assert await store.get_run("c0-0") is not None
                assert time.monotonic() - started < 5
            finally:
                await store.close()

        asyncio.run(main())
        assert failures == []
        # The pool waits for the server to come back, and _transact's retry hides the lost
        # connections: in practice every operation here is answered.
        assert answered[0] > 100
        assert all("failed a transaction" in str(exc) for exc in unavailable)


def test_a_server_that_accepts_and_never_answers_fails_each_connection_in_its_timeout() -> None:
    """A stopped server (or a black hole) accepts TCP and never speaks: migrating, the pool
    and the listener each give up after the store's connect timeout, not never."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"postgresql://u@127.0.0.1:{silent.getsockname()[1]}/db"
        store = PostgresStore(url, connect_timeout_s=1)

        async def each() -> list[float]:
            took = []
            for attempt in (store.migrate(), store.get_run("r"), store.wait_for_work(0.1)):
                began = time.monotonic()
                with contextlib.suppress(StoreUnavailable):
                    await attempt
                took.append(time.monotonic() - began)
            await store.close()
            return took

        took = asyncio.run(asyncio.wait_for(each(), 30))
    assert max(took) < 5, took


def test_a_worker_until_idle_reports_an_outage_that_outlasts_it_instead_of_retrying() -> None:
    """The database goes away for good in the middle of a run until idle: the worker stops,
    its slots at their runs' next boundary, and raises StoreUnavailable (the CLI's error:
    line), rather than retrying for ever."""
    import durably

    with throwaway_cluster() as cluster:
        # A connection is waited for 2 s at most (the least libpq waits): the outage shows.
        app = durably.App(f"{cluster.url}?connect_timeout=2")
        stopped = threading.Event()

        @app.step()
        async def tick(i: int) -> int:
            if i == 3 and not stopped.is_set():
                stopped.set()
                cluster.pg_ctl("stop", "-m", "immediate")
            await asyncio.sleep(0.01)
            return i

        @app.workflow()
        async def wf() -> int:
            return sum([await tick(i) for i in range(6)])

        try:
            for n in range(4):
                app.start(wf, run_id=f"r-{n}")
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                app.worker(concurrency=2).run(until_idle=True)
            assert time.monotonic() - began < 30
        finally:
            cluster.ensure_up()
            app.close()


def test_a_row_lock_held_elsewhere_fails_a_write_in_the_lock_timeout(postgres_schema: str) -> None:
    """Another session holds a run's row in an open transaction (an operator's psql, a
    stuck job): durably's write waits for it as long as the lock timeout, 30 s unless the
    URL sets one, then fails as an outage instead of waiting for ever."""
    import durably

    url = postgres_schema_url(postgres_schema)
    app = durably.App(f"{url}%20-c%20lock_timeout%3D1s")

    @app.workflow()
    async def wf() -> str:
        return await durably.wait_for_event("go")

    try:
        run = app.run(wf)
        with psycopg.connect(url) as holder:
            holder.execute("SELECT 1 FROM durably_runs WHERE run_id = %s FOR UPDATE", (run.run_id,))
            began = time.monotonic()
            with pytest.raises(StoreUnavailable, match="lock timeout"):
                app.cancel(run.run_id)
            assert time.monotonic() - began < 10
        assert app.get_run(run.run_id).status is durably.RunStatus.WAITING_EXTERNAL

        async def default_timeout() -> str:
            store = PostgresStore(url)
            pool = await store._get_pool()
            async with pool.connection() as conn:
                shown = await (await conn.execute("SHOW lock_timeout")).fetchone()
            await store.close()
            return str(shown and shown["lock_timeout"])

        assert asyncio.run(default_timeout()) == "30s"
    finally:
        app.close()
