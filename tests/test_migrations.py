"""Schema migrations: the shipped snapshot is what the migrations produce."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from durably.store.migrations import schema_snapshot, split_statements
from durably.store.sqlite import SQLiteStore


def sqlite_schema(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' ORDER BY name"
        ).fetchall()
    return [(name, " ".join(sql.split())) for name, sql in rows]


def test_sqlite_migrations_produce_the_snapshot(tmp_path: Path) -> None:
    migrated = tmp_path / "migrated.db"
    asyncio.run(SQLiteStore(f"sqlite:///{migrated}").migrate())
    snapshot = tmp_path / "snapshot.db"
    with sqlite3.connect(snapshot) as conn:
        for statement in split_statements(schema_snapshot("sqlite")):
            conn.execute(statement)
    assert sqlite_schema(migrated) == sqlite_schema(snapshot)


def test_concurrent_stores_migrate_once(tmp_path: Path) -> None:
    """Two processes' stores opening one new file: each migration is applied once."""
    url = f"sqlite:///{tmp_path}/shared.db"
    first, second = SQLiteStore(url), SQLiteStore(url)
    applied = asyncio.run(first.migrate()) + asyncio.run(second.migrate())
    assert applied == [1]
