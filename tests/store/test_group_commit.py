"""SQLite's group commit: the writes one event loop makes at the same moment share one
transaction; a caller cancelled while its write is queued withdraws it, one cancelled after
its batch ran is not told it failed. (tests/contract runs the batch's refusals on both
stores: test_concurrent_commits_apply_or_refuse_each_on_its_own.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from durably.store.base import EventWrite, Lease, Transition
from durably.store.sqlite import SQLiteStore
from tests.leases import held_runs


async def open_with_runs(path: Path, count: int) -> tuple[SQLiteStore, list[Lease]]:
    store = SQLiteStore(f"sqlite:///{path}")
    await store.migrate()
    return store, await held_runs(store, count)


def test_writes_made_at_the_same_moment_share_one_transaction(tmp_path: Path) -> None:
    commits: list[str] = []

    async def main() -> None:
        store, leases = await open_with_runs(tmp_path / "g.db", 8)
        store._conn.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
        await asyncio.gather(
            *(store.commit(lease, Transition(events=[EventWrite("x")])) for lease in leases)
        )
        store._conn.set_trace_callback(None)
        assert [[e.type for e in await store.events(f"r{i}")][-1] for i in range(8)] == ["x"] * 8
        await store.close()

    asyncio.run(main())
    assert commits == ["COMMIT"]


def commits_of_writes_passes_apart(path: Path, count: int) -> list[str]:
    """The COMMITs of ``count`` runs' writes, the i-th queued i passes of the loop late."""
    commits: list[str] = []

    async def main() -> None:
        store, leases = await open_with_runs(path, count)

        async def commit_after(passes: int, lease: Lease) -> None:
            for _ in range(passes):
                await asyncio.sleep(0)
            await store.commit(lease, Transition(events=[EventWrite("x")]))

        store._conn.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
        await asyncio.gather(*(commit_after(i, lease) for i, lease in enumerate(leases)))
        store._conn.set_trace_callback(None)
        await store.close()

    asyncio.run(main())
    return commits


def test_writes_queued_a_few_passes_apart_share_one_transaction(tmp_path: Path) -> None:
    """Runs woken a pass or two apart (one finishing a run, one starting a step) still
    share a batch: the flush waits while other callbacks are ready to run."""
    assert commits_of_writes_passes_apart(tmp_path / "g.db", 3) == ["COMMIT"]


def test_a_batch_waits_as_long_as_writes_keep_joining_and_no_longer(tmp_path: Path) -> None:
    """Many runs reach their writes over many passes (64 runs at once): the flush waits
    while writes keep joining, up to 64 passes; the writes after those go next."""
    assert commits_of_writes_passes_apart(tmp_path / "g.db", 80) == ["COMMIT", "COMMIT"]


def test_a_write_cancelled_while_queued_is_withdrawn(tmp_path: Path) -> None:
    async def main() -> list[str]:
        store, (lease,) = await open_with_runs(tmp_path / "g.db", 1)
        task = asyncio.ensure_future(store.commit(lease, Transition(events=[EventWrite("x")])))
        await asyncio.sleep(0)  # the task queued its write; the batch has not run yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        types = [e.type for e in await store.events("r0")]
        await store.close()
        return types

    assert "x" not in asyncio.run(main())


def test_a_write_whose_batch_ran_is_reported_then_cancelled(tmp_path: Path) -> None:
    async def main() -> tuple[list[str], list[str]]:
        store, (lease,) = await open_with_runs(tmp_path / "g.db", 1)
        seen: list[str] = []

        async def commit_then_continue() -> None:
            await store.commit(lease, Transition(events=[EventWrite("x")]))
            seen.append("told it committed")
            await asyncio.sleep(1)
            seen.append("never: cancelled at its next await")

        commits: list[str] = []
        store._conn.set_trace_callback(lambda sql: sql == "COMMIT" and commits.append(sql))
        task = asyncio.ensure_future(commit_then_continue())
        while not commits:
            await asyncio.sleep(0)
        assert seen == []  # the batch ran; the task has not resumed yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        types = [e.type for e in await store.events("r0")]
        await store.close()
        return types, seen

    types, seen = asyncio.run(main())
    assert types[-1] == "x"
    assert seen == ["told it committed"]
