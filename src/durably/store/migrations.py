"""Versioned SQL migrations, shipped as package files: ``sql/<backend>/migrations/NNNN_name.sql``.

Each backend also ships ``sql/<backend>/schema.sql``, the snapshot that applying every
migration must produce (a test holds them together). A new database is created from the
snapshot, in one transaction that records every migration as applied; a database that
has a schema already is brought up to date one migration at a time.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from durably.errors import SchemaTooNew, StoreError
from durably.store.base import shown_url

_NAME = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


class Migratable(Protocol):
    url: str

    def schema_version(self) -> int: ...

    def apply_migration(self, version: int, name: str, sql: str) -> bool:
        """Apply one migration in one transaction; False if it was already applied."""

    def create_schema(self, snapshot: str, applied: list[Migration]) -> bool:
        """Create the schema from ``snapshot`` and record ``applied`` in one transaction;
        False, and nothing done, if the database has a migrations table already."""


def migrations(backend: str) -> list[Migration]:
    folder = resources.files("durably.store") / "sql" / backend / "migrations"
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text()))
    return sorted(found, key=lambda m: m.version)


def schema_snapshot(backend: str) -> str:
    return (resources.files("durably.store") / "sql" / backend / "schema.sql").read_text()


def refused(url: str, what: str, exc: Exception) -> StoreError:
    """The database refused a statement of durably's schema: no outage, and no retry would
    pass it (a table of that name that is someone else's, say)."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return StoreError(
        f"cannot migrate {url}: {what} failed: {detail}. durably's tables (durably_*) "
        "must be its own: give it a new database (or PostgreSQL schema), or one it created"
    )


def split_statements(script: str) -> list[str]:
    """Split a SQL script into statements (``sqlite3.complete_statement`` knows triggers)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statement = buffer.strip()
            if statement and not all(
                part.strip().startswith("--") or not part.strip() for part in statement.splitlines()
            ):
                statements.append(statement)
            buffer = ""
    return statements


class Migrator:
    def __init__(self, backend: str, target: Migratable) -> None:
        self.backend = backend
        self.target = target

    def apply(self) -> list[int]:
        known = migrations(self.backend)
        newest_known = known[-1].version if known else 0
        current = self.target.schema_version()
        if current > newest_known:
            raise SchemaTooNew(
                f"database {shown_url(self.target.url)} has schema version {current}, but "
                "this durably "
                f"knows up to {newest_known}; upgrade durably (never downgrade a database)"
            )
        # Faster than every migration in turn (one transaction, no table rebuilt), and a new
        # database is all there or not at all.
        if (
            current == 0
            and known
            and self.target.create_schema(schema_snapshot(self.backend), known)
        ):
            return [m.version for m in known]
        return [
            m.version
            for m in known
            if m.version > current and self.target.apply_migration(m.version, m.name, m.sql)
        ]
