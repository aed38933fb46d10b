"""The settings every SQLite connection of durably's opens with."""

from __future__ import annotations

from pathlib import Path

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
