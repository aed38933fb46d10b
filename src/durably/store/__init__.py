"""Storage backends behind one contract (:class:`durably.store.base.Store`)."""

from __future__ import annotations

from durably.errors import ConfigurationError
from durably.store.base import Store


def open_store(url: str) -> Store:
    """The store for a database URL: ``sqlite:///path.db`` or ``postgresql://...``."""
    if url.startswith("sqlite:"):
        from durably.store.sqlite import SQLiteStore

        return SQLiteStore(url)
    if url.startswith(("postgresql://", "postgres://")):
        # Imported here so that SQLite users never load the PostgreSQL driver.
        from durably.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ConfigurationError(
        f"unsupported database URL {url!r}; use sqlite:///path.db or "
        "postgresql://user@host:5432/dbname"
    )
