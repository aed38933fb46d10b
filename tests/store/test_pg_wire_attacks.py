"""``store.pg_wire`` attacked: backends ended at any point of a round, rounds and store
operations cut anywhere, refusals inside a transaction, notices past the buffers, every
value psycopg adapts, connections closed. Each failure must be psycopg's own error on a
closed or clean connection, never a hang, never a connection lent mid-protocol."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import gc
import logging
import random
import statistics
import time
import uuid
import weakref
from typing import Any

import psycopg
import psycopg.errors
import pytest
from psycopg import pq
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from durably.errors import RunNotFound
from durably.store.base import NewRun
from durably.store.pg_wire import Statement, send_round, statement
from durably.store.postgres import PostgresStore
from tests.conftest import fetch_sql, postgres_schema_url
from tests.store.wire import (
    ECHO,
    INSERT,
    PID,
    SLEEP,
    UPDATE,
    Conn,
    assert_pool_works,
    run,
    terminate,
)


def test_a_backend_ended_mid_round_is_an_operational_error_and_the_pool_recovers(
    postgres_schema: str,
) -> None:
    """What the store's retry and StoreUnavailable rest on: the connection's loss is
    psycopg's OperationalError, raised, never a hang, and the pool lends a working
    connection next."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        url = postgres_schema_url(postgres_schema)
        async with pool.connection() as db:
            ((mine,),) = await send_round(db, [(PID, None)])
            waiting = asyncio.ensure_future(
                send_round(db, [(ECHO, {"a": 1, "b": "x"}), (SLEEP, {"s": 30})])
            )
            await asyncio.sleep(0.3)
            await terminate(url, mine["pid"])
            with pytest.raises(psycopg.OperationalError):
                await asyncio.wait_for(waiting, 10)
            assert db.closed
        # Ended while it sat in the pool: its next round finds out.
        async with pool.connection() as db:
            ((mine,),) = await send_round(db, [(PID, None)])
        await terminate(url, mine["pid"])
        async with pool.connection() as db:
            with pytest.raises(psycopg.OperationalError):
                await asyncio.wait_for(
                    send_round(db, [(PID, None), (ECHO, {"a": 1, "b": "x"})]), 10
                )
            assert db.closed
        await assert_pool_works(pool)

    run(postgres_schema, body)


def test_backends_ended_at_random_points_of_rounds_are_always_operational_errors(
    postgres_schema: str,
) -> None:
    """The backend ended while a round is being sent (past the socket's buffers), run or
    answered: every time psycopg's OperationalError, the connection closed, never a hang,
    another error class or a half-read answer; the next connection works."""
    rng = random.Random(42)
    url = postgres_schema_url(postgres_schema)
    echo = statement("SELECT %(s)s::text AS s")

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        outcomes: dict[str, int] = {}
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as killer:
            for _ in range(60):
                async with pool.connection() as db:
                    ((mine,),) = await send_round(db, [(PID, None)])
                    size = rng.choice([10, 100_000, 2_000_000])
                    pair: list[tuple[Statement, dict[str, Any] | None]] = [
                        (echo, {"s": "x" * size}),
                        (SLEEP, {"s": rng.random() / 50}),
                    ]
                    round_ = pair * 3
                    waiting = asyncio.ensure_future(send_round(db, round_))
                    await asyncio.sleep(rng.random() / 50)
                    await killer.execute("SELECT pg_terminate_backend(%s)", [mine["pid"]])
                    try:
                        answers = await asyncio.wait_for(waiting, 20)
                    except psycopg.OperationalError:
                        assert db.closed
                        outcomes["ended"] = outcomes.get("ended", 0) + 1
                    else:
                        assert [rows[0]["s"] for rows in answers[::2]] == ["x" * size] * 3
                        outcomes["answered"] = outcomes.get("answered", 0) + 1
                async with pool.connection() as db:
                    if not db.closed:  # ended after its round: the next round finds out
                        with contextlib.suppress(psycopg.OperationalError):
                            await send_round(db, [(PID, None)])
        assert outcomes.get("ended", 0) > 20
        async with pool.connection() as db:
            assert await send_round(db, [(echo, {"s": "y"})]) == [[{"s": "y"}]]

    run(postgres_schema, body)


def test_rounds_cancelled_anywhere_leave_only_clean_connections_in_the_pool(
    postgres_schema: str,
) -> None:
    """Timeouts landing at random points of rounds — before the connection is lent, while
    a round is sent, while it is answered, in an explicit transaction's second round: the
    pool's one connection is, every time after, idle, out of pipeline mode, and works."""
    rng = random.Random(20261201)
    begin, commit = statement("BEGIN"), statement("COMMIT")

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async def transaction(n: int, pause_s: float) -> None:
            async with pool.connection() as db:
                await send_round(
                    db,
                    [
                        (begin, None),
                        (INSERT, {"id": n, "v": "a"}),
                        (SLEEP, {"s": pause_s}),
                    ],
                )
                await send_round(db, [(UPDATE, {"v": "b", "id": n}), (commit, None)])

        # Timeouts up to twice a whole transaction's time on this machine, so that about
        # as many land inside one as after it, however fast the machine and its server.
        took = []
        for n in range(1000, 1005):
            started = time.perf_counter()
            await transaction(n, 0.001)
            took.append(time.perf_counter() - started)
        longest_s = 2 * statistics.median(took)

        cut = 0
        for n in range(300):
            try:
                await asyncio.wait_for(transaction(n, rng.random() / 500), rng.random() * longest_s)
            except TimeoutError:
                cut += 1
            async with pool.connection() as db:
                assert db.pgconn.pipeline_status == pq.PipelineStatus.OFF
                assert db.info.transaction_status == TransactionStatus.IDLE
                assert await send_round(db, [(ECHO, {"a": n, "b": "x"})]) == [
                    [{"a": n, "b": "x", "c": n + 1}]
                ]
        assert 30 < cut < 270  # landed both ways, many times
        # Each transaction is whole or absent.
        async with pool.connection() as db:
            (rows,) = await send_round(db, [(statement("SELECT v FROM t"), None)])
            assert {row["v"] for row in rows} <= {"b"}

    run(postgres_schema, body)


def test_store_operations_cut_anywhere_leave_the_store_working_and_its_writes_whole(
    postgres_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store's own path (``_transact``: its ROLLBACK after a refusal, its retry) under
    timeouts landing anywhere: a run is created whole or not at all, a refused request
    (a run that is not there, refused after its first round, inside BEGIN) is rolled back by
    the store, and no connection goes back to the pool mid-transaction for the pool to
    roll back."""
    rng = random.Random(7)
    url = postgres_schema_url(postgres_schema)

    async def main() -> None:
        store = PostgresStore(url, pool_size=2)
        await store.migrate()
        try:
            made = set()
            for n in range(150):
                new = NewRun(f"r{n}", "default", "wf", "1", {}, f'{{"args": [{n}]}}', "h", 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(store.create_run(new), rng.random() / 200)
                    made.add(new.run_id)
                with contextlib.suppress(TimeoutError, RunNotFound):
                    await asyncio.wait_for(
                        store.request_cancel(f"absent{n}", compensate=False), rng.random() / 200
                    )
                run = await store.get_run(new.run_id)
                assert run is None or run.input == {"args": [n]}, run
                if run is not None:
                    made.add(run.run_id)
            assert 10 < len(made) < 150
            # A write cut after its round went out may still land (the server runs what it
            # was sent up to the Sync, whoever is still listening): later, but whole.
            await asyncio.sleep(0.5)
            listed = await asyncio.to_thread(fetch_sql, url, "SELECT run_id FROM durably_runs")
            assert made <= {row[0] for row in listed}
            for (run_id,) in listed:
                run = await store.get_run(run_id)
                assert run is not None
                assert run.input == {"args": [int(run_id[1:])]}
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, logger="psycopg.pool"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "rolling back" in r.getMessage()]


def test_a_refusal_inside_begin_leaves_the_transaction_failed_until_rolled_back(
    postgres_schema: str,
) -> None:
    """A round that opened a transaction and had a statement refused leaves it failed (the
    store's ROLLBACK is what ends it): nothing of it applied, every statement sent to it
    refused, a statement first prepared there prepared again later."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        begin = statement("BEGIN")
        count = statement("SELECT count(*) AS n FROM t WHERE v <> %(v)s")
        async with pool.connection() as db:
            await send_round(db, [(INSERT, {"id": 1, "v": "a"})])
            with pytest.raises(psycopg.errors.UniqueViolation):
                await send_round(
                    db,
                    [(begin, None), (INSERT, {"id": 2, "v": "b"}), (INSERT, {"id": 1, "v": "c"})],
                )
            assert db.info.transaction_status == TransactionStatus.INERROR
            with pytest.raises(psycopg.errors.InFailedSqlTransaction):
                await send_round(db, [(ECHO, {"a": 1, "b": "x"}), (count, {"v": "z"})])
            assert db.info.transaction_status == TransactionStatus.INERROR
            await db.execute("ROLLBACK")
            assert await send_round(db, [(count, {"v": "z"})]) == [[{"n": 1}]]

    run(postgres_schema, body)


def test_notices_during_a_round_reach_psycopgs_handlers_and_change_no_answer(
    postgres_schema: str,
) -> None:
    """NOTICE and WARNING messages ride between a round's answers, thousands of them past
    the socket's buffers: they go to the connection's notice handlers, in order, and every
    answer is still in its place."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        noisy = statement("SELECT noisy(%(n)s) AS n")
        heard: list[str] = []
        async with pool.connection() as db:
            await db.execute(
                "CREATE FUNCTION noisy(n int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN "
                "FOR i IN 1..n LOOP RAISE NOTICE 'n % %', n, i; END LOOP; "
                "RAISE WARNING 'w %', n; RETURN n; END $$"
            )
            db.add_notice_handler(lambda diag: heard.append(diag.message_primary or ""))
            answers = await send_round(
                db, [(noisy, {"n": 1}), (ECHO, {"a": 1, "b": "x"}), (noisy, {"n": 5000})]
            )
            assert answers == [[{"n": 1}], [{"a": 1, "b": "x", "c": 2}], [{"n": 5000}]]
            expected = ["n 1 1", "w 1", *[f"n 5000 {i}" for i in range(1, 5001)], "w 5000"]
            assert heard == expected

    run(postgres_schema, body)


def test_every_value_goes_in_and_comes_back_as_through_psycopgs_own_cursor(
    postgres_schema: str,
) -> None:
    """One statement, its parameter of a different type each time, some in the same round:
    each answer is the one psycopg's own ``execute`` gives for that value, and a value
    psycopg cannot send is refused with psycopg's error for it."""
    values: list[Any] = [
        *(None, 0, 1, -1, 2**15, 2**31, 2**63 - 1, -(2**63), 2**63, 10**30, True, False),
        *(0.5, -0.0, float("inf"), 1e300, "", "é\n'\\", "x" * 10_000, b"\x00\xff"),
        *(decimal.Decimal("1.10"), decimal.Decimal("-1E+30"), uuid.UUID(int=1)),
        *(datetime.date(2026, 12, 1), datetime.datetime(2026, 12, 1, 7, 15)),
        *(datetime.datetime(2026, 12, 1, 7, 15, tzinfo=datetime.UTC), datetime.timedelta(1)),
        *([], [1, 2], [1, 2**40], [None, 3], ["a", None], [[1, 2], [3, 4]], [True], [0.5]),
    ]
    echo = statement("SELECT %(v)s AS v")

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async with pool.connection() as db:
            expected = []
            for value in values:
                cursor = await db.execute("SELECT %(v)s AS v", {"v": value}, prepare=False)
                expected.append(await cursor.fetchall())
            # Twice: prepared in the first round, prepared statements reused in the second.
            for _ in range(2):
                assert await send_round(db, [(echo, {"v": v}) for v in values]) == expected
            for value in values:
                assert await send_round(db, [(echo, {"v": value})]) == [
                    expected[values.index(value)]
                ]
        for unsendable in ["a\x00b", {"a": 1}, object()]:
            async with pool.connection() as db:
                with pytest.raises(psycopg.Error) as ours:
                    await send_round(db, [(echo, {"v": 1}), (echo, {"v": unsendable})])
            async with pool.connection() as db:
                with pytest.raises(psycopg.Error) as theirs:
                    await db.execute("SELECT %(v)s AS v", {"v": unsendable})
                assert type(ours.value) is type(theirs.value)
                assert await send_round(db, [(echo, {"v": 1})]) == [[{"v": 1}]]

    run(postgres_schema, body)


def test_a_closed_connection_is_freed_with_what_its_rounds_kept(postgres_schema: str) -> None:
    """pg_wire keeps per connection its adapters, which hold the connection and the last
    round's answers: none of it may outlive the connection, however it was closed — a
    round cut halfway, or closed by its owner (the pool)."""
    url = postgres_schema_url(postgres_schema)

    async def connected() -> Conn:
        return await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row)

    async def main() -> None:
        gone = []
        for cut in (True, False):
            db = await connected()
            await send_round(db, [(statement("SELECT repeat('x', 1000000) AS x"), None)])
            gone.append(weakref.ref(db))
            if cut:
                waiting = asyncio.ensure_future(send_round(db, [(SLEEP, {"s": 5})]))
                await asyncio.sleep(0.1)
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                del waiting
            await db.close()
            del db
        async with await connected() as db:  # connections go on being made
            await send_round(db, [(ECHO, {"a": 1, "b": "x"})])
        gc.collect()
        assert [ref() for ref in gone] == [None, None]

    asyncio.run(main())
