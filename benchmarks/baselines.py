"""The raw baselines: one durable commit of one small row, with nothing around it.

* SQLite: stdlib ``sqlite3``, WAL, ``synchronous=FULL`` (durably's own settings), one
  ``BEGIN IMMEDIATE; INSERT; COMMIT`` per operation: one fsync of the WAL.
* PostgreSQL: async psycopg 3 (durably's driver) on one connection, not in autocommit:
  ``INSERT`` then ``commit()``, which psycopg sends as three round trips (BEGIN, INSERT,
  COMMIT); the COMMIT waits for the WAL flush the server's ``synchronous_commit`` asks for.
  The floor benchmark uses the cheapest correct durable commit instead: an autocommit
  ``INSERT``, one round trip (:class:`PgFloorWriter`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

WARMUP = 20


def row_body(i: int) -> str:
    """The ~200-byte JSON row each raw commit inserts (about what a small step records)."""
    return json.dumps(
        {
            "run_id": "run_0000000000000000000000",
            "step_id": f"bench_step#{i}",
            "status": "succeeded",
            "output": {"i": i, "status": "ok", "note": "a small step result"},
            "created_at": 1767225600.123456,
            "pad": "x" * 48,
        },
        separators=(",", ":"),
    )


def wal_frames(db: Path, page_size: int) -> float:
    """Frames in the WAL file of ``db`` (page size + 24-byte frame header each)."""
    wal = Path(f"{db}-wal")
    return wal.stat().st_size / (page_size + 24) if wal.exists() else 0.0


class SQLiteRawWriter:
    """The SQLite baseline: stdlib ``sqlite3``, WAL, ``synchronous=FULL``, one
    ``BEGIN IMMEDIATE; INSERT; COMMIT`` per operation."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("CREATE TABLE bench_rows (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")

    def commit(self, i: int) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("INSERT INTO bench_rows (body) VALUES (?)", (row_body(i),))
        self.conn.execute("COMMIT")

    def warm_up(self) -> None:
        for i in range(WARMUP):
            self.commit(-1 - i)

    def close(self) -> None:
        self.conn.close()


def raw_commit_us(path: Path, n: int, *, frames: bool = False) -> float:
    """Microseconds per SQLite commit of one ~200-byte JSON row, WAL + ``synchronous=FULL``.

    With ``frames``, returns WAL frames written per commit instead (autocheckpoint off).
    """
    writer = SQLiteRawWriter(path)
    try:
        writer.warm_up()
        if frames:
            # An empty WAL that no checkpoint resets: its size counts what is written.
            writer.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            writer.conn.execute("PRAGMA wal_autocheckpoint=0")
            for i in range(n):
                writer.commit(i)
            page_size = int(writer.conn.execute("PRAGMA page_size").fetchone()[0])
            return wal_frames(path, page_size) / n
        gc.collect()
        start = time.perf_counter()
        for i in range(n):
            writer.commit(i)
        return (time.perf_counter() - start) / n * 1e6
    finally:
        writer.close()


class PgRawWriter:
    """The PostgreSQL baseline: one async psycopg connection, INSERT + commit() per op."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Any = None

    async def open(self) -> None:
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(self.url)
        await self.conn.execute(
            "CREATE TABLE bench_rows (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)"
        )
        await self.conn.commit()

    async def commit(self, i: int) -> None:
        # Not autocommit: psycopg sends BEGIN, then the INSERT, then COMMIT.
        await self.conn.execute("INSERT INTO bench_rows (body) VALUES (%s)", (row_body(i),))
        await self.conn.commit()

    async def warm_up(self) -> None:
        for i in range(WARMUP):
            await self.commit(-1 - i)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()


def pg_raw_commit_us(url: str, n: int) -> float:
    """Microseconds per PostgreSQL commit of one ~200-byte row (INSERT + COMMIT)."""

    async def go() -> float:
        writer = PgRawWriter(url)
        try:
            await writer.open()
            await writer.warm_up()
            gc.collect()
            start = time.perf_counter()
            for i in range(n):
                await writer.commit(i)
            return (time.perf_counter() - start) / n * 1e6
        finally:
            await writer.close()

    return asyncio.run(go())


class PgFloorWriter(PgRawWriter):
    """The cheapest correct durable commit on PostgreSQL: one round trip per commit.

    An autocommit connection sends the single ``INSERT`` and the server commits it before
    answering (waiting for the WAL flush ``synchronous_commit`` asks for): one durable
    commit, one round trip, where :class:`PgRawWriter` takes three.
    """

    async def open(self) -> None:
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        await self.conn.execute(
            "CREATE TABLE bench_rows (id BIGSERIAL PRIMARY KEY, body TEXT NOT NULL)"
        )

    async def commit(self, i: int) -> None:
        await self.conn.execute("INSERT INTO bench_rows (body) VALUES (%s)", (row_body(i),))
