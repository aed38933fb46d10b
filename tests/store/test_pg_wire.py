"""The PostgreSQL store's rounds, sent through libpq (``store.pg_wire``): what psycopg's
cursors did for it — values in and out, refusals, connections left clean — must still
hold when a round goes wrong halfway. (tests/contract runs every plan through it.)"""

from __future__ import annotations

import asyncio
import decimal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import psycopg.errors
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from durably.store.pg_wire import send_round, statement
from tests.conftest import postgres_schema_url

Conn = psycopg.AsyncConnection[dict[str, Any]]


@asynccontextmanager
async def pool_of(url: str) -> AsyncIterator[AsyncConnectionPool[Conn]]:
    pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
        url,
        min_size=1,
        max_size=1,
        open=False,
        kwargs={"row_factory": dict_row, "autocommit": True},
    )
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


def run(postgres_schema: str, body: Callable[[AsyncConnectionPool[Conn]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with pool_of(postgres_schema_url(postgres_schema)) as pool:
            async with pool.connection() as db:
                await db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
            await body(pool)

    asyncio.run(main())


INSERT = statement("INSERT INTO t (id, v) VALUES (%(id)s, %(v)s) RETURNING id, v")
UPDATE = statement("UPDATE t SET v = %(v)s WHERE id >= %(id)s")
ECHO = statement("SELECT %(a)s::bigint AS a, %(b)s::text AS b, %(a)s::bigint + 1 AS c")


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
        # The pool lends a fresh connection, which works.
        async with pool.connection() as db:
            assert not db.closed
            assert await send_round(db, [(ECHO, {"a": 1, "b": "x"})]) == [
                [{"a": 1, "b": "x", "c": 2}]
            ]

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
