"""Storage backends behind one contract (:class:`durably.store.base.Store`)."""

from __future__ import annotations

from durably.errors import ConfigurationError
from durably.store.base import Store


def open_store(url: str) -> Store:
    """The store for a database URL: ``sqlite:///path.db`` (more backends to come)."""
    if url.startswith("sqlite:"):
        from durably.store.sqlite import SQLiteStore

        return SQLiteStore(url)
    raise ConfigurationError(f"unsupported database URL {url!r}; use sqlite:///path.db")
