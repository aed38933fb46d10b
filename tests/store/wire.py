"""What the tests of ``store.pg_wire`` share: a pool of one connection on a test's own
schema with a table ``t``, the statements they send, and a way to end a backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import psycopg.errors
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


PID = statement("SELECT pg_backend_pid() AS pid")
SLEEP = statement("SELECT pg_sleep(%(s)s) AS slept")


async def terminate(url: str, pid: int) -> None:
    """End one backend of ours from another connection, as an administrator or an idle
    timeout would."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as other:
        await other.execute("SELECT pg_terminate_backend(%s)", [pid])


async def assert_pool_works(pool: AsyncConnectionPool[Conn]) -> None:
    """The pool lends a connection that answers a round."""
    async with pool.connection() as db:
        assert not db.closed
        assert await send_round(db, [(ECHO, {"a": 1, "b": "x"})]) == [[{"a": 1, "b": "x", "c": 2}]]
