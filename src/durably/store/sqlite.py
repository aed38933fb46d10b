"""The embedded store: one SQLite file, stdlib ``sqlite3``.

Statements run on the event loop's thread. A commit here costs one fsync (~150 µs); SQLite
serialises writers anyway, and a hop to a helper thread would cost about as much as it could
overlap, so the event loop simply waits for it. What it can save is fsyncs: the writes that
the runs of one loop make at the same moment share one transaction (group commit), each
plan inside its own savepoint, so a refused plan undoes only its own writes.

What this backend adds to the plans of ``store.plans``: every transaction is one
``BEGIN IMMEDIATE ... COMMIT`` whose rounds run one after the other, and the store's clock
is this machine's, read once per transaction and bound as ``:now``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, NoReturn, TypeVar

from durably.errors import ConfigurationError, StoreUnavailable
from durably.store.base import shown_url
from durably.store.gathering import Gather
from durably.store.migrations import Migration, Migrator, refused, split_statements
from durably.store.plans import Plan, Query, Round, Rows
from durably.store.queries import numbered, queries
from durably.store.sqlite_file import connect
from durably.store.sqlstore import SQLStore

T = TypeVar("T")

# sqlite3 raises the base DatabaseError itself for a damaged file ("database disk image is
# malformed"); its subclasses other than OperationalError are about the statement.
_OUTAGES = (sqlite3.OperationalError, sqlite3.DatabaseError)
_PLACEHOLDER = re.compile(r"(?<![:\w]):(\w+)")


class _Statement(NamedTuple):
    sql: str
    values: Callable[[dict[str, Any]], tuple[Any, ...]]
    """The statement's parameters, in order, from a plan's parameters by name."""


def _numbered(sql: str) -> _Statement:
    """``:name`` becomes ``?N``: sqlite3 binds a dict at about a thousand instructions a
    parameter and a tuple at a tenth of that, some 25,000 instructions per step commit."""
    return _Statement(*numbered(sql, _PLACEHOLDER, "?"))


_SQL = {name: _numbered(sql) for name, sql in queries("sqlite").items()}


def _execute(db: sqlite3.Connection, query: Query, now: float) -> Rows:
    name, params = query
    statement = _SQL[name]
    params["now"] = now
    cursor = db.execute(statement.sql, statement.values(params))
    return cursor.fetchall() or [()] * cursor.rowcount


def _execute_plan(db: sqlite3.Connection, plan: Callable[[], Plan[T]], now: float) -> T:
    """Run every round of ``plan()`` in the transaction open on ``db``; its result."""
    steps = plan()
    sending = next(steps)
    while True:
        # Inline, not _execute(): this loop is the commit path's, once per statement.
        answers = []
        for name, params in sending.queries:
            statement = _SQL[name]
            params["now"] = now
            cursor = db.execute(statement.sql, statement.values(params))
            answers.append(cursor.fetchall() or [()] * cursor.rowcount)
        try:
            sending = steps.send(answers)
        except StopIteration as finished:
            result: T = finished.value
            return result


def _answer(
    done: asyncio.Future[Any], *, error: Exception | None = None, result: Any = None
) -> None:
    """Answer a write of a batch; its caller may have been cancelled meanwhile (Ctrl-C
    reaches asyncio's handler in the middle of a blocking statement): its outcome is then
    the store's alone."""
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _single(query: Query) -> Plan[Rows]:
    (rows,) = yield Round([query], final=True)
    return rows


def path_from_url(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs.db`` → ``/abs.db``."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix) or "\x00" in url:
        raise ConfigurationError(
            f"not a SQLite URL: {url!r}; write sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    if "?" in url or "#" in url:
        # Not a URI to SQLite: "db?mode=ro" would create a file of that very name.
        raise ConfigurationError(
            f"SQLite URL {url!r} holds a ? or #: durably takes no options in it (and needs "
            "to write the database); give the path alone, sqlite:///path.db"
        )
    return url[len(prefix) :]


class _Transaction:
    """``with store._tx() as db``: one transaction under the store's lock; an outage raises
    StoreUnavailable. A class, not a @contextmanager: this is every commit's path, and a
    generator-based one costs as much as a statement."""

    __slots__ = ("_begin", "_store")

    def __init__(self, store: SQLiteStore, begin: str) -> None:
        self._store = store
        self._begin = begin

    def __enter__(self) -> sqlite3.Connection:
        store = self._store
        store._lock.acquire()
        try:
            store._conn.execute(self._begin)
        except BaseException as exc:
            self._leave(exc)
        return store._conn

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            self._store._conn.execute("COMMIT" if exc is None else "ROLLBACK")
        except BaseException as failed:
            self._leave(failed)
        if exc is not None and type(exc) in _OUTAGES:
            self._leave(exc)
        # Committed, or rolled back for an error of the body's own, which goes on as it is.
        self._store._lock.release()

    def _leave(self, exc: BaseException) -> NoReturn:
        """Raise ``exc`` (StoreUnavailable for an outage) and let go of the lock."""
        store = self._store
        try:
            if type(exc) in _OUTAGES:
                raise store._unavailable(exc) from exc
            raise exc
        finally:
            store._lock.release()


class SQLiteStore(SQLStore):
    """Store on a SQLite file; several processes may share it (one writer at a time)."""

    def __init__(self, url: str, *, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        # Other processes may hold the write lock briefly: every statement, from the very
        # first, waits for it instead of failing. A missing directory is an error, not
        # created: a mistyped path must not become a new, empty database.
        self._conn = connect(path_from_url(url), url, busy_timeout_s)
        self._conn.row_factory = sqlite3.Row
        # One connection per store; the lock keeps a transaction whole if the store is
        # shared by threads (a CLI command while a worker thread runs, tests).
        self._lock = threading.RLock()
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[], Plan[Any]], Any]]]
        self._pending = {}

    def _tx(self, begin: str = "BEGIN IMMEDIATE") -> _Transaction:
        # BEGIN IMMEDIATE takes the write lock up front, so two writers never deadlock
        # upgrading read locks, and a read-then-write (claims) is atomic. A plain BEGIN
        # (deferred) is a read snapshot.
        return _Transaction(self, begin)

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        """Locked past the busy timeout, disk full, I/O error, a damaged file: not the run's
        fault (a constraint or a programming error is, and is raised as is)."""
        # A failed COMMIT can leave the transaction open: close it, or every later BEGIN
        # would fail too.
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
        return StoreUnavailable(f"{shown_url(self.url)}: {exc}")

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.DatabaseError as exc:
                if type(exc) not in _OUTAGES:
                    raise
                raise self._unavailable(exc) from exc

    # -- executing plans ----------------------------------------------------------------

    async def _run(
        self, plan: Callable[[], Plan[T]], *, idempotent: bool = False, read_only: bool = False
    ) -> T:
        if read_only:
            with self._tx("BEGIN") as db:
                return _execute_plan(db, plan, time.time())
        # Group commit: the writes of every run of this loop that are ready at the same
        # moment share one transaction, so one fsync, and each is answered once it is
        # durable. They are flushed when the loop next runs its callbacks, after every
        # task already woken has had its turn to queue its own (see _flush for more).
        loop = asyncio.get_running_loop()
        pending = self._pending.setdefault(loop, [])
        done: asyncio.Future[T] = loop.create_future()
        pending.append((plan, done))
        if len(pending) == 1:
            loop.call_soon(self._flush, loop)
        try:
            return await done
        except asyncio.CancelledError:
            if not done.done() or done.cancelled():
                raise  # withdrawn before its batch ran: nothing of it applied
            # Its batch ran: like a commit that cannot be interrupted, it reports what it
            # did, and the cancellation reaches the caller at its next await.
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            task.cancel()
            return done.result()

    def _flush(self, loop: asyncio.AbstractEventLoop, gather: Gather | None = None) -> None:
        # Runs woken one pass apart would otherwise commit in batches of their own forever
        # (each batch's answers wake its runs a pass after the other's): the flush waits
        # while writes keep joining (see store.gathering).
        gather = gather or Gather()
        if gather.waits(loop, len(self._pending.get(loop, ()))):
            loop.call_soon(self._flush, loop, gather)
            return
        batch = [(plan, done) for plan, done in self._pending.pop(loop, []) if not done.done()]
        if len(batch) == 1:
            plan, done = batch[0]
            try:
                with self._tx("BEGIN IMMEDIATE") as db:
                    result = _execute_plan(db, plan, time.time())
            except Exception as exc:
                _answer(done, error=exc)
            else:
                _answer(done, result=result)
            return
        outcomes: list[tuple[asyncio.Future[Any], Exception | None, Any]] = []
        try:
            with self._tx("BEGIN IMMEDIATE") as db:
                now = time.time()
                for plan, done in batch:
                    # A plan refused undoes only its own writes; an outage fails the batch.
                    db.execute("SAVEPOINT plan")
                    try:
                        outcomes.append((done, None, _execute_plan(db, plan, now)))
                    except Exception as exc:
                        if type(exc) in _OUTAGES:
                            raise
                        db.execute("ROLLBACK TO plan")
                        outcomes.append((done, exc, None))
                    db.execute("RELEASE plan")
        except Exception as exc:
            for _, done in batch:
                _answer(done, error=exc)
            return
        for done, error, result in outcomes:
            _answer(done, error=error, result=result)

    async def _one(self, name: str, params: dict[str, Any], *, write: bool = False) -> Rows:
        if write:
            # Heartbeats of many runs at once share a transaction like their commits do.
            return await self._run(lambda: _single((name, params)))
        with self._reading() as db:
            return _execute(db, (name, params), time.time())

    async def _ledger_rows(self) -> Rows:
        # Its GROUP BYs sort every unresolved operation and every reconciliation's event,
        # however many: this one read may spill its sort to a temporary file, which the
        # connection's temp_store=MEMORY (see sqlite_file) would keep in memory instead.
        with self._reading() as db:
            db.execute("PRAGMA temp_store=DEFAULT")
            try:
                return _execute(db, ("ledger_figures", {}), time.time())
            finally:
                db.execute("PRAGMA temp_store=MEMORY")

    def _pick(self, name: str, params: dict[str, Any]) -> Plan[Rows]:
        picked = yield from self._in_claim_order((name, params))
        if not picked:
            return []
        taken = yield Round([("take_lease", {**params, "run_id": p["run_id"]}) for p in picked])
        return [{**dict(t[0]), **dict(p)} for t, p in zip(taken, picked, strict=True)]

    def _in_claim_order(self, query: Query, *, final: bool = False) -> Plan[Rows]:
        # SQLite's planner takes the index in claim order (tests/store/test_queries.py).
        (rows,) = yield Round([query], final=final)
        return rows

    def _list(self, values: Sequence[str]) -> str:
        return json.dumps(list(values))

    async def now(self) -> float:
        return time.time()

    def close_ended_loops(self) -> None:
        return  # one connection for every loop, closed by close()

    # -- schema -------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        return Migrator("sqlite", self).apply()

    def schema_version(self) -> int:
        with self._lock:
            if not _execute(self._conn, ("migrations_table", {}), time.time()):
                return 0
            (row,) = _execute(self._conn, ("schema_version", {}), time.time())
            return int(row[0] or 0)

    def apply_migration(self, version: int, name: str, sql: str) -> bool:
        with self._tx() as db:
            now = time.time()
            _execute(db, ("create_migrations_table", {}), now)
            # Another process may have applied it while we waited for the write lock.
            if _execute(db, ("migration_applied", {"version": version}), now):
                return False
            self._schema_statements(db, sql, f"migration {version:04d}_{name}")
            _execute(db, ("record_migration", {"version": version, "name": name}), now)
        return True

    def create_schema(self, snapshot: str, applied: list[Migration]) -> bool:
        with self._tx() as db:
            now = time.time()
            # Another process may have created it while we waited for the write lock.
            if _execute(db, ("migrations_table", {}), now):
                return False
            self._schema_statements(db, snapshot, "creating its schema")
            for m in applied:
                _execute(db, ("record_migration", {"version": m.version, "name": m.name}), now)
        return True

    def _schema_statements(self, db: sqlite3.Connection, script: str, what: str) -> None:
        """``script``'s statements; a statement SQLite refuses (not a busy, full or damaged
        file: an outage) raises :func:`refused`."""
        try:
            for statement in split_statements(script):
                db.execute(statement)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            if type(exc) in _OUTAGES and (code is None or code & 0xFF != sqlite3.SQLITE_ERROR):
                raise
            raise refused(self.url, what, exc) from exc

    async def close(self) -> None:
        with self._lock:
            self._conn.close()
