"""The settings every SQLite connection of durably's opens with."""

from __future__ import annotations

import asyncio
from pathlib import Path

from durably.store.sqlite import SQLiteStore
from durably.store.sqlite_file import connect


def test_a_connection_is_durable_checked_and_keeps_scratch_tables_in_memory(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/d.db"
    db = connect(f"{tmp_path}/d.db", url, busy_timeout_s=1.0)
    try:
        settings = {
            name: db.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "foreign_keys", "temp_store")
        }
    finally:
        db.close()
    # synchronous 2: FULL, an fsync at every commit. temp_store 2: MEMORY, so the scratch
    # table of every RETURNING and IN list is not built in a temporary file's pager.
    assert settings == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1, "temp_store": 2}


def test_the_ledgers_unbounded_sorts_may_spill_to_a_file_and_nothing_else_does(
    tmp_path: Path,
) -> None:
    """temp_store=MEMORY also keeps every sort in memory: the ledger's figures, which sort
    every unresolved operation, are read with the default (spilling) store, then the
    connection is as before."""
    seen: list[str] = []

    async def main() -> int:
        store = SQLiteStore(f"sqlite:///{tmp_path}/d.db")
        await store.migrate()
        store._conn.set_trace_callback(seen.append)
        await store.ledger_figures()
        store._conn.set_trace_callback(None)
        (mode,) = store._conn.execute("PRAGMA temp_store").fetchone()
        await store.close()
        return int(mode)

    assert asyncio.run(main()) == 2
    figures = next(i for i, sql in enumerate(seen) if "durably_tool_operations" in sql)
    assert seen[:figures] == ["PRAGMA temp_store=DEFAULT"]
    assert seen[figures + 1 :] == ["PRAGMA temp_store=MEMORY"]
