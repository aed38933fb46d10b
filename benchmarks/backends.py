"""The overhead benchmark's two backends: a fresh database per measurement, the raw
baseline on it, and the footprint of a call (commits, statements, round trips, WAL)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.baselines import PgRawWriter, pg_raw_commit_us, raw_commit_us
from benchmarks.places import (
    Filesystem,
    PostgresAdmin,
    SQLiteFile,
    choose_base,
    filesystem_of,
    with_pg_options,
)
from benchmarks.wire import ProtocolTrace, SQLiteTrace, WalPin, WireCounts
from benchmarks.workloads import Case, run_once

SCHEMA_PREFIX = "durably_bench_"


@dataclass
class Footprint:
    """What one call (or one raw commit) costs in work, from a separate untimed run."""

    commits: float
    statements: float
    """SQL statements, BEGIN and COMMIT included (PostgreSQL: also the pool's check)."""
    round_trips: float | None
    """Client-server round trips (PostgreSQL); None for SQLite, which is in-process."""
    written: float
    """SQLite: WAL pages (frames) appended. PostgreSQL: WAL bytes (cluster-wide LSN delta)."""
    kinds: dict[str, float] = field(default_factory=dict)
    """PostgreSQL: statements per call by kind (from the libpq trace)."""


def per_call(zero: WireCounts, full: WireCounts, n: int) -> dict[str, float]:
    """(N-call run - 0-call run) / N for each count."""
    return {
        "commits": (full.commits - zero.commits) / n,
        "statements": (full.statements - zero.statements) / n,
        "round_trips": (full.round_trips - zero.round_trips) / n,
    }


class Backend(Protocol):
    key: str
    raw_label: str
    written_unit: str
    durable: bool
    """False when commits skip the flush (a memory filesystem, synchronous_commit=off):
    the ratios are then CPU figures, without a target."""

    def place(self, name: str) -> contextlib.AbstractContextManager[str]:
        """A fresh database (a file, or a schema) for one measurement: its durably URL."""
        ...

    def raw_us(self, place: str, n: int) -> float: ...

    def raw_footprint(self, place: str, n: int) -> Footprint: ...

    def footprint(self, case: Case, place: str, n: int) -> Footprint: ...

    def describe(self) -> dict[str, Any]: ...

    def epoch(self) -> str | None:
        """Changes when the database server restarts (None: it cannot restart under us)."""
        ...

    def recover(self) -> None:
        """After a failed or disturbed sample: wait for the server, clean up, reconnect."""
        ...

    def close(self) -> None: ...


class SQLiteBackend:
    key = "sqlite"
    written_unit = "pages"
    raw_label = "raw sqlite3 commit (WAL, synchronous=FULL)"

    def __init__(self, work: Path, fs: Filesystem, why: str) -> None:
        self.work = work
        self.fs = fs
        self.why = why
        self.durable = not fs.in_memory

    @contextlib.contextmanager
    def place(self, name: str) -> Iterator[str]:
        db = SQLiteFile(self.work, name)
        try:
            yield db.url()
        finally:
            db.drop()

    @staticmethod
    def _path(place: str) -> Path:
        return Path(place.removeprefix("sqlite:///"))

    def raw_us(self, place: str, n: int) -> float:
        return raw_commit_us(self._path(place), n)

    def raw_footprint(self, place: str, n: int) -> Footprint:
        frames = raw_commit_us(self._path(place), n, frames=True)
        return Footprint(commits=1, statements=3, round_trips=None, written=frames)

    def footprint(self, case: Case, place: str, n: int) -> Footprint:
        """COMMITs, SQL statements and WAL frames per call: (N-call run - 0-call run) / N."""
        with SQLiteTrace() as trace:
            app, wf = case.build(place)
            try:
                run_once(app, wf, 0)  # durably opens (and traces) its connection here
            except BaseException:
                app.close()
                raise
        try:
            pin = WalPin(self._path(place))
            try:
                start, frames0 = trace.snapshot(), pin.frames()
                run_once(app, wf, 0)
                mid, frames1 = trace.snapshot(), pin.frames()
                run_once(app, wf, n)
                end, frames2 = trace.snapshot(), pin.frames()
            finally:
                pin.close()
        finally:
            app.close()
        counts = per_call(mid - start, end - mid, n)
        return Footprint(
            commits=counts["commits"],
            statements=counts["statements"],
            round_trips=None,
            written=((frames2 - frames1) - (frames1 - frames0)) / n,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "directory": str(self.work),
            "filesystem": asdict(self.fs),
            "chosen_because": self.why,
            "sqlite": sqlite3.sqlite_version,
            "synchronous": "FULL",
        }

    def epoch(self) -> str | None:
        return None

    def recover(self) -> None:
        pass

    def close(self) -> None:
        pass


class PostgresBackend:
    """Each measurement in a fresh schema (search_path set through the URL's options)."""

    key = "postgres"
    written_unit = "WAL B"

    def __init__(self, url: str, synchronous_commit: str | None, work: Path) -> None:
        import psycopg

        self.url = url
        self.synchronous_commit = synchronous_commit
        self.work = work
        self.admin = PostgresAdmin(
            url, SCHEMA_PREFIX, hint="start it, pass --postgres-url, or run --backend sqlite"
        )
        self._count = 0
        self._schemas: list[str] = []
        with contextlib.closing(
            psycopg.connect(self._session_url(None), autocommit=True)
        ) as session:
            row = session.execute("SHOW synchronous_commit").fetchone()
        self.effective_synchronous_commit = str(row[0]) if row else "?"
        self.durable = self.effective_synchronous_commit != "off"
        self.raw_label = (
            "raw psycopg commit (INSERT+COMMIT, "
            f"synchronous_commit={self.effective_synchronous_commit})"
        )

    def _session_url(self, schema: str | None) -> str:
        options = [] if schema is None else [f"search_path={schema}"]
        if self.synchronous_commit is not None:
            options.append(f"synchronous_commit={self.synchronous_commit}")
        return with_pg_options(self.url, *options) if options else self.url

    @contextlib.contextmanager
    def place(self, name: str) -> Iterator[str]:
        self._count += 1
        schema = self.admin.schema_name(self._count, name)
        self.admin.create_schema(schema)
        self._schemas.append(schema)
        try:
            yield self._session_url(schema)
        finally:
            self._drop(schema)

    def _drop(self, schema: str) -> None:
        # If the server went away, the schema stays listed and recover() drops it later.
        with contextlib.suppress(Exception):
            self.admin.drop_schema(schema)
            self._schemas.remove(schema)

    def epoch(self) -> str | None:
        return self.admin.epoch()

    def recover(self) -> None:
        self.admin.conn()
        for schema in list(self._schemas):
            self._drop(schema)

    def raw_us(self, place: str, n: int) -> float:
        return pg_raw_commit_us(place, n)

    def raw_footprint(self, place: str, n: int) -> Footprint:
        async def go(trace: ProtocolTrace) -> tuple[WireCounts, int]:
            writer = PgRawWriter(place)
            try:
                await writer.open()
                await writer.warm_up()
                before, lsn = trace.snapshot(), self.admin.wal_lsn()
                for i in range(n):
                    await writer.commit(i)
                return trace.snapshot() - before, self.admin.wal_lsn() - lsn
            finally:
                await writer.close()

        with ProtocolTrace(self.work) as trace:
            wire, wal = asyncio.run(go(trace))
        return Footprint(
            commits=wire.commits / n,
            statements=wire.statements / n,
            round_trips=wire.round_trips / n,
            written=wal / n,
        )

    def footprint(self, case: Case, place: str, n: int) -> Footprint:
        """Commits, statements, round trips and WAL bytes per call: (N-run - 0-run) / N."""
        with ProtocolTrace(self.work) as trace:
            app, wf = case.build(place)
            try:
                run_once(app, wf, 0)
                run_once(app, wf, 2)
                start, lsn0 = trace.snapshot(), self.admin.wal_lsn()
                run_once(app, wf, 0)
                mid, lsn1 = trace.snapshot(), self.admin.wal_lsn()
                run_once(app, wf, n)
                end, lsn2 = trace.snapshot(), self.admin.wal_lsn()
            finally:
                app.close()
        zero, full = mid - start, end - mid
        kinds = {
            kind: (full.kinds[kind] - zero.kinds[kind]) / n
            for kind in sorted(set(full.kinds) | set(zero.kinds))
        }
        return Footprint(
            **per_call(zero, full, n),
            written=((lsn2 - lsn1) - (lsn1 - lsn0)) / n,
            kinds={k: v for k, v in kinds.items() if abs(v) >= 0.005},
        )

    def describe(self) -> dict[str, Any]:
        import psycopg

        data_dir = self.admin.setting("data_directory")
        fs = asdict(filesystem_of(Path(data_dir))) if Path(data_dir).exists() else None
        return {
            "url": self.url,
            "server": self.admin.show("server_version"),
            "synchronous_commit": self.effective_synchronous_commit,
            "synchronous_commit_server_default": self.admin.setting("synchronous_commit"),
            "fsync": self.admin.setting("fsync"),
            "wal_sync_method": self.admin.setting("wal_sync_method"),
            "full_page_writes": self.admin.setting("full_page_writes"),
            "commit_delay": self.admin.setting("commit_delay"),
            "data_directory": data_dir,
            "data_filesystem": fs,
            "psycopg": psycopg.__version__,
            "psycopg_impl": psycopg.pq.__impl__,
            "libpq": psycopg.pq.version(),
            "baseline": "async psycopg, one connection, not autocommit: INSERT then commit() "
            "(BEGIN, INSERT, COMMIT: 3 round trips) per op",
        }

    def close(self) -> None:
        for schema in list(self._schemas):
            self._drop(schema)
        self.admin.close()


def make_backend(
    key: str, sqlite_dir: str | None, postgres_url: str, synchronous_commit: str | None, work: Path
) -> Backend:
    if key == "sqlite":
        base, fs, why = choose_base(sqlite_dir)
        sqlite_work = Path(tempfile.mkdtemp(prefix="durably-bench-", dir=base))
        return SQLiteBackend(sqlite_work, fs, why)
    return PostgresBackend(postgres_url, synchronous_commit, work)
