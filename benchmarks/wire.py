"""What a call costs in database work, observed at the drivers and on disk.

durably offers no hook to count its statements, and should not need one: these taps sit
in the drivers it is documented to use (stdlib ``sqlite3``, psycopg 3). Each patches the
driver's ``connect`` while a store opens its connections and only *observes* them (a
trace callback, libpq's protocol trace); nothing a connection does is changed.
"""

from __future__ import annotations

import inspect
import os
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.baselines import wal_frames


@dataclass
class WireCounts:
    """What went to the database, summed over every traced connection."""

    statements: int = 0
    """Statements sent: simple Query messages + extended-protocol Execute messages (SQLite:
    every statement the trace callback saw)."""
    commits: int = 0
    """COMMITs: confirmed by the server (PostgreSQL), executed (SQLite)."""
    round_trips: int = 0
    """Times the client sent, then waited for the server's answer (F -> B in the trace)."""
    kinds: Counter[str] = field(default_factory=Counter)

    def __sub__(self, other: WireCounts) -> WireCounts:
        kinds = Counter(self.kinds)
        kinds.subtract(other.kinds)
        return WireCounts(
            self.statements - other.statements,
            self.commits - other.commits,
            self.round_trips - other.round_trips,
            kinds,
        )


# -- PostgreSQL: libpq's protocol trace ---------------------------------------------------

_PARSE = re.compile(r'\s*"([^"]*)" "(.*)" \d+')
_BIND = re.compile(r'\s*"[^"]*" "([^"]*)"')


def statement_kind(sql: str) -> str:
    """A short name for a statement: ``INSERT durably_events``, ``UPDATE durably_runs SET x``."""
    words = sql.strip().strip('"').split()
    if not words:
        return '"" (pool check)'
    verb = words[0].upper()
    if verb == "INSERT" and len(words) >= 3:
        return f"INSERT {words[2]}"
    if verb == "UPDATE" and len(words) >= 4:
        return f"UPDATE {words[1]} SET {words[3]}"
    if verb == "SELECT" and "FROM" in (w.upper() for w in words):
        index = [w.upper() for w in words].index("FROM")
        return f"SELECT FROM {words[index + 1]}" if index + 1 < len(words) else "SELECT"
    return " ".join(words[:2])


def parse_trace(text: str) -> WireCounts:
    """Counts from a libpq trace written with timestamps suppressed."""
    counts = WireCounts()
    prepared: dict[str, str] = {}
    bound = ""
    previous = ""
    for line in text.splitlines():
        parts = line.split("\t", 3)
        if len(parts) < 3:
            continue
        direction, message = parts[0], parts[2]
        rest = parts[3] if len(parts) > 3 else ""
        if direction == "B" and previous == "F":
            counts.round_trips += 1
        if direction in ("F", "B"):
            previous = direction
        if direction == "F":
            if message == "Query":
                counts.statements += 1
                counts.kinds[statement_kind(rest)] += 1
            elif message == "Parse" and (m := _PARSE.match(rest)):
                prepared[m.group(1)] = m.group(2)
            elif message == "Bind" and (m := _BIND.match(rest)):
                bound = m.group(1)
            elif message == "Execute":
                counts.statements += 1
                counts.kinds[statement_kind(prepared.get(bound, "?"))] += 1
        elif message == "CommandComplete" and rest.strip() == '"COMMIT"':
            counts.commits += 1
    return counts


class ProtocolTrace:
    """libpq protocol trace of every async psycopg connection opened while it is active.

    Patches ``psycopg.AsyncConnection.connect`` (which durably's pool calls) for the
    duration of the ``with`` block. ``snapshot()`` flushes the traces and returns the
    cumulative counts; call it only while no traced connection is in use.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._traced: list[tuple[Any, Path, int]] = []
        self._original: Any = None

    def __enter__(self) -> ProtocolTrace:
        import psycopg

        # The classmethod itself, so that __exit__ puts back exactly what was there.
        self._original = inspect.getattr_static(psycopg.AsyncConnection, "connect")
        connect = self._original.__func__

        async def traced_connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
            conn = await connect(cls, *args, **kwargs)
            self._attach(conn)
            return conn

        setattr(psycopg.AsyncConnection, "connect", classmethod(traced_connect))  # noqa: B010
        return self

    def __exit__(self, *exc: object) -> None:
        import psycopg

        setattr(psycopg.AsyncConnection, "connect", self._original)  # noqa: B010
        for conn, _, fd in self._traced:
            if not conn.closed:
                conn.pgconn.untrace()
            os.close(fd)
        self._traced.clear()

    def _attach(self, conn: Any) -> None:
        path = self.directory / f"conn-{len(self._traced)}.trace"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._trace(conn, fd)
        self._traced.append((conn, path, fd))

    @staticmethod
    def _trace(conn: Any, fd: int) -> None:
        from psycopg import pq

        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

    def snapshot(self) -> WireCounts:
        total = WireCounts()
        for conn, path, fd in self._traced:
            if not conn.closed:
                conn.pgconn.untrace()  # flushes libpq's buffered trace
                self._trace(conn, fd)
            one = parse_trace(path.read_text(errors="replace"))
            total.statements += one.statements
            total.commits += one.commits
            total.round_trips += one.round_trips
            total.kinds.update(one.kinds)
        return total


# -- SQLite: a trace callback, and the WAL file's growth ------------------------------------


class SQLiteTrace:
    """Statements and COMMITs of every ``sqlite3`` connection opened inside the ``with``.

    The patch of ``sqlite3.connect`` is needed only while the store opens its connection;
    the trace callback it installs keeps counting for the connection's whole life.
    """

    def __init__(self) -> None:
        self.counts = WireCounts()
        self._original: Any = None

    def __enter__(self) -> SQLiteTrace:
        self._original = sqlite3.connect
        original = self._original

        def traced_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn: sqlite3.Connection = original(*args, **kwargs)
            conn.set_trace_callback(self._count)
            return conn

        setattr(sqlite3, "connect", traced_connect)  # noqa: B010
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(sqlite3, "connect", self._original)  # noqa: B010

    def _count(self, sql: str) -> None:
        self.counts.statements += 1
        if sql.strip().upper().startswith("COMMIT"):
            self.counts.commits += 1

    def snapshot(self) -> WireCounts:
        return WireCounts(self.counts.statements, self.counts.commits)


class WalPin:
    """A read transaction held open on a SQLite database so that no checkpoint can reset
    its WAL: from an empty WAL on, the file grows by every frame any connection writes.

    It empties the WAL first (a TRUNCATE checkpoint), so open it while the database is
    idle. The store's own automatic checkpoints then copy nothing, and its connection's
    settings stay untouched.
    """

    def __init__(self, db: Path) -> None:
        self.db = db
        self.conn = sqlite3.connect(db, isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.page_size = int(self.conn.execute("PRAGMA page_size").fetchone()[0])
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()

    def frames(self) -> float:
        return wal_frames(self.db, self.page_size)

    def close(self) -> None:
        self.conn.execute("COMMIT")
        self.conn.close()
