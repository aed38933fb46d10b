"""Group commit gathering over many passes (``store.gathering``), attacked on both stores:
a write cancelled at any pass of the gather is withdrawn or told what it did, a refused
write in a long-gathered batch fails alone, and a worker's many runs each run every step
once."""

from __future__ import annotations

import asyncio
import collections
import random
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest

import durably
from durably.errors import LeaseLostError
from durably.store.base import Committed, EventWrite, Lease, Transition
from durably.store.postgres import PostgresStore
from durably.store.sqlite import SQLiteStore
from tests.leases import held_runs

MakeApp = Callable[..., durably.App]


async def open_with_runs(url: str, count: int) -> tuple[SQLiteStore | PostgresStore, list[Lease]]:
    store = SQLiteStore(url) if url.startswith("sqlite") else PostgresStore(url)
    await store.migrate()
    return store, await held_runs(store, count)


@pytest.mark.parametrize("victim", [0, 1, 5])
def test_a_write_cancelled_at_any_pass_of_a_long_gather_is_withdrawn_or_told_what_it_did(
    database_url: str, victim: int
) -> None:
    """Six runs write two passes apart (one batch gathered over ~10 passes); one of them
    (0: the PostgreSQL round's leader) is cancelled at pass k, for every k up to well past
    the batch. A caller told its commit returned finds it written once; a caller not told
    was cancelled and wrote nothing; nothing is left queued."""

    async def main() -> None:
        store, leases = await open_with_runs(database_url, 6)
        for k in range(30):
            tag = f"k{k}"
            told: dict[str, object] = {}

            async def commit(i: int, lease: Lease, tag: str, told: dict[str, object]) -> None:
                for _ in range(2 * i):
                    await asyncio.sleep(0)
                told[lease.run_id] = await store.commit(lease, Transition(events=[EventWrite(tag)]))
                await asyncio.sleep(0)  # a cancel meant for later lands here

            tasks = [
                asyncio.ensure_future(commit(i, lease, tag, told)) for i, lease in enumerate(leases)
            ]
            for _ in range(k):
                await asyncio.sleep(0)
            tasks[victim].cancel()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            for lease, task in zip(leases, tasks, strict=True):
                written = [e.type for e in await store.events(lease.run_id)].count(tag)
                if lease.run_id in told:
                    assert isinstance(told[lease.run_id], Committed)
                    assert written == 1, (k, lease.run_id)
                else:
                    assert task.cancelled(), (k, lease.run_id, task.exception())
                    assert written == 0, (k, lease.run_id)
            if isinstance(store, PostgresStore):
                g = store._gathering
                assert not g._joining, k
                assert not g._sending, k
                assert not g._rounds, k
            else:
                assert not store._pending, k
        await store.close()

    asyncio.run(main())


def test_refused_writes_in_a_batch_gathered_over_many_passes_fail_alone(database_url: str) -> None:
    async def main() -> None:
        store, leases = await open_with_runs(database_url, 24)

        async def commit(i: int, lease: Lease) -> Committed:
            for _ in range(2 * i):
                await asyncio.sleep(0)
            if i % 3 == 1:  # a stale holder: refused
                lease = replace(lease, epoch=lease.epoch + 7)
            return await store.commit(lease, Transition(events=[EventWrite("x")]))

        answers = await asyncio.gather(
            *(commit(i, lease) for i, lease in enumerate(leases)), return_exceptions=True
        )
        for i, (lease, answer) in enumerate(zip(leases, answers, strict=True)):
            written = [e.type for e in await store.events(lease.run_id)].count("x")
            refused = i % 3 == 1
            assert isinstance(answer, LeaseLostError if refused else Committed), (i, answer)
            assert written == (0 if refused else 1), i
        await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("concurrency", [16, 64])
def test_a_worker_of_many_runs_with_random_step_latencies_runs_every_step_once(
    make_app: MakeApp, concurrency: int
) -> None:
    app = make_app()
    ran: collections.Counter[tuple[int, int]] = collections.Counter()
    lock = threading.Lock()

    @app.step()
    async def work(run: int, i: int, delay: float) -> int:
        with lock:
            ran[(run, i)] += 1
        await asyncio.sleep(delay)
        return run * 100 + i

    @app.workflow()
    async def wf(run: int, delays: list[float]) -> list[int]:
        return [await work(run, i, d) for i, d in enumerate(delays)]

    rng = random.Random(concurrency)
    n = 150
    ids = [
        app.start(wf, r, [rng.choice([0.0, 0.0, rng.random() * 0.01]) for _ in range(4)])
        for r in range(n)
    ]
    assert app.worker(concurrency=concurrency).run(until_idle=True) == n
    for r, run_id in enumerate(ids):
        assert app.get_run(run_id).result == [r * 100 + i for i in range(4)]
    assert sorted(ran) == [(r, i) for r in range(n) for i in range(4)]
    assert set(ran.values()) == {1}

    async def events_of_runs() -> dict[str, list[tuple[int, str]]]:
        url = app.database_url
        store = SQLiteStore(url) if url.startswith("sqlite") else PostgresStore(url)
        try:
            return {rid: [(e.sequence, e.type) for e in await store.events(rid)] for rid in ids}
        finally:
            await store.close()

    for run_id, events in asyncio.run(events_of_runs()).items():
        assert [s for s, _ in events] == list(range(1, len(events) + 1)), run_id
        types = [t for _, t in events]
        assert types.count("step_succeeded") == 4, run_id
        assert types.count("run_completed") == 1, run_id
