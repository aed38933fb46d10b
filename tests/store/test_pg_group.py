"""PostgreSQL's group commit (``store.pg_group``): the one-round writes of runs ready at the
same moment share one round and one transaction; a write the server refuses fails alone;
a run cancelled while its round is on its way still learns what that round did.
(tests/contract runs the shared round's refusals on both stores:
test_concurrent_commits_apply_or_refuse_each_on_its_own.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import psycopg
import pytest

from durably.errors import InvalidTransition
from durably.store.base import EventWrite, Lease, Transition
from durably.store.postgres import PostgresStore
from tests.conftest import postgres_schema_url
from tests.leases import held_runs


@asynccontextmanager
async def store_with_runs(
    schema: str, count: int
) -> AsyncIterator[tuple[PostgresStore, list[Lease]]]:
    store = PostgresStore(postgres_schema_url(schema))
    await store.migrate()
    leases = await held_runs(store, count)
    try:
        yield store, leases
    finally:
        await store.close()


def sql(schema: str, query: str, *params: object) -> list[tuple[object, ...]]:
    with psycopg.connect(postgres_schema_url(schema), autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def step(event: str) -> Transition:
    return Transition(events=[EventWrite(event)])


def test_writes_made_at_the_same_moment_share_one_transaction(postgres_schema: str) -> None:
    async def main() -> None:
        async with store_with_runs(postgres_schema, 8) as (store, leases):
            await asyncio.gather(*(store.commit(lease, step("x")) for lease in leases))

    asyncio.run(main())
    # Rows written by one transaction carry its id.
    rows = sql(postgres_schema, "SELECT run_id, xmin::text FROM durably_events WHERE type = 'x'")
    assert sorted(r[0] for r in rows) == [f"r{i}" for i in range(8)]
    assert len({r[1] for r in rows}) == 1


def test_writes_queued_many_passes_apart_share_one_transaction(postgres_schema: str) -> None:
    """Runs reaching their writes over many passes of the event loop (many runs at once, each
    a few passes from one write to its next) still share one round."""

    async def main() -> None:
        async with store_with_runs(postgres_schema, 12) as (store, leases):

            async def commit_after(passes: int, lease: Lease) -> None:
                for _ in range(passes):
                    await asyncio.sleep(0)
                await store.commit(lease, step("x"))

            await asyncio.gather(*(commit_after(2 * i, lease) for i, lease in enumerate(leases)))

    asyncio.run(main())
    rows = sql(postgres_schema, "SELECT run_id, xmin::text FROM durably_events WHERE type = 'x'")
    assert len(rows) == 12
    assert len({r[1] for r in rows}) == 1


def test_a_write_the_server_refuses_fails_alone(postgres_schema: str) -> None:
    async def main() -> list[object]:
        async with store_with_runs(postgres_schema, 4) as (store, leases):
            (squatted,) = sql(
                postgres_schema, "SELECT last_sequence + 1 FROM durably_runs WHERE run_id = 'r2'"
            )
            sql(  # a row taking the sequence r2's next event will want
                postgres_schema,
                "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, "
                "created_at) VALUES ('r2', %s, 'squatter', NULL, '{}', 0)",
                squatted[0],
            )
            return await asyncio.gather(
                *(store.commit(lease, step("x")) for lease in leases), return_exceptions=True
            )

    outcomes = asyncio.run(main())
    assert isinstance(outcomes[2], InvalidTransition)
    assert not any(isinstance(o, BaseException) for i, o in enumerate(outcomes) if i != 2)
    rows = sql(postgres_schema, "SELECT run_id FROM durably_events WHERE type = 'x'")
    assert sorted(r[0] for r in rows) == ["r0", "r1", "r3"]


@pytest.mark.parametrize("cancelled", ["leader", "joiner"])
def test_a_run_cancelled_while_its_round_is_on_its_way_learns_what_it_did(
    postgres_schema: str, cancelled: str
) -> None:
    """The round of two runs' writes is held on the server by a lock on one run's row; one
    of the two is cancelled meanwhile. Both writes apply; the cancelled run is told its
    write committed, then cancelled at its next await."""
    told: list[str] = []

    async def main() -> None:
        async with store_with_runs(postgres_schema, 2) as (store, leases):

            async def commit_then_continue(lease: Lease) -> None:
                await store.commit(lease, step("x"))
                told.append(lease.run_id)
                await asyncio.sleep(30)

            with psycopg.connect(postgres_schema_url(postgres_schema)) as holder:
                holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r1' FOR UPDATE")
                tasks = [asyncio.ensure_future(commit_then_continue(lease)) for lease in leases]
                await until_a_backend_waits_for_a_lock(postgres_schema)
                victim = tasks[0 if cancelled == "leader" else 1]
                victim.cancel()
                await asyncio.sleep(0.05)
                holder.commit()
                with pytest.raises(asyncio.CancelledError):
                    await victim
                survivor = tasks[1 if cancelled == "leader" else 0]
                deadline = time.monotonic() + 10
                while len(told) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                survivor.cancel()

    asyncio.run(main())
    assert sorted(told) == ["r0", "r1"]
    rows = sql(postgres_schema, "SELECT run_id, xmin::text FROM durably_events WHERE type = 'x'")
    assert sorted(r[0] for r in rows) == ["r0", "r1"]
    assert len({r[1] for r in rows}) == 1


async def until_a_backend_waits_for_a_lock(schema: str) -> None:
    deadline = time.monotonic() + 10
    while not sql(
        schema,
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()",
    ):
        assert time.monotonic() < deadline, "the round never reached the server"
        await asyncio.sleep(0.01)


def test_writes_that_come_while_a_shared_round_is_held_up_gather_and_go_anyway(
    postgres_schema: str,
) -> None:
    """While a shared round is held on the server (a lock on one of its runs' rows), the
    writes that come meanwhile gather into one round of their own, which goes without
    waiting for the lock: one locked run never holds up the others."""

    async def main() -> None:
        async with store_with_runs(postgres_schema, 6) as (store, leases):
            with psycopg.connect(postgres_schema_url(postgres_schema)) as holder:
                holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r2' FOR UPDATE")
                held = [
                    asyncio.ensure_future(store.commit(lease, step("x"))) for lease in leases[:3]
                ]
                await until_a_backend_waits_for_a_lock(postgres_schema)
                later = [store.commit(lease, step("x")) for lease in leases[3:]]
                await asyncio.wait_for(asyncio.gather(*later), timeout=10)
                assert not any(task.done() for task in held)
                holder.commit()
                await asyncio.gather(*held)

    asyncio.run(main())
    rows = dict(
        sql(postgres_schema, "SELECT run_id, xmin::text FROM durably_events WHERE type = 'x'")
    )
    assert sorted(rows) == [f"r{i}" for i in range(6)]
    assert rows["r0"] == rows["r1"] == rows["r2"] != rows["r3"] == rows["r4"] == rows["r5"]


def test_a_write_that_cannot_be_sent_fails_alone(postgres_schema: str) -> None:
    """A value the driver refuses to send (text with a NUL byte) fails the shared round
    before its Sync: nothing of it applied, and the other writes go again on their own."""

    async def main() -> list[object]:
        async with store_with_runs(postgres_schema, 3) as (store, leases):
            events = ["x", "bad\x00", "x"]
            return await asyncio.gather(
                *(store.commit(lease, step(e)) for lease, e in zip(leases, events, strict=True)),
                return_exceptions=True,
            )

    outcomes = asyncio.run(main())
    assert isinstance(outcomes[1], psycopg.DataError)
    assert not isinstance(outcomes[0], BaseException)
    assert not isinstance(outcomes[2], BaseException)
    rows = sql(postgres_schema, "SELECT run_id FROM durably_events WHERE type = 'x'")
    assert sorted(r[0] for r in rows) == ["r0", "r2"]
