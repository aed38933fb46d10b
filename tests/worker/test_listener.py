"""The PostgreSQL LISTEN connection lives exactly as long as the worker that listens on it.

A worker stopped while its listener was connecting used to drop that connection still
open (a ``ResourceWarning`` in 1 of ~7 runs of a test that stops a worker quickly); one
stopped while listening left it open until the whole store was closed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import durably
from durably.store.postgres import PostgresStore
from durably.worker import Worker
from tests.conftest import POSTGRES_URL, postgres_schema_url


def listening_backends(application_name: str) -> int:
    """Server-side sessions of ``application_name`` that have sent ``LISTEN``."""
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND query LIKE 'LISTEN%%'",
            (application_name,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for_backends(application_name: str, expected: int, timeout: float = 5.0) -> int:
    """``listening_backends`` once it equals ``expected`` (a closed session takes a moment
    to leave ``pg_stat_activity``), or its last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (n := listening_backends(application_name)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


@pytest.fixture
def named_url(postgres_schema: str) -> tuple[str, str]:
    """A URL of a fresh schema whose sessions carry their own ``application_name``."""
    name = f"durably-listener-{uuid.uuid4().hex[:8]}"
    return postgres_schema_url(postgres_schema) + f"&application_name={name}", name


def test_a_listener_cancelled_as_it_connects_is_closed(
    named_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker cancels its listener task the moment the connection is open, before
    ``LISTEN`` is answered: the store must close what it opened, not drop it."""
    url, _ = named_url
    opened: list[psycopg.AsyncConnection[Any]] = []
    connect = psycopg.AsyncConnection.connect

    async def connect_then_stop(*args: Any, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        conn = await connect(*args, **kwargs)
        opened.append(conn)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # lands on the store's next await: its LISTEN
        return conn

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", connect_then_stop)
    store = PostgresStore(url)

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await store.wait_for_work(5.0)

    try:
        asyncio.run(main())
        assert len(opened) == 1
        assert opened[0].closed, "the cancelled listener's connection was left open"
    finally:
        for conn in opened:  # never leak it into the rest of the session
            conn.pgconn.finish()


@pytest.mark.parametrize("ending", ["returns", "is cancelled"])
def test_a_listener_is_closed_when_its_task_ends(named_url: tuple[str, str], ending: str) -> None:
    """Two tasks listen at once: each has its own connection, closed when that task ends
    (returning or cancelled mid-wait), not when the store is closed."""
    url, name = named_url
    store = PostgresStore(url)

    async def main() -> tuple[int, int]:
        done = asyncio.Event()

        async def listen() -> None:
            await store.wait_for_work(0.05)  # connects, listens, times out
            if ending == "returns":
                await done.wait()
            else:
                await store.wait_for_work(60.0)

        tasks = [asyncio.create_task(listen()) for _ in range(2)]
        both = await asyncio.to_thread(wait_for_backends, name, 2)
        done.set()
        if ending == "is cancelled":
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = await asyncio.to_thread(wait_for_backends, name, 0)
        await store.close()
        return both, left

    both, left = asyncio.run(main())
    assert both == 2, f"{both} LISTEN connections for two listening tasks"
    assert left == 0, f"{left} LISTEN connections still open after their tasks ended"


def test_a_stopped_worker_leaves_no_listening_connection(named_url: tuple[str, str]) -> None:
    """A worker stopped (as by SIGTERM) closes its listener on its way out: running
    workers one after another in a long-lived process does not pile up connections."""
    url, name = named_url
    app = durably.App(url)

    async def main() -> list[int]:
        left = []
        try:
            for _ in range(2):
                worker = Worker(app, poll_interval=timedelta(milliseconds=50))
                running = asyncio.create_task(worker.run_async())
                assert await asyncio.to_thread(wait_for_backends, name, 1) == 1
                worker.stop()
                assert await running == 0
                left.append(await asyncio.to_thread(wait_for_backends, name, 0))
        finally:
            await app.close_async()
        return left

    try:
        assert asyncio.run(main()) == [0, 0], "LISTEN connections left open by stopped workers"
    finally:
        app.close()


def test_a_worker_until_idle_opens_no_listener(named_url: tuple[str, str]) -> None:
    """``--until-idle`` slots never wait for work, so nothing listens: no connection to open
    per run of the worker (nor to leak when it stops at once)."""
    url, name = named_url
    app = durably.App(url)

    @app.step()
    def count_listeners() -> int:
        time.sleep(0.5)  # ample time for a listener to connect and LISTEN
        return listening_backends(name)

    @app.workflow()
    async def wf() -> int:
        return await count_listeners()

    try:
        run_id = app.start(wf)
        assert app.worker().run(until_idle=True) == 1
        assert app.get_run(run_id).result == 0, "a worker until idle opened a listener"
    finally:
        app.close()
