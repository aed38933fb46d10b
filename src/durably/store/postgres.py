"""The scale-out store: PostgreSQL through psycopg 3 (async) and psycopg_pool.

Many worker processes on many machines share one database. Claims use
``FOR UPDATE SKIP LOCKED`` so workers never queue behind each other's row locks; lease
times come from the server's ``now()``; workers sleep on ``LISTEN durably_runnable`` and
are woken by the ``NOTIFY`` sent in the transaction that makes a run runnable. Durability
is the server's: a commit returns once ``synchronous_commit`` says it is safe (``on`` by
default: flushed to the WAL on disk).

Round trips dominate the cost of a small transaction, so each round of a plan
(``store.plans``) goes out as one pipeline of prepared statements (:mod:`.pg_wire`):
``BEGIN`` goes with the first round and ``COMMIT`` with the final one, and a plan of one
round needs neither. A step's commit is one statement in one round trip; a commit that
refuses on what it reads is two — ``BEGIN`` with every statement whose "no row matched"
means "refuse", then everything else with ``COMMIT`` — and a read is one. Plans of one
round that are ready at the same moment share a round (group commit, :mod:`.pg_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from durably.errors import ConfigurationError, InvalidTransition, StoreUnavailable
from durably.store import pg_wire
from durably.store.base import (
    Committed,
    Expect,
    Lease,
    Transition,
    shown_url,
    without_secrets,
)
from durably.store.migrations import Migration, Migrator, refused
from durably.store.pg_group import Gathering, Write
from durably.store.pg_pool import Pool
from durably.store.pg_wire import send_round
from durably.store.plans import Plan, Query, Round, Rows
from durably.store.queries import queries
from durably.store.sqlstore import SQLStore

AsyncConn = psycopg.AsyncConnection[dict[str, Any]]
Statement = tuple[pg_wire.Statement, dict[str, Any] | None]
T = TypeVar("T")

_TEXT = {name: sql.encode() for name, sql in queries("postgres").items()}
"""For psycopg's own ``execute``: LISTEN, and migrations on their plain connection."""
_SQL = {name: pg_wire.statement(sql) for name, sql in queries("postgres").items()}
_BEGIN: Statement = (pg_wire.statement("BEGIN"), None)
_SNAPSHOT: Statement = (pg_wire.statement("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"), None)
_COMMIT: Statement = (pg_wire.statement("COMMIT"), None)
_NOTIFY: Statement = (_SQL["notify"], None)
_FORGOTTEN = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.FeatureNotSupported)
"""A round's statement the server no longer holds as it was prepared (``pg_wire._forget``)."""


class _Sent:
    """Whether COMMIT has gone out: after that a failure leaves the outcome unknown."""

    commit = False


Work = Callable[[AsyncConn, _Sent], Awaitable[T]]


class PostgresStore(SQLStore):
    """Store on PostgreSQL; any number of worker processes may share it."""

    _data_modifying_with = True

    def __init__(self, url: str, *, pool_size: int = 10, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self.pool_size = pool_size
        # Every connection's own too: a server that accepts TCP and never answers (stopped,
        # or a black hole) must fail the attempt, not hang it. The URL's connect_timeout wins
        # (also for how long a transaction waits for a pooled connection).
        given = conninfo_to_dict(url).get("connect_timeout")
        if given is not None:
            try:
                connect_timeout_s = int(given)
            except ValueError:
                raise ConfigurationError(
                    f"connect_timeout={given!r} in {shown_url(url)}: give whole seconds"
                ) from None
        self.connect_timeout_s = connect_timeout_s
        self._connect_timeout = max(1, math.ceil(connect_timeout_s))
        # A pool belongs to the event loop that opened it: one per loop using this store.
        self._pools: dict[asyncio.AbstractEventLoop, Pool] = {}
        # A LISTEN connection belongs to the task that waits on it (a worker's listener).
        self._listeners: dict[asyncio.Task[Any], AsyncConn] = {}
        self._pool_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._gathering = Gathering(self._together, self._alone)

    # -- connections --------------------------------------------------------------------

    async def _get_pool(self) -> Pool:
        loop = asyncio.get_running_loop()
        pool_of_loop = self._pools.get(loop)
        if pool_of_loop is not None:
            return pool_of_loop
        # Concurrent first uses (a worker's slots starting together) must share one pool.
        async with self._pool_locks.setdefault(loop, asyncio.Lock()):
            return self._pools.get(loop) or await self._open_pool(loop)

    def close_ended_loops(self) -> None:
        """Close the connections of the pools of event loops that have ended."""
        for ended in [other for other in self._pools if other.is_closed()]:
            self._pools.pop(ended).abandon()
            self._pool_locks.pop(ended, None)

    async def _open_pool(self, loop: asyncio.AbstractEventLoop) -> Pool:
        self.close_ended_loops()
        pool = Pool(
            self.url,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            # autocommit: every transaction is an explicit BEGIN ... COMMIT in our scripts.
            # prepare_threshold: psycopg's own statement cache would prepare the store's
            # ROLLBACKs and may DEALLOCATE ALL, taking pg_wire's statements with it.
            kwargs={
                "row_factory": dict_row,
                "autocommit": True,
                "prepare_threshold": None,
                "connect_timeout": self._connect_timeout,
            },
            configure=_bound_lock_waits,
            timeout=self.connect_timeout_s,
        )
        try:
            await pool.open(wait=True, timeout=self.connect_timeout_s)
        except BaseException as exc:
            # Not kept, so never closed by close(): its workers would outlive the store.
            await pool.close()
            if not isinstance(exc, Exception):
                raise  # cancelled (a caller's timeout, Ctrl-C)
            raise StoreUnavailable(
                f"cannot connect to {shown_url(self.url)}: {without_secrets(str(exc), self.url)}"
            ) from exc
        self._pools[loop] = pool
        return pool

    async def _transact(self, work: Work[T], *, idempotent: bool = False) -> T:
        """Run ``work`` on a pooled connection; ``work`` sends BEGIN ... COMMIT itself.

        Connections left broken in the pool by a server restart fail on their first round
        trip, before anything was applied: then the pool is checked and the work retried
        once. After COMMIT was sent the outcome is unknown, so only ``idempotent`` work is
        retried then; anything else surfaces as :class:`StoreUnavailable` and the run is
        read back from the store before anything else happens.
        """
        pool = await self._get_pool()
        for attempt in (1, 2):
            sent = _Sent()
            try:
                # Not pool.connection(): its context also enters the connection's own, a
                # COMMIT that autocommit makes a no-op but still costs a lock and a wait.
                # _attempt rolls back what failed; putconn discards a broken connection.
                conn = await pool.getconn()
                try:
                    return await self._attempt(conn, work, sent)
                finally:
                    await pool.putconn(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if attempt == 1 and (idempotent or not sent.commit):
                    await pool.check()
                    continue
                raise StoreUnavailable(
                    f"the database at {shown_url(self.url)} failed a transaction ({exc}); "
                    "the run is read back from the store before anything else happens"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    async def _attempt(conn: AsyncConn, work: Work[T], sent: _Sent) -> T:
        """``work`` on ``conn``, rolled back if it fails. Refused because the server no
        longer held a statement of a round as it was prepared (see ``pg_wire._forget``),
        it goes once more on the same connection, where pg_wire now prepares it again —
        the pool's other connections may hold it as it was too. The refused round applied
        nothing, its COMMIT included."""
        for again in (False, True):
            try:
                return await work(conn, sent)
            except BaseException as exc:
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    with contextlib.suppress(psycopg.Error):
                        await conn.execute("ROLLBACK")
                if again or not isinstance(exc, _FORGOTTEN):
                    raise
                sent.commit = False
        raise AssertionError("unreachable")  # pragma: no cover

    # -- executing plans ----------------------------------------------------------------

    async def _run(
        self, plan: Callable[[], Plan[T]], *, idempotent: bool = False, read_only: bool = False
    ) -> T:
        if read_only:
            work = self._work(plan, None, read_only=True)
            return await self._transact(work, idempotent=idempotent)
        steps, first = _begun(plan)
        if first.final:
            result: T = await self._gathering.write(Write(plan, steps, first, idempotent))
            return result
        return await self._transact(self._work(plan, (steps, first)), idempotent=idempotent)

    def _work(
        self,
        plan: Callable[[], Plan[T]],
        started: tuple[Plan[T], Round] | None,
        *,
        read_only: bool = False,
    ) -> Work[T]:
        """``plan`` in one transaction: going on from ``started`` (its first round, already
        drafted) the first time, afresh on a second attempt."""

        async def work(db: AsyncConn, sent: _Sent) -> T:
            nonlocal started
            steps, sending = started or _begun(plan)
            started = None
            # A write of one round needs no BEGIN and COMMIT: a pipeline's statements up to
            # its Sync are one implicit transaction, committed at the Sync, rolled back
            # whole if one fails (tests/contract/test_store.py holds this to account).
            implicit = sending.final and not read_only
            opening = [] if implicit else [_SNAPSHOT if read_only else _BEGIN]
            while True:
                closing = []
                if sending.final:
                    closing = [_NOTIFY] if sending.notify else []
                    if not implicit:
                        closing.append(_COMMIT)
                    sent.commit = True
                statements = [(_SQL[name], params) for name, params in sending.queries]
                rows = await send_round(db, [*opening, *statements, *closing])
                answers = rows[len(opening) : len(opening) + len(statements)]
                opening = []
                try:
                    sending = steps.send(answers)
                except StopIteration as done:
                    if not sending.final:  # nothing more to write: COMMIT alone
                        sent.commit = True
                        await send_round(db, [_COMMIT])
                    result: T = done.value
                    return result

        return work

    async def _together(self, queries: list[Query], notify: bool) -> list[Rows]:
        """The one-round writes of several runs as one round (see :mod:`.pg_group`)."""
        statements: list[Statement] = [(_SQL[name], params) for name, params in queries]
        if notify:
            statements.append(_NOTIFY)

        async def work(db: AsyncConn, sent: _Sent) -> list[Rows]:
            sent.commit = True
            return await send_round(db, statements)

        return await self._transact(work)

    async def _alone(self, write: Write) -> Any:
        work = self._work(write.plan, write.started())
        return await self._transact(work, idempotent=write.idempotent)

    async def _one(self, name: str, params: dict[str, Any], *, write: bool = False) -> Rows:
        """In autocommit: one round trip (reads, and single writes safe to repeat)."""

        async def work(db: AsyncConn, sent: _Sent) -> Rows:
            (rows,) = await send_round(db, [(_SQL[name], params)])
            return rows

        return await self._transact(work, idempotent=True)

    def _pick(self, name: str, params: dict[str, Any]) -> Plan[Rows]:
        if name != "claim_batch":
            (claimed,) = yield Round([(name, params)])
            return claimed
        return (yield from self._in_claim_order((name, params)))

    def _in_claim_order(self, query: Query, *, final: bool = False) -> Plan[Rows]:
        # For this statement only (see claim_in_index_order).
        _, rows, _ = yield Round(
            [("claim_in_index_order", {}), query, ("claim_done_in_index_order", {})], final=final
        )
        return rows

    def _list(self, values: Sequence[str]) -> list[str]:
        return list(values)

    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        try:
            return await super().commit(guard, transition)
        except psycopg.errors.UniqueViolation as exc:
            raise InvalidTransition(
                f"a row of this transition already exists ({exc.diag.constraint_name}); it "
                "was recorded by another writer",
                run_id=guard.run_id,
            ) from exc

    # -- schema -------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        def apply() -> list[int]:
            with _MigrationTarget(self.url, self._connect_timeout) as target:
                return Migrator("postgres", target).apply()

        return await asyncio.to_thread(apply)

    async def close(self) -> None:
        """Close the connections opened from the running event loop, and those of event
        loops that have ended."""
        loop = asyncio.get_running_loop()
        for task in list(self._listeners):
            if task.get_loop() is loop:
                self._drop_listener(task)
        self.close_ended_loops()
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()

    async def wait_for_work(self, timeout_s: float) -> bool:
        """Sleep until a run may have become runnable (NOTIFY) or ``timeout_s`` passes.

        The calling task gets its own LISTEN connection, closed when that task ends.
        """
        task = asyncio.current_task()
        assert task is not None, "wait_for_work runs in a task"
        try:
            listener = self._listeners.get(task)
            if listener is None:
                listener = await self._listen(task)
            async with contextlib.aclosing(
                listener.notifies(timeout=timeout_s, stop_after=1)
            ) as notifies:
                async for _ in notifies:
                    return True
        except psycopg.Error:
            # Lost the listening connection (server restart): poll until it comes back.
            self._drop_listener(task)
            await asyncio.sleep(timeout_s)
        return False

    async def _listen(self, task: asyncio.Task[Any]) -> AsyncConn:
        conn = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, row_factory=dict_row, connect_timeout=self._connect_timeout
        )
        try:
            await conn.execute(_TEXT["listen"])
        except BaseException:
            # Cancelled (the worker is stopping) or failed before anyone else held it.
            await conn.close()
            raise
        self._listeners[task] = conn
        # However the task ends (returns, cancelled anywhere, fails) its connection goes.
        task.add_done_callback(self._drop_listener)
        return conn

    def _drop_listener(self, task: asyncio.Task[Any]) -> None:
        task.remove_done_callback(self._drop_listener)
        listener = self._listeners.pop(task, None)
        if listener is not None:
            # What close() does for a connection outside a pool; a done callback cannot await.
            listener.pgconn.finish()


LOCK_TIMEOUT = "30s"
"""How long a statement waits for a row lock (another session holding a run's row in an
open transaction) before it fails as an outage: what SQLite's busy timeout is to its file
lock. A lock_timeout the URL sets (``options=-c lock_timeout=...``) is kept."""


async def _bound_lock_waits(conn: AsyncConn) -> None:
    await conn.execute(_TEXT["bound_lock_waits"], {"lock_timeout": LOCK_TIMEOUT})


def _begun(plan: Callable[[], Plan[T]]) -> tuple[Plan[T], Round]:
    """A fresh ``plan()`` and its first round."""
    steps = plan()
    return steps, next(steps)


class _MigrationTarget:
    """Applies migrations in a ``with`` block, over one plain connection for all of them (a
    connection costs more than most migrations), serialised by an advisory lock."""

    LOCK = 0x6475726162  # "durab": one lock id for every durably migrator

    def __init__(self, url: str, connect_timeout: int) -> None:
        self.url = url
        self.connect_timeout = connect_timeout
        self._shared: psycopg.Connection[Any] | None = None

    def __enter__(self) -> _MigrationTarget:
        try:
            # Autocommit: reads start no transaction, and each migration's is its own.
            self._shared = psycopg.connect(
                self.url, autocommit=True, connect_timeout=self.connect_timeout
            )
        except psycopg.OperationalError as exc:
            raise self._unavailable(exc) from exc
        return self

    def __exit__(self, *exc: object) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()

    @contextlib.contextmanager
    def _connect(self) -> Iterator[psycopg.Connection[Any]]:
        assert self._shared is not None, "a _MigrationTarget is used in a with block"
        try:
            yield self._shared
        except psycopg.OperationalError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: psycopg.OperationalError) -> StoreUnavailable:
        return StoreUnavailable(
            f"cannot migrate {shown_url(self.url)}: {without_secrets(str(exc), self.url)}"
        )

    def schema_version(self) -> int:
        with self._connect() as conn:
            exists = conn.execute(_TEXT["migrations_table"]).fetchone()
            if not exists or not exists[0]:
                return 0
            row = conn.execute(_TEXT["schema_version"]).fetchone()
            return int(row[0] or 0) if row else 0

    def apply_migration(self, version: int, name: str, sql: str) -> bool:
        with self._connect() as conn, conn.transaction():
            # Concurrent `durably migrate` calls queue here; the loser sees the version done.
            conn.execute(_TEXT["migration_lock"], {"lock": self.LOCK})
            conn.execute(_TEXT["create_migrations_table"])
            if conn.execute(_TEXT["migration_applied"], {"version": version}).fetchone():
                return False
            self._schema_statements(conn, sql, f"migration {version:04d}_{name}")
            conn.execute(_TEXT["record_migration"], {"version": version, "name": name})
        return True

    def create_schema(self, snapshot: str, applied: list[Migration]) -> bool:
        with self._connect() as conn, conn.transaction():
            conn.execute(_TEXT["migration_lock"], {"lock": self.LOCK})
            row = conn.execute(_TEXT["migrations_table_committed"]).fetchone()
            if row is None or row[0]:
                return False
            self._schema_statements(conn, snapshot, "creating its schema")
            for m in applied:
                conn.execute(_TEXT["record_migration"], {"version": m.version, "name": m.name})
        return True

    def _schema_statements(self, conn: psycopg.Connection[Any], script: str, what: str) -> None:
        """``script``, a shipped migration or snapshot (never user input); a statement the
        server refuses (not a lost connection: an outage) raises :func:`refused`."""
        try:
            conn.execute(script.encode())
        except psycopg.OperationalError:
            raise
        except psycopg.Error as exc:
            raise refused(shown_url(self.url), what, exc) from exc
