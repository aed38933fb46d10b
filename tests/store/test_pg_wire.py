"""The PostgreSQL store's rounds, sent through libpq (``store.pg_wire``): what psycopg's
cursors did for it — values in and out, refusals, connections left clean — must still
hold when a round goes wrong halfway. (tests/contract runs every plan through it.)"""

from __future__ import annotations

import asyncio
import decimal

import psycopg
import psycopg.errors
import pytest
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from durably.store.base import NewRun
from durably.store.pg_wire import send_round, statement
from durably.store.postgres import PostgresStore
from tests.conftest import execute_sql, postgres_schema_url
from tests.store.wire import ECHO, INSERT, UPDATE, Conn, assert_pool_works, run


def test_values_go_in_and_come_back_as_psycopg_would_give_them(postgres_schema: str) -> None:
    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async with pool.connection() as db:
            kinds = statement(
                "SELECT %(i)s::bigint AS i, %(f)s::float8 AS f, %(b)s::boolean AS b, "
                "%(t)s::text AS t, %(n)s::text AS n, %(l)s::text[] AS l, 1.5::numeric AS d"
            )
            values = {"i": 2**40, "f": 0.25, "b": True, "t": "é\n'", "n": None, "l": ["x", "y"]}
            ((row,),) = await send_round(db, [(kinds, values)])
            assert row == {**values, "d": decimal.Decimal("1.5")}
            # One statement, its parameter an int2, an int8, then NULL: psycopg's types differ,
            # so each is prepared on its own and all three are answered.
            answers = await send_round(db, [(ECHO, {"a": a, "b": "x"}) for a in (1, 2**40, None)])
            assert [rows[0]["c"] for rows in answers] == [2, 2**40 + 1, None]

    run(postgres_schema, body)


def test_a_write_without_rows_answers_one_empty_row_per_row_it_changed(
    postgres_schema: str,
) -> None:
    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async with pool.connection() as db:
            inserted = await send_round(db, [(INSERT, {"id": i, "v": "a"}) for i in range(3)])
            assert inserted == [[{"id": i, "v": "a"}] for i in range(3)]
            assert await send_round(db, [(UPDATE, {"v": "b", "id": 1})]) == [[(), ()]]
            assert await send_round(db, [(UPDATE, {"v": "b", "id": 9})]) == [[]]

    run(postgres_schema, body)


def test_a_refused_statement_rolls_its_round_back_and_leaves_the_connection_clean(
    postgres_schema: str,
) -> None:
    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async with pool.connection() as db:
            await send_round(db, [(INSERT, {"id": 1, "v": "a"})])
            first_use = statement("SELECT count(*) AS n FROM t WHERE v = %(v)s")
            with pytest.raises(psycopg.errors.UniqueViolation) as refused:
                # The round is one implicit transaction: the insert before the refusal goes
                # too, and the statement after it (prepared in this round) never ran.
                await send_round(
                    db,
                    [
                        (INSERT, {"id": 2, "v": "a"}),
                        (INSERT, {"id": 1, "v": "a"}),
                        (first_use, {"v": "a"}),
                    ],
                )
            assert refused.value.diag.constraint_name == "t_pkey"
            assert db.info.transaction_status == TransactionStatus.IDLE
            # Its preparation was not applied either: it is prepared again, and answers.
            assert await send_round(db, [(first_use, {"v": "a"})]) == [[{"n": 1}]]

    run(postgres_schema, body)


def test_a_round_cancelled_halfway_closes_its_connection(postgres_schema: str) -> None:
    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        sleep = statement("SELECT pg_sleep(%(s)s)")
        async with pool.connection() as db:
            waiting = asyncio.ensure_future(send_round(db, [(sleep, {"s": 5})]))
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # Its answer is still on the way: nobody may send on this connection again.
            assert db.closed
        await assert_pool_works(pool)  # a fresh connection

    run(postgres_schema, body)


def test_a_round_larger_than_the_socket_buffers_both_ways_completes(
    postgres_schema: str,
) -> None:
    """Sent in many writes, answered in many reads, every answer in its place."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        echo = statement("SELECT %(s)s::text AS s")
        texts = [chr(97 + i % 26) * 200_000 for i in range(60)]  # 12 MB each way
        async with pool.connection() as db:
            answers = await asyncio.wait_for(
                send_round(db, [(echo, {"s": text}) for text in texts]), 60
            )
            assert [rows[0]["s"] for rows in answers] == texts

    run(postgres_schema, body)


def test_statements_the_server_forgot_are_prepared_again(postgres_schema: str) -> None:
    """A connection whose prepared statements went (DEALLOCATE ALL, DISCARD ALL from a
    pooler's reset) refuses the round that finds out, and answers the next."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        async with pool.connection() as db:
            assert await send_round(db, [(ECHO, {"a": 1, "b": "x"})]) == [
                [{"a": 1, "b": "x", "c": 2}]
            ]
            await db.execute("DEALLOCATE ALL", prepare=False)
            # With a statement first prepared after it, in the same round: never run.
            first_use = statement("SELECT %(n)s::int AS n")
            with pytest.raises(psycopg.errors.InvalidSqlStatementName):
                await send_round(db, [(ECHO, {"a": 1, "b": "x"}), (first_use, {"n": 1})])
            assert db.info.transaction_status == TransactionStatus.IDLE
            assert await send_round(db, [(ECHO, {"a": 2, "b": "y"}), (first_use, {"n": 2})]) == [
                [{"a": 2, "b": "y", "c": 3}],
                [{"n": 2}],
            ]

    run(postgres_schema, body)


def test_a_statement_whose_columns_changed_under_it_is_prepared_again(
    postgres_schema: str,
) -> None:
    """A migration that adds a column, run while workers are up: PostgreSQL refuses a
    prepared ``SELECT *`` whose result would change shape (0A000, "cached plan must not
    change result type") every time it is run. The round that finds out is refused; the
    next prepares it again, with its new columns."""

    async def body(pool: AsyncConnectionPool[Conn]) -> None:
        url = postgres_schema_url(postgres_schema)
        whole = statement("SELECT * FROM t WHERE id = %(id)s")
        async with pool.connection() as db:
            await send_round(db, [(INSERT, {"id": 1, "v": "a"})])
            assert await send_round(db, [(whole, {"id": 1})]) == [[{"id": 1, "v": "a"}]]
            async with await psycopg.AsyncConnection.connect(url) as other:
                await other.execute("ALTER TABLE t ADD COLUMN w int")
                await other.commit()
            with pytest.raises(psycopg.errors.FeatureNotSupported):
                await send_round(db, [(whole, {"id": 1})])
            assert await send_round(db, [(whole, {"id": 1})]) == [[{"id": 1, "v": "a", "w": None}]]

    run(postgres_schema, body)


def test_the_store_answers_through_a_migration_that_adds_a_column(postgres_schema: str) -> None:
    """Workers stay up while a newer durably migrates: their connections' prepared
    ``SELECT * FROM durably_runs`` is refused once the table has a column more, and the
    store prepares it again and answers, rather than failing every read until the
    connection is retired."""
    url = postgres_schema_url(postgres_schema)

    async def main() -> None:
        store = PostgresStore(url, pool_size=1)
        await store.migrate()
        try:
            created, _ = await store.create_run(
                NewRun("r1", "default", "wf", "1", {"args": [], "kwargs": {}}, "{}", "h", 2)
            )
            assert await store.get_run("r1") == created
            await asyncio.to_thread(
                execute_sql, url, "ALTER TABLE durably_runs ADD COLUMN added_later int"
            )
            assert await store.get_run("r1") == created
            assert await store.get_run("r1") == created
        finally:
            await store.close()

    asyncio.run(main())


def test_the_store_answers_after_the_server_dropped_its_prepared_statements(
    postgres_schema: str,
) -> None:
    """DEALLOCATE ALL on the store's connection (a pooler's reset, an administrator): the
    next operation is answered, its statements prepared again."""

    async def main() -> None:
        store = PostgresStore(postgres_schema_url(postgres_schema), pool_size=1)
        await store.migrate()
        try:
            assert await store.get_run("r1") is None
            pool = await store._get_pool()
            async with pool.connection() as db:
                await db.execute("DEALLOCATE ALL", prepare=False)
            assert await store.get_run("r1") is None
        finally:
            await store.close()

    asyncio.run(main())


def test_every_pooled_connection_answers_through_a_migration_that_adds_a_column(
    postgres_schema: str,
) -> None:
    """With several connections in the pool, each holding the statement as it was: the
    operation that finds one of them out is answered still, wherever its retry lands."""
    url = postgres_schema_url(postgres_schema)

    async def main() -> None:
        store = PostgresStore(url, pool_size=4)
        await store.migrate()
        try:
            created, _ = await store.create_run(
                NewRun("r1", "default", "wf", "1", {"args": [], "kwargs": {}}, "{}", "h", 2)
            )
            pool = await store._get_pool()

            # Every connection prepares the read: 4 at once, each lent while the others are.
            await asyncio.gather(*[store.get_run("r1") for _ in range(8)])
            while pool.get_stats()["pool_size"] < 4:
                await asyncio.gather(*[store.get_run("r1") for _ in range(8)])
            await asyncio.to_thread(
                execute_sql, url, "ALTER TABLE durably_runs ADD COLUMN added_later int"
            )
            for _ in range(8):
                assert await store.get_run("r1") == created
        finally:
            await store.close()

    asyncio.run(main())
