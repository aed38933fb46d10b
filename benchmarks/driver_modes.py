"""What psycopg alone costs the client per statement, in the ways durably can send one.

The same ~200-byte autocommit ``INSERT ... RETURNING`` (a durable commit each), sent:

* ``bare``: ``execute`` on one connection (the floor benchmark's raw baseline);
* ``pool``: ``execute`` on a connection borrowed from ``psycopg_pool`` (durably's
  PostgreSQL store, for a round of one statement);
* ``pool+pipeline``: the same inside ``pipeline()`` (how durably sent a round of several
  statements before it drove libpq itself);
* ``pool+libpq``: the same statement, prepared once, handed to libpq's own pipeline on
  the pooled connection's ``pgconn`` (how durably's PostgreSQL store sends every round).

Modes are interleaved over ``--repeat`` rounds; the figures are the medians of client CPU
(``time.process_time``) and wall time per statement. It decides how durably sends a round,
so it is measured, not assumed::

    .venv/bin/python benchmarks/driver_modes.py --postgres-url postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import psycopg
from psycopg.pq import ExecStatus
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from benchmarks.baselines import row_body

MODES = ("bare", "pool", "pool+pipeline", "pool+libpq")


async def measure(url: str, statements: int, repeat: int) -> dict[str, tuple[float, float]]:
    """mode -> (median µs of client CPU, median µs of wall time) per statement."""
    table = f"driver_modes_{uuid.uuid4().hex[:8]}"
    insert = f"INSERT INTO {table} (body) VALUES (%(body)s) RETURNING id"
    kwargs: dict[str, Any] = {"row_factory": dict_row, "autocommit": True}
    bare = await psycopg.AsyncConnection.connect(url, **kwargs)
    pool: AsyncConnectionPool[psycopg.AsyncConnection[dict[str, Any]]] = AsyncConnectionPool(
        url, min_size=1, max_size=4, open=False, kwargs=kwargs
    )
    await pool.open(wait=True)
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    try:
        await bare.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, body text)")
        for _ in range(repeat):
            for mode in MODES:
                cpu, wall = time.process_time(), time.perf_counter()
                for i in range(statements):
                    params = {"body": row_body(i)}
                    if mode == "bare":
                        await (await bare.execute(insert, params)).fetchall()
                        continue
                    async with pool.connection() as db:
                        if mode == "pool":
                            await (await db.execute(insert, params)).fetchall()
                            continue
                        if mode == "pool+libpq":
                            await _libpq(db, insert, params["body"])
                            continue
                        async with db.pipeline():
                            cursor = await db.execute(insert, params)
                        await cursor.fetchall()
                samples[mode].append(
                    (
                        1e6 * (time.process_time() - cpu) / statements,
                        1e6 * (time.perf_counter() - wall) / statements,
                    )
                )
        (count,) = await (await bare.execute(f"SELECT count(*) AS n FROM {table}")).fetchall()
        expected = statements * repeat * len(MODES)
        if count["n"] != expected:
            raise SystemExit(f"{count['n']} rows written, expected {expected}")
    finally:
        await bare.execute(f"DROP TABLE IF EXISTS {table}")
        await bare.close()
        await pool.close()
    return {
        mode: (
            statistics.median(cpu for cpu, _ in taken),
            statistics.median(wall for _, wall in taken),
        )
        for mode, taken in samples.items()
    }


async def _libpq(db: psycopg.AsyncConnection[Any], insert: str, body: str) -> None:
    """``insert`` (prepared on ``db`` the first time) in a libpq pipeline; its result."""
    pgconn = db.pgconn
    if not getattr(db, "bench_prepared", False):
        numbered = insert.replace("%(body)s", "$1").encode()
        if pgconn.prepare(b"bench_insert", numbered).status != ExecStatus.COMMAND_OK:
            raise SystemExit("could not prepare the insert")
        db.bench_prepared = True  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    pgconn.enter_pipeline_mode()
    pgconn.send_query_prepared(b"bench_insert", [body.encode()])
    pgconn.pipeline_sync()
    while pgconn.flush():
        await asyncio.sleep(0)
    results: list[Any] = []
    while not results or results[-1].status != ExecStatus.PIPELINE_SYNC:
        while pgconn.is_busy():
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(pgconn.socket, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(pgconn.socket)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is not None:
            results.append(result)
    pgconn.exit_pipeline_mode()
    if results[0].status != ExecStatus.TUPLES_OK or results[0].ntuples != 1:
        raise SystemExit(f"the insert answered {results[0].status}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--statements", type=int, default=1500, help="per mode and round")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    figures = asyncio.run(measure(args.postgres_url, args.statements, args.repeat))
    print(f"{'mode':15} {'CPU µs/statement':>17} {'wall µs/statement':>18}")
    for mode, (cpu, wall) in figures.items():
        print(f"{mode:15} {cpu:17.0f} {wall:18.0f}")


if __name__ == "__main__":
    main()
