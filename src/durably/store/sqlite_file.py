"""Opening the SQLite file behind :class:`~durably.store.sqlite.SQLiteStore`: one
connection with durably's settings, waiting for other processes like every transaction,
or :class:`~durably.errors.StoreUnavailable` saying why the path cannot be the database.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from durably.errors import StoreUnavailable

_SETTINGS = (
    # WAL: readers (CLI, console) never block the worker's writes, and a commit is one
    # sequential append.
    "PRAGMA journal_mode=WAL",
    # FULL: fsync the WAL at every commit. NORMAL could lose the last commits on power
    # loss, and a lost "effect succeeded" record is a repeated effect.
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    # Every RETURNING, and every IN list of more than two values (the status CHECKs, the
    # runnable index), builds a scratch table each time its statement runs. Backed by a
    # temporary file's pager, that cost 15-70 µs a statement, a third of a run's SQL; in
    # memory, a few. It also keeps sorts in memory: no query sorts an unbounded set but
    # the ledger's figures, which set it back for their read (SQLiteStore._ledger_rows).
    "PRAGMA temp_store=MEMORY",
)

_LOCKED = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def connect(path: str, url: str, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection to ``path`` in WAL mode, waiting up to ``busy_timeout_s`` for other
    processes; StoreUnavailable naming the problem if the path cannot be the database."""
    try:
        # timeout: the busy timeout, in force before the first statement.
        # isolation_level=None: the store issues BEGIN/COMMIT itself, so Python's implicit
        # transactions never split or merge what must be one transaction.
        conn = sqlite3.connect(
            path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise StoreUnavailable(_cannot_open(url, path, exc)) from exc
    try:
        deadline = time.monotonic() + busy_timeout_s
        (mode,) = _until_unlocked(conn, _SETTINGS[0], deadline)[0]
        for setting in _SETTINGS[1:]:
            _until_unlocked(conn, setting, deadline)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreUnavailable(_cannot_open(url, path, exc)) from exc
    if mode != "wal" and path != ":memory:":
        conn.close()
        # SQLite keeps the old mode when it cannot create the -wal and -shm files.
        raise StoreUnavailable(
            f"cannot open the SQLite database {url!r} in WAL mode (it stays in {mode!r}): "
            f"{_why_not_writable(Path(path)) or 'is the file on a network file system?'}"
        )
    return conn


def _until_unlocked(
    conn: sqlite3.Connection, sql: str, deadline: float
) -> list[tuple[object, ...]]:
    """Run ``sql``, retrying while another connection holds a lock, until ``deadline``.

    SQLite answers "database is locked" at once, without waiting out the busy timeout,
    when connections race to switch a brand-new file to WAL."""
    pause = 0.001
    while True:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF not in _LOCKED or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _cannot_open(url: str, path: str, exc: sqlite3.Error) -> str:
    """Why ``path`` cannot be opened as durably's database, and what to do about it."""
    file = Path(path)
    ancestor = next((p for p in file.parents if os.path.lexists(p)), None)
    if os.path.isdir(file):
        why = (
            f"{path!r} is a directory; name a database file in it, "
            f"e.g. sqlite:///{file / 'durably.db'}"
        )
    elif ancestor is not None and not os.path.isdir(ancestor):
        why = f"{str(ancestor)!r} is a file, not a directory; correct the path"
    elif not os.path.isdir(file.parent):
        why = (
            f"directory {str(file.parent)!r} does not exist; create it "
            "(mkdir -p) or correct the path"
        )
    elif getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
        why = (
            f"{path!r} is not a SQLite database; point the URL at durably's database "
            "file, or at a path where a new one may be created"
        )
    elif getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_CORRUPT:
        why = (
            f"{path!r} is damaged ({exc}); restore it from a backup, or salvage what is "
            "left with `sqlite3 PATH .recover`"
        )
    else:
        why = _why_not_writable(file) or str(exc)
    return f"cannot open the SQLite database {url!r}: {why}"


def _why_not_writable(file: Path) -> str | None:
    if os.path.lexists(file) and not os.access(file, os.R_OK | os.W_OK):
        return (
            f"permission denied: this process (uid {os.geteuid()}) cannot read and write "
            f"{str(file)!r}; run as its owner or fix its owner or mode"
        )
    if not os.access(file.parent, os.W_OK | os.X_OK):
        return (
            f"permission denied: this process (uid {os.geteuid()}) cannot create files in "
            f"{str(file.parent)!r}, where SQLite keeps the database's -wal and -shm files; "
            "make the directory writable"
        )
    return None
