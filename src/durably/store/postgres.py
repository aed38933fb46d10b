"""The scale-out store: PostgreSQL through psycopg 3 (async) and psycopg_pool.

Many worker processes on many machines share one database. Claims use
``FOR UPDATE SKIP LOCKED`` so workers never queue behind each other's row locks; lease
times come from the server's ``now()``; workers sleep on ``LISTEN durably_runnable`` and
are woken by the ``NOTIFY`` sent in the transaction that makes a run runnable. Durability
is the server's: a commit returns once ``synchronous_commit`` says it is safe (``on`` by
default: flushed to the WAL on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from durably.errors import InvalidTransition, StoreUnavailable
from durably.keys import plain_json
from durably.status import RunStatus
from durably.store.base import (
    RUNNABLE,
    Claim,
    Committed,
    Event,
    Expect,
    Journal,
    Lease,
    NewRun,
    RunRecord,
    Store,
    StoredCheckpoint,
    Transition,
    checkpoint_from_row,
    lease_lost,
    loads,
    operation_from_row,
    run_from_row,
    step_from_row,
)
from durably.store.migrations import Migrator

_RUNNABLE = [s.value for s in RUNNABLE]
_NOW = "extract(epoch FROM now())"
CHANNEL = "durably_runnable"

AsyncConn = psycopg.AsyncConnection[dict[str, Any]]


def _json_or_none(value: Any) -> str | None:
    return None if value is None else plain_json(value)


class PostgresStore(Store):
    """Store on PostgreSQL; any number of worker processes may share it."""

    def __init__(self, url: str, *, pool_size: int = 10, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        # A pool belongs to the event loop that opened it: one per loop using this store.
        self._pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool[AsyncConn]] = {}
        self._listeners: dict[asyncio.AbstractEventLoop, AsyncConn] = {}
        self._pool_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    # -- connections --------------------------------------------------------------------

    async def _get_pool(self) -> AsyncConnectionPool[AsyncConn]:
        loop = asyncio.get_running_loop()
        pool_of_loop = self._pools.get(loop)
        if pool_of_loop is not None:
            return pool_of_loop
        # Concurrent first uses (a worker's slots starting together) must share one pool.
        async with self._pool_locks.setdefault(loop, asyncio.Lock()):
            return self._pools.get(loop) or await self._open_pool(loop)

    async def _open_pool(self, loop: asyncio.AbstractEventLoop) -> AsyncConnectionPool[AsyncConn]:
        for dead in [other for other in self._pools if other.is_closed()]:
            del self._pools[dead]
            self._pool_locks.pop(dead, None)
        pool: AsyncConnectionPool[AsyncConn] = AsyncConnectionPool(
            self.url,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            kwargs={"row_factory": dict_row, "autocommit": False},
            # A server restart leaves dead connections in the pool; check on checkout.
            check=AsyncConnectionPool.check_connection,
            timeout=self.connect_timeout_s,
        )
        try:
            await pool.open(wait=True, timeout=self.connect_timeout_s)
        except Exception as exc:
            raise StoreUnavailable(f"cannot connect to {self.url}: {exc}") from exc
        self._pools[loop] = pool
        return pool

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[AsyncConn]:
        """One transaction: committed at the end of the block, rolled back on error."""
        pool = await self._get_pool()
        try:
            async with pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise StoreUnavailable(
                f"the database at {self.url} failed the transaction ({exc}); it was not "
                "applied, or (if the connection broke during COMMIT) it may have been: the run "
                "is read back from the store before anything else happens"
            ) from exc
        except psycopg.errors.SerializationFailure as exc:  # pragma: no cover - defensive
            raise InvalidTransition(f"concurrent update: {exc}") from exc

    # -- schema -------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        return await asyncio.to_thread(Migrator("postgres", _MigrationTarget(self.url)).apply)

    async def close(self) -> None:
        """Close the connections opened from the running event loop."""
        loop = asyncio.get_running_loop()
        listener = self._listeners.pop(loop, None)
        if listener is not None:
            with contextlib.suppress(psycopg.Error):
                await listener.close()
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()

    async def now(self) -> float:
        async with self._tx() as db:
            row = await (await db.execute(f"SELECT {_NOW} AS now")).fetchone()
            assert row is not None
            return float(row["now"])

    # -- runs ---------------------------------------------------------------------------

    async def create_run(self, new: NewRun) -> tuple[RunRecord, bool]:
        async with self._tx() as db:
            row = await (
                await db.execute(
                    "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, "
                    "status, input_json, input_hash, last_sequence, state_version, available_at, "
                    f"created_at, updated_at) VALUES (%s, %s, %s, %s, 'queued', %s, %s, 1, 1, "
                    f"{_NOW}, {_NOW}, {_NOW}) ON CONFLICT (run_id) DO NOTHING RETURNING *",
                    (
                        new.run_id,
                        new.tenant,
                        new.workflow,
                        new.workflow_version,
                        new.input_json,
                        new.input_hash,
                    ),
                )
            ).fetchone()
            if row is None:
                existing = await (
                    await db.execute("SELECT * FROM durably_runs WHERE run_id = %s", (new.run_id,))
                ).fetchone()
                assert existing is not None
                return run_from_row(existing), False
            payload = {"workflow": new.workflow, "version": new.workflow_version}
            await self._insert_event(db, new.run_id, 1, "run_started", None, payload)
            await db.execute(f"NOTIFY {CHANNEL}")
            return run_from_row(row), True

    async def claim_run(self, run_id: str, owner: str, ttl_s: float) -> Claim | None:
        return await self._claim(
            "run_id = %s AND (lease_owner IS NULL OR lease_until < {now} OR lease_owner = %s)",
            (run_id, owner),
            owner,
            ttl_s,
        )

    async def claim_next(self, owner: str, ttl_s: float, workflows: list[str]) -> Claim | None:
        if not workflows:
            return None
        return await self._claim(
            "workflow || '|' || workflow_version = ANY(%s) "
            "AND (lease_owner IS NULL OR lease_until < {now})",
            (workflows,),
            owner,
            ttl_s,
        )

    async def _claim(
        self, where: str, params: tuple[Any, ...], owner: str, ttl_s: float
    ) -> Claim | None:
        # SKIP LOCKED: a run another worker is claiming right now is passed over, not waited
        # for. The CTE keeps the previous lease so recovery of a dead worker's run is known.
        sql = (
            "WITH candidate AS (SELECT run_id, status AS old_status, lease_owner AS old_owner, "
            "lease_until AS old_until FROM durably_runs "
            f"WHERE status = ANY(%s) AND available_at <= {_NOW} AND "
            + where.format(now=_NOW)
            + " ORDER BY available_at, created_at LIMIT 1 FOR UPDATE SKIP LOCKED) "
            f"UPDATE durably_runs r SET lease_owner = %s, lease_until = {_NOW} + %s, "
            "lease_epoch = r.lease_epoch + 1, state_version = r.state_version + 1, "
            f"status = 'running', updated_at = {_NOW} FROM candidate c "
            "WHERE r.run_id = c.run_id "
            "RETURNING r.*, c.old_status, c.old_owner, c.old_until"
        )
        async with self._tx() as db:
            row = await (await db.execute(sql, (_RUNNABLE, *params, owner, ttl_s))).fetchone()
            if row is None:
                return None
            # In flight under any owner (a dead worker, or this one after a cut connection):
            # its effects are reconciled before anything else.
            recovered = row["old_status"] != RunStatus.QUEUED and row["old_owner"] is not None
            run = run_from_row(row)
            if recovered:
                seq = await (
                    await db.execute(
                        "UPDATE durably_runs SET last_sequence = last_sequence + 1 "
                        "WHERE run_id = %s RETURNING last_sequence",
                        (run.run_id,),
                    )
                ).fetchone()
                assert seq is not None
                payload = {"previous_owner": row["old_owner"], "lease_until": row["old_until"]}
                await self._insert_event(
                    db, run.run_id, seq["last_sequence"], "run_recovered", None, payload
                )
        return Claim(
            run=run, lease=Lease(run.run_id, owner, run.lease_epoch, ttl_s), recovered=recovered
        )

    async def heartbeat(self, lease: Lease) -> float:
        async with self._tx() as db:
            row = await (
                await db.execute(
                    f"UPDATE durably_runs SET lease_until = {_NOW} + %s WHERE run_id = %s "
                    "AND lease_owner = %s AND lease_epoch = %s RETURNING lease_until",
                    (lease.ttl_s, lease.run_id, lease.owner, lease.epoch),
                )
            ).fetchone()
            if row is None:
                raise lease_lost(lease)
            return float(row["lease_until"])

    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        t = transition
        try:
            async with self._tx() as db:
                return await self._commit(db, guard, t)
        except psycopg.errors.UniqueViolation as exc:
            raise InvalidTransition(
                f"a row of this transition already exists ({exc.diag.constraint_name}); it "
                "was recorded by another writer",
                run_id=guard.run_id,
            ) from exc

    async def _commit(self, db: AsyncConn, guard: Lease | Expect, t: Transition) -> Committed:
        lease_until: float | None = None
        if isinstance(guard, Lease):
            fenced = await (
                await db.execute(
                    "UPDATE durably_runs SET last_sequence = last_sequence + %s, "
                    "state_version = state_version + 1, "
                    f"lease_until = CASE WHEN %s THEN NULL ELSE {_NOW} + %s END, "
                    "lease_owner = CASE WHEN %s THEN NULL ELSE lease_owner END, "
                    f"updated_at = {_NOW} WHERE run_id = %s AND lease_owner = %s "
                    "AND lease_epoch = %s RETURNING last_sequence, state_version, lease_until",
                    (
                        len(t.events),
                        t.release,
                        guard.ttl_s,
                        t.release,
                        guard.run_id,
                        guard.owner,
                        guard.epoch,
                    ),
                )
            ).fetchone()
            if fenced is None:
                raise lease_lost(guard)
            lease_until = fenced["lease_until"]
        else:
            fenced = await (
                await db.execute(
                    "UPDATE durably_runs SET last_sequence = last_sequence + %s, "
                    f"state_version = state_version + 1, updated_at = {_NOW} "
                    "WHERE run_id = %s AND state_version = %s "
                    f"AND (lease_owner IS NULL OR lease_until < {_NOW}) "
                    "RETURNING last_sequence, state_version",
                    (len(t.events), guard.run_id, guard.state_version),
                )
            ).fetchone()
            if fenced is None:
                raise InvalidTransition(
                    f"run {guard.run_id} changed or is held by a worker; read it again and retry",
                    run_id=guard.run_id,
                )
        last_sequence, state_version = int(fenced["last_sequence"]), int(fenced["state_version"])
        if t.run is not None:
            u = t.run
            await db.execute(
                "UPDATE durably_runs SET status = %s, status_reason = %s, "
                "result_json = coalesce(%s, result_json), error_json = %s, "
                "waiting_for_json = %s, available_at = coalesce(%s, available_at) "
                "WHERE run_id = %s",
                (
                    u.status.value,
                    u.status_reason,
                    u.result_json,
                    _json_or_none(u.error),
                    _json_or_none(u.waiting_for),
                    u.available_at,
                    guard.run_id,
                ),
            )

        runnable = t.run is None or t.run.status in RUNNABLE
        if runnable and (t.release or (isinstance(guard, Expect) and t.run is not None)):
            # Delivered at COMMIT: sleeping workers wake for a run they can claim now.
            await db.execute(f"NOTIFY {CHANNEL}")
        first = last_sequence - len(t.events) + 1
        for offset, event in enumerate(t.events):
            await self._insert_event(
                db, guard.run_id, first + offset, event.type, event.step_id, event.payload
            )
        if t.step is not None:
            s = t.step
            await db.execute(
                "INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, "
                "input_hash, output_json, error_json, idempotency_key, attempts, "
                "settled_sequence, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, "
                f"%s, %s, %s, %s, %s, {_NOW}, {_NOW}) ON CONFLICT (run_id, step_id) DO UPDATE "
                "SET status = excluded.status, output_json = excluded.output_json, "
                "error_json = excluded.error_json, attempts = excluded.attempts, "
                "settled_sequence = coalesce(excluded.settled_sequence, "
                "durably_steps.settled_sequence), updated_at = excluded.updated_at",
                (
                    guard.run_id,
                    s.step_id,
                    s.position,
                    s.kind,
                    s.name,
                    s.status.value,
                    s.input_hash,
                    s.output_json,
                    _json_or_none(s.error),
                    s.idempotency_key,
                    s.attempts,
                    last_sequence if s.settle else None,
                ),
            )
        op_version = None
        if t.operation is not None:
            op_version = await self._write_operation(db, guard, t, lease_until)
        if t.checkpoint is not None:
            cp, payload_json = t.checkpoint.seal(
                state_version=state_version, last_event_sequence=last_sequence
            )
            await db.execute(
                "INSERT INTO durably_checkpoints (run_id, state_version, last_event_sequence, "
                f"schema_version, payload_json, checksum, created_at) VALUES (%s, %s, %s, %s, "
                f"%s, %s, {_NOW})",
                (
                    cp.run_id,
                    cp.state_version,
                    cp.last_event_sequence,
                    cp.schema_version,
                    payload_json,
                    cp.checksum,
                ),
            )
        return Committed(last_sequence, state_version, op_version, lease_until)

    async def _write_operation(
        self, db: AsyncConn, guard: Lease | Expect, t: Transition, lease_until: float | None
    ) -> int:
        o = t.operation
        assert o is not None
        held = isinstance(guard, Lease) and o.hold_lease
        lease = (
            (guard.owner, lease_until, guard.epoch)
            if held and isinstance(guard, Lease)
            else (None, None, None)
        )
        values = (
            o.status.value,
            o.result_json,
            _json_or_none(o.error),
            o.failure_category,
            o.external_operation_id,
            o.attempt,
            *lease,
        )
        if o.expect_row_version is None:
            await db.execute(
                "INSERT INTO durably_tool_operations (status, result_json, error_json, "
                "failure_category, external_operation_id, attempt, lease_owner, lease_until, "
                "lease_epoch, tenant_id, idempotency_key, run_id, step_id, plan_version, "
                "tool_name, tool_version, input_hash, arguments_json, created_at, updated_at, "
                "row_version) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
                f"%s, %s, %s, %s, {_NOW}, {_NOW}, 1)",
                (
                    *values,
                    o.tenant,
                    o.idempotency_key,
                    o.run_id,
                    o.step_id,
                    o.plan_version,
                    o.tool,
                    o.tool_version,
                    o.input_hash,
                    o.arguments_json,
                ),
            )
            return 1
        row = await (
            await db.execute(
                "UPDATE durably_tool_operations SET status = %s, result_json = %s, "
                "error_json = %s, failure_category = %s, "
                "external_operation_id = coalesce(%s, external_operation_id), attempt = %s, "
                "lease_owner = %s, lease_until = %s, lease_epoch = %s, "
                f"updated_at = {_NOW}, row_version = row_version + 1 "
                "WHERE tenant_id = %s AND idempotency_key = %s AND row_version = %s "
                "RETURNING row_version",
                (*values, o.tenant, o.idempotency_key, o.expect_row_version),
            )
        ).fetchone()
        if row is None:
            raise InvalidTransition(
                f"operation {o.idempotency_key} changed under us (expected row_version "
                f"{o.expect_row_version}); another writer got there first",
                run_id=o.run_id,
                step_id=o.step_id,
                idempotency_key=o.idempotency_key,
            )
        return int(row["row_version"])

    async def _insert_event(
        self,
        db: AsyncConn,
        run_id: str,
        sequence: int,
        type_: str,
        step_id: str | None,
        payload: dict[str, Any],
    ) -> None:
        await db.execute(
            "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, "
            f"created_at) VALUES (%s, %s, %s, %s, %s, {_NOW})",
            (run_id, sequence, type_, step_id, plain_json(payload)),
        )

    # -- reads --------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        async with self._tx() as db:
            row = await (
                await db.execute("SELECT * FROM durably_runs WHERE run_id = %s", (run_id,))
            ).fetchone()
        return None if row is None else run_from_row(row)

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        async with self._tx() as db:
            rows = await (
                await db.execute(
                    "SELECT * FROM durably_runs WHERE (%s::text IS NULL OR status = %s) "
                    "AND (%s::text IS NULL OR workflow = %s) "
                    "ORDER BY created_at DESC, run_id LIMIT %s",
                    (status, status, workflow, workflow, limit),
                )
            ).fetchall()
        return [run_from_row(r) for r in rows]

    async def load_journal(self, run_id: str, *, checkpoints: int = 3) -> Journal | None:
        async with self._tx() as db:
            # REPEATABLE READ: the run, its steps, operations and checkpoints as of one moment.
            await db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            row = await (
                await db.execute("SELECT * FROM durably_runs WHERE run_id = %s", (run_id,))
            ).fetchone()
            if row is None:
                return None
            steps = await (
                await db.execute(
                    "SELECT * FROM durably_steps WHERE run_id = %s ORDER BY position", (run_id,)
                )
            ).fetchall()
            ops = await (
                await db.execute(
                    "SELECT o.* FROM durably_steps s JOIN durably_tool_operations o "
                    "ON o.tenant_id = %s AND o.idempotency_key = s.idempotency_key "
                    "WHERE s.run_id = %s",
                    (row["tenant_id"], run_id),
                )
            ).fetchall()
            cps = await (
                await db.execute(
                    "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %s "
                    "ORDER BY state_version DESC LIMIT %s",
                    (run_id, checkpoints),
                )
            ).fetchall()
        return Journal(
            run=run_from_row(row),
            steps=[step_from_row(s) for s in steps],
            operations=[operation_from_row(o) for o in ops],
            checkpoints=[checkpoint_from_row(c) for c in cps],
        )

    async def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        async with self._tx() as db:
            rows = await (
                await db.execute(
                    "SELECT * FROM durably_events WHERE run_id = %s AND sequence > %s "
                    "ORDER BY sequence",
                    (run_id, after),
                )
            ).fetchall()
        return [
            Event(
                run_id=r["run_id"],
                sequence=r["sequence"],
                event_id=f"{r['run_id']}:{r['sequence']}",
                type=r["type"],
                step_id=r["step_id"],
                payload=loads(r["payload_json"]),
                created_at=r["created_at"],
            )
            for r in rows
        ]

    async def checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        async with self._tx() as db:
            rows = await (
                await db.execute(
                    "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %s "
                    "ORDER BY state_version DESC",
                    (run_id,),
                )
            ).fetchall()
        return [checkpoint_from_row(r) for r in rows]

    async def next_wakeup(self, workflows: list[str]) -> float | None:
        if not workflows:
            return None
        async with self._tx() as db:
            row = await (
                await db.execute(
                    "SELECT min(greatest(available_at, coalesce(lease_until, 0))) AS due, "
                    f"{_NOW} AS now FROM durably_runs WHERE status = ANY(%s) "
                    "AND workflow || '|' || workflow_version = ANY(%s) "
                    f"AND (lease_owner IS NULL OR lease_until < {_NOW})",
                    (_RUNNABLE, workflows),
                )
            ).fetchone()
        if row is None or row["due"] is None:
            return None
        # Translate the server's clock into ours: callers sleep with time.time().
        return float(row["due"]) - float(row["now"]) + time.time()

    async def wait_for_work(self, timeout_s: float) -> bool:
        """Sleep until a run may have become runnable (NOTIFY) or ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        try:
            listener = self._listeners.get(loop)
            if listener is None or listener.closed:
                listener = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, row_factory=dict_row
                )
                await listener.execute(f"LISTEN {CHANNEL}")
                self._listeners[loop] = listener
            async for _ in listener.notifies(timeout=timeout_s, stop_after=1):
                return True
        except psycopg.Error:
            # Lost the listening connection (server restart): poll until it comes back.
            self._listeners.pop(loop, None)
            await asyncio.sleep(timeout_s)
        return False


class _MigrationTarget:
    """Applies migrations over a plain connection, serialised by an advisory lock."""

    LOCK = 0x6475726162  # "durab": one lock id for every durably migrator

    def __init__(self, url: str) -> None:
        self.url = url

    @contextlib.contextmanager
    def _connect(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            with psycopg.connect(self.url) as conn:
                yield conn
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"cannot migrate {self.url}: {exc}") from exc

    def schema_version(self) -> int:
        with self._connect() as conn:
            exists = conn.execute(
                "SELECT to_regclass('durably_schema_migrations') IS NOT NULL"
            ).fetchone()
            if not exists or not exists[0]:
                return 0
            row = conn.execute("SELECT max(version) FROM durably_schema_migrations").fetchone()
            return int(row[0] or 0) if row else 0

    def apply_migration(self, version: int, name: str, sql: str) -> bool:
        with self._connect() as conn, conn.transaction():
            # Concurrent `durably migrate` calls queue here; the loser sees the version done.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.LOCK,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS durably_schema_migrations ("
                "version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                "applied_at DOUBLE PRECISION NOT NULL)"
            )
            done = conn.execute(
                "SELECT 1 FROM durably_schema_migrations WHERE version = %s", (version,)
            ).fetchone()
            if done:
                return False
            # A shipped migration file, never user input.
            conn.execute(sql.encode())
            conn.execute(
                "INSERT INTO durably_schema_migrations (version, name, applied_at) "
                f"VALUES (%s, %s, {_NOW})",
                (version, name),
            )
        return True
