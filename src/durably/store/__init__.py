"""Storage backends behind one contract (:class:`durably.store.base.Store`)."""

from __future__ import annotations

from durably.errors import ConfigurationError
from durably.store.base import Store, shown_url, without_secrets


def open_store(url: str) -> Store:
    """The store for a database URL: ``sqlite:///path.db`` or ``postgresql://...``."""
    # libpq reads a C string: a NUL would silently cut the URL short (another host, another
    # database). An undecodable character (from a command line's bytes) names nothing.
    if "\x00" in url or not url.isprintable():
        raise ConfigurationError(
            f"database URL {shown_url(url)!r} contains control or undecodable characters; "
            "percent-encode them (%20) or correct the URL"
        )
    if url.startswith("sqlite:"):
        from durably.store.sqlite import SQLiteStore

        return SQLiteStore(url)
    if url.startswith(("postgresql://", "postgres://")):
        # Imported here so that SQLite users never load the PostgreSQL driver.
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        from durably.store.postgres import PostgresStore

        try:
            conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise ConfigurationError(
                f"malformed PostgreSQL URL {shown_url(url)!r} "
                f"({without_secrets(str(exc).strip(), url)}); write "
                "postgresql://user:password@host:5432/dbname, percent-encoding any other "
                "character in its parts (@ as %40)"
            ) from None
        return PostgresStore(url)
    raise ConfigurationError(
        f"unsupported database URL {shown_url(url)!r}; use sqlite:///path.db or "
        "postgresql://user@host:5432/dbname"
    )
