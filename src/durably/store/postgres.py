"""The scale-out store: PostgreSQL through psycopg 3 (async) and psycopg_pool.

Many worker processes on many machines share one database. Claims use
``FOR UPDATE SKIP LOCKED`` so workers never queue behind each other's row locks; lease
times come from the server's ``now()``; workers sleep on ``LISTEN durably_runnable`` and
are woken by the ``NOTIFY`` sent in the transaction that makes a run runnable. Durability
is the server's: a commit returns once ``synchronous_commit`` says it is safe (``on`` by
default: flushed to the WAL on disk).

Round trips dominate the cost of a small transaction, so each transaction is sent as a
few multi-statement scripts (psycopg binds the parameters client-side and escapes them):
a commit is two round trips — ``BEGIN`` with every statement whose "no row matched" means
"refuse", then everything else with ``COMMIT`` — and a read is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from durably.errors import ApprovalExpired, InvalidTransition, StoreUnavailable
from durably.keys import plain_json
from durably.status import RunStatus
from durably.store.base import (
    CLAIMABLE,
    RUNNABLE,
    WAITING,
    Approval,
    Claim,
    Committed,
    Event,
    Expect,
    Journal,
    Lease,
    NewRun,
    OperationWrite,
    RunRecord,
    Store,
    StoredCheckpoint,
    Transition,
    approval_from_row,
    check_open,
    checkpoint_from_row,
    event_from_row,
    lease_lost,
    operation_from_row,
    pending_approval,
    run_from_row,
    shown_url,
    signal_from_row,
    step_from_row,
    wakes,
)
from durably.store.migrations import Migrator

_CLAIMABLE = [s.value for s in CLAIMABLE]
_NOW = "extract(epoch FROM now())"
CHANNEL = "durably_runnable"

AsyncConn = psycopg.AsyncConnection[dict[str, Any]]
Rows = list[dict[str, Any]]
Statement = tuple[str, tuple[Any, ...]]
T = TypeVar("T")


def _json_or_none(value: Any) -> str | None:
    return None if value is None else plain_json(value)


class _Sent:
    """Whether COMMIT has gone out: after that a failure leaves the outcome unknown."""

    commit = False


Work = Callable[[AsyncConn, _Sent], Awaitable[T]]


async def _script(db: AsyncConn, statements: Sequence[Statement]) -> list[Rows | None]:
    """Send ``statements`` in one round trip; the rows of each (None for non-queries).

    Pipeline mode: the extended protocol, with statements prepared by psycopg once they
    repeat, so the server plans each of durably's statements once per connection.
    """
    async with db.pipeline():
        cursors = [await db.execute(sql.encode(), params) for sql, params in statements]
    return [await c.fetchall() if c.description is not None else None for c in cursors]


async def _finish(db: AsyncConn, sent: _Sent, statements: Sequence[Statement]) -> list[Rows | None]:
    """The last round trip of a transaction: ``statements`` and COMMIT."""
    sent.commit = True
    return await _script(db, [*statements, ("COMMIT", ())])


class PostgresStore(Store):
    """Store on PostgreSQL; any number of worker processes may share it."""

    def __init__(self, url: str, *, pool_size: int = 10, connect_timeout_s: float = 10.0) -> None:
        self.url = url
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        # A pool belongs to the event loop that opened it: one per loop using this store.
        self._pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool[AsyncConn]] = {}
        # A LISTEN connection belongs to the task that waits on it (a worker's listener).
        self._listeners: dict[asyncio.Task[Any], AsyncConn] = {}
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
            # autocommit: every transaction is an explicit BEGIN ... COMMIT in our scripts.
            kwargs={"row_factory": dict_row, "autocommit": True},
            timeout=self.connect_timeout_s,
        )
        try:
            await pool.open(wait=True, timeout=self.connect_timeout_s)
        except Exception as exc:
            raise StoreUnavailable(f"cannot connect to {shown_url(self.url)}: {exc}") from exc
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
                async with pool.connection() as conn:
                    try:
                        return await work(conn, sent)
                    except BaseException:
                        if conn.info.transaction_status != TransactionStatus.IDLE:
                            with contextlib.suppress(psycopg.Error):
                                await conn.execute("ROLLBACK")
                        raise
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if attempt == 1 and (idempotent or not sent.commit):
                    await pool.check()
                    continue
                raise StoreUnavailable(
                    f"the database at {shown_url(self.url)} failed a transaction ({exc}); "
                    "the run is read back from the store before anything else happens"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read(self, sql: str, params: tuple[Any, ...] = ()) -> Rows:
        """One statement in autocommit: one round trip (reads, and writes safe to repeat)."""

        async def work(db: AsyncConn, sent: _Sent) -> Rows:
            (rows,) = await _script(db, [(sql, params)])
            return rows or []

        return await self._transact(work, idempotent=True)

    # -- schema -------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        return await asyncio.to_thread(Migrator("postgres", _MigrationTarget(self.url)).apply)

    async def close(self) -> None:
        """Close the connections opened from the running event loop."""
        loop = asyncio.get_running_loop()
        for task in list(self._listeners):
            if task.get_loop() is loop:
                self._drop_listener(task)
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()

    async def now(self) -> float:
        (row,) = await self._read(f"SELECT {_NOW} AS now")
        return float(row["now"])

    # -- runs ---------------------------------------------------------------------------

    async def create_run(self, new: NewRun) -> tuple[RunRecord, bool]:
        async def work(db: AsyncConn, sent: _Sent) -> tuple[RunRecord, bool]:
            _, inserted = await _script(
                db,
                [
                    ("BEGIN", ()),
                    (
                        "INSERT INTO durably_runs (run_id, tenant_id, workflow, "
                        "workflow_version, status, input_json, input_hash, key_scheme, "
                        "last_sequence, state_version, available_at, created_at, updated_at) "
                        f"VALUES (%s, %s, %s, %s, 'queued', %s, %s, %s, 1, 1, {_NOW}, {_NOW}, "
                        f"{_NOW}) "
                        "ON CONFLICT (run_id) DO NOTHING RETURNING *",
                        (
                            new.run_id,
                            new.tenant,
                            new.workflow,
                            new.workflow_version,
                            new.input_json,
                            new.input_hash,
                            new.key_scheme,
                        ),
                    ),
                ],
            )
            if inserted:
                payload = {"workflow": new.workflow, "version": new.workflow_version}
                await _finish(
                    db,
                    sent,
                    [
                        _event(new.run_id, 1, "run_started", None, payload),
                        (f"NOTIFY {CHANNEL}", ()),
                    ],
                )
                return run_from_row(inserted[0]), True
            existing, _ = await _finish(
                db, sent, [("SELECT * FROM durably_runs WHERE run_id = %s", (new.run_id,))]
            )
            assert existing
            return run_from_row(existing[0]), False

        # Idempotent: a retry after a lost COMMIT finds the run it created.
        return await self._transact(work, idempotent=True)

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
            f"status = 'running', available_at = {_NOW}, updated_at = {_NOW} "
            "FROM candidate c "
            "WHERE r.run_id = c.run_id "
            "RETURNING r.*, c.old_status, c.old_owner, c.old_until"
        )

        async def work(db: AsyncConn, sent: _Sent) -> Claim | None:
            sent_at = time.monotonic()
            _, claimed = await _script(
                db, [("BEGIN", ()), (sql, (_CLAIMABLE, *params, owner, ttl_s))]
            )
            if not claimed:
                await _finish(db, sent, [])
                return None
            row = claimed[0]
            # In flight under any owner (a dead worker, or this one after a cut connection):
            # its effects are reconciled before anything else.
            recovered = row["old_status"] != RunStatus.QUEUED and row["old_owner"] is not None
            run = run_from_row(row)
            statements: list[Statement] = []
            if recovered:
                payload = {"previous_owner": row["old_owner"], "lease_until": row["old_until"]}
                statements = [
                    (
                        "UPDATE durably_runs SET last_sequence = last_sequence + 1 "
                        "WHERE run_id = %s",
                        (run.run_id,),
                    ),
                    _event(run.run_id, run.last_sequence + 1, "run_recovered", None, payload),
                ]
            await _finish(db, sent, statements)
            return Claim(
                run=run,
                lease=Lease(run.run_id, owner, run.lease_epoch, ttl_s),
                recovered=recovered,
                previous_lease_until=row["old_until"] if recovered else None,
                sent_at=sent_at,
            )

        return await self._transact(work)

    async def heartbeat(self, lease: Lease) -> float:
        rows = await self._read(
            f"UPDATE durably_runs SET lease_until = {_NOW} + %s WHERE run_id = %s "
            "AND lease_owner = %s AND lease_epoch = %s RETURNING lease_until",
            (lease.ttl_s, lease.run_id, lease.owner, lease.epoch),
        )
        if not rows:
            raise lease_lost(lease)
        return float(rows[0]["lease_until"])

    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        async def work(db: AsyncConn, sent: _Sent) -> Committed:
            return await self._commit(db, sent, guard, transition)

        try:
            return await self._transact(work)
        except psycopg.errors.UniqueViolation as exc:
            raise InvalidTransition(
                f"a row of this transition already exists ({exc.diag.constraint_name}); it "
                "was recorded by another writer",
                run_id=guard.run_id,
            ) from exc

    async def _commit(
        self, db: AsyncConn, sent: _Sent, guard: Lease | Expect, t: Transition
    ) -> Committed:
        # Round trip 1: BEGIN, the fence, and a conditional operation update — the
        # statements whose "no row matched" means "refuse".
        if isinstance(guard, Lease):
            fence: Statement = (
                "UPDATE durably_runs SET last_sequence = last_sequence + %s, "
                "state_version = state_version + 1, "
                f"lease_until = CASE WHEN %s THEN NULL ELSE {_NOW} + %s END, "
                "lease_owner = CASE WHEN %s THEN NULL ELSE lease_owner END, "
                f"updated_at = {_NOW} WHERE run_id = %s AND lease_owner = %s "
                "AND lease_epoch = %s RETURNING last_sequence, state_version, lease_until, "
                "cancel_requested",
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
        else:
            fence = (
                "UPDATE durably_runs SET last_sequence = last_sequence + %s, "
                f"state_version = state_version + 1, updated_at = {_NOW} "
                "WHERE run_id = %s AND state_version = %s "
                f"AND (lease_owner IS NULL OR lease_until < {_NOW}) "
                "RETURNING last_sequence, state_version, lease_until, "
                "cancel_requested",
                (len(t.events), guard.run_id, guard.state_version),
            )
        o = t.operation
        conditional = o is not None and o.expect_row_version is not None
        first = [("BEGIN", ()), fence]
        if conditional:
            assert o is not None
            first.append(_operation(guard, o))
        if t.consume_signal is not None:
            first.append(
                (
                    "UPDATE durably_signals SET consumed_by = %s WHERE run_id = %s "
                    "AND event_id = %s AND consumed_by IS NULL RETURNING event_id",
                    (t.consume_signal[1], guard.run_id, t.consume_signal[0]),
                )
            )
        if t.use_approval is not None:
            a = t.use_approval
            first.append(
                (
                    f"UPDATE durably_approvals SET status = 'consumed', consumed_at = {_NOW} "
                    "WHERE approval_id = %s AND run_id = %s AND status = 'approved' "
                    f"AND expires_at > {_NOW} AND input_hash = %s "
                    "AND idempotency_key IS NOT DISTINCT FROM %s AND plan_version = %s "
                    "RETURNING approval_id",
                    (a.approval_id, guard.run_id, a.input_hash, a.idempotency_key, a.plan_version),
                )
            )
        results = await _script(db, first)
        if not results[1]:
            if isinstance(guard, Lease):
                raise lease_lost(guard)
            raise InvalidTransition(
                f"run {guard.run_id} changed or is held by a worker; read it again and retry",
                run_id=guard.run_id,
            )
        if t.use_approval is not None and not results.pop():
            raise ApprovalExpired(
                f"approval {t.use_approval.approval_id} is no longer usable (expired, used, "
                "or bound to another call); a new approval is needed",
                run_id=guard.run_id,
            )
        if t.consume_signal is not None and not results[-1]:
            raise InvalidTransition(
                f"event {t.consume_signal[0]} of run {guard.run_id} was already consumed",
                run_id=guard.run_id,
                step_id=t.consume_signal[1],
            )
        fenced = results[1]
        if not fenced:
            if isinstance(guard, Lease):
                raise lease_lost(guard)
            raise InvalidTransition(
                f"run {guard.run_id} changed or is held by a worker; read it again and retry",
                run_id=guard.run_id,
            )
        op_version = None
        if conditional:
            assert o is not None
            if not results[2]:
                raise InvalidTransition(
                    f"operation {o.idempotency_key} changed under us (expected row_version "
                    f"{o.expect_row_version}); another writer got there first",
                    run_id=o.run_id,
                    step_id=o.step_id,
                    idempotency_key=o.idempotency_key,
                )
            op_version = int(results[2][0]["row_version"])

        # Round trip 2: everything else, and COMMIT.
        last_sequence = int(fenced[0]["last_sequence"])
        state_version = int(fenced[0]["state_version"])
        rest = _second_round(
            guard, t, last_sequence, state_version, insert_operation=not conditional
        )
        if o is not None and not conditional:
            op_version = 1
        await _finish(db, sent, rest)
        return Committed(
            last_sequence,
            state_version,
            op_version,
            fenced[0]["lease_until"],
            int(fenced[0]["cancel_requested"]),
        )

    async def deliver_signal(
        self, run_id: str, event_id: str, name: str, payload_json: str
    ) -> bool:
        async def work(db: AsyncConn, sent: _Sent) -> bool:
            # The run row lock serialises this with the run's own commits (wake_on_signal).
            _, runs, inserted = await _script(
                db,
                [
                    ("BEGIN", ()),
                    (
                        "SELECT status, waiting_for_json FROM durably_runs WHERE run_id = %s "
                        "FOR UPDATE",
                        (run_id,),
                    ),
                    (
                        # Only for an existing, unfinished run (checked below, after the lock).
                        "INSERT INTO durably_signals (run_id, event_id, name, payload_json, "
                        f"received_at) SELECT run_id, %s, %s, %s, {_NOW} FROM durably_runs "
                        "WHERE run_id = %s AND status NOT IN ('completed', 'failed', 'cancelled') "
                        "ON CONFLICT (run_id, event_id) DO NOTHING RETURNING event_id",
                        (event_id, name, payload_json, run_id),
                    ),
                ],
            )
            check_open(run_id, runs[0] if runs else None)
            if not inserted:
                await _finish(db, sent, [])
                return False
            run = runs[0] if runs else {}
            due = wakes(run["status"], run["waiting_for_json"], name)
            payload = {"name": name, "event_id": event_id, "wakes_run": due}
            await _finish(
                db,
                sent,
                [
                    (
                        "UPDATE durably_runs SET last_sequence = last_sequence + 1, "
                        f"state_version = state_version + 1, updated_at = {_NOW}, "
                        "status = CASE WHEN %s THEN 'queued' ELSE status END, "
                        f"available_at = CASE WHEN %s THEN {_NOW} ELSE available_at END "
                        "WHERE run_id = %s",
                        (due, due, run_id),
                    ),
                    (
                        "INSERT INTO durably_events (run_id, sequence, type, step_id, "
                        "payload_json, created_at) SELECT run_id, last_sequence, "
                        f"'event_received', NULL, %s, {_NOW} FROM durably_runs WHERE run_id = %s",
                        (plain_json(payload), run_id),
                    ),
                    (f"NOTIFY {CHANNEL}", ()),
                ],
            )
            return True

        # Idempotent: a retry after a lost COMMIT finds the event and reports a duplicate.
        return await self._transact(work, idempotent=True)

    async def decide_approval(
        self,
        run_id: str,
        approval_id: str | None,
        decision: str,
        by: str,
        comment: str | None,
    ) -> tuple[Approval, bool]:
        async def work(db: AsyncConn, sent: _Sent) -> tuple[Approval, bool]:
            _, runs, rows, clock = await _script(
                db,
                [
                    ("BEGIN", ()),
                    ("SELECT status FROM durably_runs WHERE run_id = %s FOR UPDATE", (run_id,)),
                    (
                        "SELECT * FROM durably_approvals WHERE run_id = %s "
                        "AND (%s::text IS NULL OR approval_id = %s) ORDER BY requested_at",
                        (run_id, approval_id, approval_id),
                    ),
                    (f"SELECT {_NOW} AS now", ()),
                ],
            )
            check_open(run_id, runs[0] if runs else None)
            found = [approval_from_row(r) for r in rows or []]
            target = pending_approval(run_id, approval_id, found)
            expired = target.expires_at <= float(clock[0]["now"]) if clock else False
            status = "expired" if expired else decision
            payload = {"approval_id": target.approval_id, "decision": status, "by": by}
            updated, *_ = await _finish(
                db,
                sent,
                [
                    (
                        f"UPDATE durably_approvals SET status = %s, decided_at = {_NOW}, "
                        "decided_by = %s, comment = %s WHERE approval_id = %s RETURNING *",
                        (status, by, comment, target.approval_id),
                    ),
                    (
                        "UPDATE durably_runs SET last_sequence = last_sequence + 1, "
                        f"state_version = state_version + 1, updated_at = {_NOW}, "
                        "status = CASE WHEN status = 'waiting_approval' THEN 'queued' "
                        "ELSE status END, available_at = CASE WHEN status = 'waiting_approval' "
                        f"THEN {_NOW} ELSE available_at END WHERE run_id = %s",
                        (run_id,),
                    ),
                    (
                        "INSERT INTO durably_events (run_id, sequence, type, step_id, "
                        "payload_json, created_at) SELECT run_id, last_sequence, "
                        f"'approval_decided', %s, %s, {_NOW} FROM durably_runs "
                        "WHERE run_id = %s",
                        (target.step_id, plain_json(payload), run_id),
                    ),
                    (f"NOTIFY {CHANNEL}", ()),
                ],
            )
            assert updated
            return approval_from_row(updated[0]), expired

        return await self._transact(work)

    async def request_cancel(self, run_id: str, *, compensate: bool) -> RunRecord:
        async def work(db: AsyncConn, sent: _Sent) -> RunRecord:
            _, runs = await _script(
                db,
                [
                    ("BEGIN", ()),
                    ("SELECT status FROM durably_runs WHERE run_id = %s FOR UPDATE", (run_id,)),
                ],
            )
            check_open(run_id, runs[0] if runs else None)
            rows, _, _ = await _finish(
                db,
                sent,
                [
                    (
                        "UPDATE durably_runs SET cancel_requested = %s, "
                        f"state_version = state_version + 1, updated_at = {_NOW}, "
                        "status = CASE WHEN status IN ('waiting_external', 'waiting_approval', "
                        "'paused') THEN 'queued' ELSE status END, available_at = CASE WHEN "
                        f"lease_owner IS NULL OR lease_until < {_NOW} THEN {_NOW} "
                        "ELSE available_at END WHERE run_id = %s RETURNING *",
                        (2 if compensate else 1, run_id),
                    ),
                    (f"NOTIFY {CHANNEL}", ()),
                ],
            )
            assert rows
            return run_from_row(rows[0])

        return await self._transact(work, idempotent=True)

    async def unresolved_effects(self) -> dict[str, tuple[int, float]]:
        rows = await self._read(
            "SELECT tool_name, count(*) AS n, min(updated_at) AS since "
            "FROM durably_tool_operations WHERE status IN ('unknown', 'reconciling') "
            f"OR (status = 'executing' AND lease_until < {_NOW}) "
            "GROUP BY tool_name"
        )
        return {r["tool_name"]: (int(r["n"]), float(r["since"])) for r in rows}

    async def undelivered(
        self, consumer: str, limit: int, *, skip_runs: Sequence[str] = ()
    ) -> list[Event]:
        rows = await self._read(
            "SELECT * FROM durably_events e WHERE NOT EXISTS (SELECT 1 FROM durably_inbox i "
            "WHERE i.consumer = %s AND i.event_id = e.run_id || ':' || e.sequence) "
            "AND NOT (e.run_id = ANY(%s)) "
            "ORDER BY e.created_at, e.run_id, e.sequence LIMIT %s",
            (consumer, list(skip_runs), limit),
        )
        return [event_from_row(r) for r in rows]

    async def acknowledge(self, consumer: str, event_id: str) -> bool:
        rows = await self._read(
            "INSERT INTO durably_inbox (consumer, event_id, received_at) "
            f"VALUES (%s, %s, {_NOW}) ON CONFLICT (consumer, event_id) DO NOTHING "
            "RETURNING event_id",
            (consumer, event_id),
        )
        return bool(rows)

    # -- reads --------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        rows = await self._read("SELECT * FROM durably_runs WHERE run_id = %s", (run_id,))
        return run_from_row(rows[0]) if rows else None

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        rows = await self._read(
            "SELECT * FROM durably_runs WHERE (%s::text IS NULL OR status = %s) "
            "AND (%s::text IS NULL OR workflow = %s) "
            "ORDER BY created_at DESC, run_id LIMIT %s",
            (status, status, workflow, workflow, limit),
        )
        return [run_from_row(r) for r in rows]

    async def load_journal(self, run_id: str, *, checkpoints: int = 3) -> Journal | None:
        async def work(db: AsyncConn, sent: _Sent) -> Journal | None:
            # One round trip; REPEATABLE READ makes the four reads one moment's state.
            _, run, steps, ops, cps, signals, approvals, _ = await _script(
                db,
                [
                    ("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", ()),
                    ("SELECT * FROM durably_runs WHERE run_id = %s", (run_id,)),
                    ("SELECT * FROM durably_steps WHERE run_id = %s ORDER BY position", (run_id,)),
                    (
                        "SELECT o.* FROM durably_steps s "
                        "JOIN durably_runs r ON r.run_id = s.run_id "
                        "JOIN durably_tool_operations o "
                        "ON o.tenant_id = r.tenant_id AND o.idempotency_key = s.idempotency_key "
                        "WHERE s.run_id = %s",
                        (run_id,),
                    ),
                    (
                        "SELECT payload_json, checksum FROM durably_checkpoints "
                        "WHERE run_id = %s ORDER BY state_version DESC LIMIT %s",
                        (run_id, checkpoints),
                    ),
                    (
                        "SELECT * FROM durably_signals WHERE run_id = %s "
                        "AND consumed_by IS NULL ORDER BY received_at, event_id",
                        (run_id,),
                    ),
                    (
                        "SELECT * FROM durably_approvals WHERE run_id = %s ORDER BY requested_at",
                        (run_id,),
                    ),
                    ("COMMIT", ()),
                ],
            )
            if not run:
                return None
            return Journal(
                run=run_from_row(run[0]),
                steps=[step_from_row(r) for r in steps or []],
                operations=[operation_from_row(r) for r in ops or []],
                checkpoints=[checkpoint_from_row(r) for r in cps or []],
                signals=[signal_from_row(r) for r in signals or []],
                approvals=[approval_from_row(r) for r in approvals or []],
            )

        return await self._transact(work, idempotent=True)

    async def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        rows = await self._read(
            "SELECT * FROM durably_events WHERE run_id = %s AND sequence > %s ORDER BY sequence",
            (run_id, after),
        )
        return [event_from_row(r) for r in rows]

    async def checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        rows = await self._read(
            "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %s "
            "ORDER BY state_version DESC",
            (run_id,),
        )
        return [checkpoint_from_row(r) for r in rows]

    async def next_wakeup(self, workflows: list[str]) -> float | None:
        if not workflows:
            return None
        rows = await self._read(
            "SELECT min(greatest(available_at, coalesce(lease_until, 0))) AS due, "
            f"{_NOW} AS now FROM durably_runs WHERE status = ANY(%s) "
            "AND workflow || '|' || workflow_version = ANY(%s) "
            f"AND (lease_owner IS NULL OR lease_until < {_NOW})",
            (_CLAIMABLE, workflows),
        )
        if not rows or rows[0]["due"] is None:
            return None
        # Translate the server's clock into ours: callers sleep with time.time().
        return float(rows[0]["due"]) - float(rows[0]["now"]) + time.time()

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
            self.url, autocommit=True, row_factory=dict_row
        )
        try:
            await conn.execute(f"LISTEN {CHANNEL}")
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


def _second_round(
    guard: Lease | Expect,
    t: Transition,
    last_sequence: int,
    state_version: int,
    *,
    insert_operation: bool,
) -> list[Statement]:
    """The statements of a commit that cannot refuse it: they follow the fence."""
    rest: list[Statement] = []
    o = t.operation
    if o is not None and insert_operation:
        rest.append(_operation(guard, o))
    if t.run is not None:
        u = t.run
        rest.append(
            (
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
        )
    runnable = t.run is None or t.run.status in RUNNABLE
    if runnable and (t.release or (isinstance(guard, Expect) and t.run is not None)):
        # Delivered at COMMIT: sleeping workers wake for a run they can claim now.
        rest.append((f"NOTIFY {CHANNEL}", ()))
    if t.request_approval is not None:
        r = t.request_approval
        if r.replaces is not None:
            rest.append(
                (
                    f"UPDATE durably_approvals SET status = CASE WHEN expires_at <= {_NOW} "
                    "THEN 'expired' ELSE 'superseded' END WHERE approval_id = %s "
                    "AND status IN ('requested', 'approved')",
                    (r.replaces,),
                )
            )
        rest.append(
            (
                "INSERT INTO durably_approvals (approval_id, run_id, step_id, kind, name, "
                "payload_json, input_hash, idempotency_key, plan_version, status, "
                "requested_at, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, "
                f"'requested', {_NOW}, %s)",
                (
                    r.approval_id,
                    guard.run_id,
                    r.step_id,
                    r.kind,
                    r.name,
                    r.payload_json,
                    r.input_hash,
                    r.idempotency_key,
                    r.plan_version,
                    r.expires_at,
                ),
            )
        )
    if t.run is not None and t.run.status in WAITING:
        # A cancel requested while the run was still executing must not be lost behind a
        # wait: the run stays due, and its next execution cancels it.
        rest.append(
            (
                f"UPDATE durably_runs SET status = 'queued', available_at = {_NOW} "
                "WHERE run_id = %s AND cancel_requested > 0",
                (guard.run_id,),
            )
        )
    if t.plan_version is not None:
        rest.append(
            (
                "UPDATE durably_runs SET plan_version = %s WHERE run_id = %s",
                (t.plan_version, guard.run_id),
            )
        )
    if t.wake_on_signal is not None:
        # The run is about to wait for this event name: one that arrived meanwhile makes
        # it due at once (delivery locks the run row, so the two serialise).
        rest.append(
            (
                f"UPDATE durably_runs SET status = 'queued', available_at = {_NOW} "
                "WHERE run_id = %s AND EXISTS (SELECT 1 FROM durably_signals "
                "WHERE run_id = %s AND name = %s AND consumed_by IS NULL)",
                (guard.run_id, guard.run_id, t.wake_on_signal),
            )
        )
    start = last_sequence - len(t.events) + 1
    rest += [
        _event(guard.run_id, start + i, e.type, e.step_id, e.payload)
        for i, e in enumerate(t.events)
    ]
    if t.step is not None:
        s = t.step
        rest.append(
            (
                "INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, "
                "input_hash, output_json, error_json, idempotency_key, attempts, "
                "settled_sequence, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, "
                f"%s, %s, %s, %s, %s, %s, {_NOW}, {_NOW}) ON CONFLICT (run_id, step_id) "
                "DO UPDATE SET status = excluded.status, output_json = excluded.output_json, "
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
        )
    if t.checkpoint is not None:
        cp, payload_json = t.checkpoint.seal(
            state_version=state_version, last_event_sequence=last_sequence
        )
        rest.append(
            (
                "INSERT INTO durably_checkpoints (run_id, state_version, "
                "last_event_sequence, schema_version, payload_json, checksum, created_at) "
                f"VALUES (%s, %s, %s, %s, %s, %s, {_NOW})",
                (
                    cp.run_id,
                    cp.state_version,
                    cp.last_event_sequence,
                    cp.schema_version,
                    payload_json,
                    cp.checksum,
                ),
            )
        )
    return rest


def _event(
    run_id: str, sequence: int, type_: str, step_id: str | None, payload: dict[str, Any]
) -> Statement:
    return (
        "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at) "
        f"VALUES (%s, %s, %s, %s, %s, {_NOW})",
        (run_id, sequence, type_, step_id, plain_json(payload)),
    )


def _operation(guard: Lease | Expect, o: OperationWrite) -> Statement:
    """The operation's insert, or its conditional update (``RETURNING row_version``).

    An operation holding a lease holds the run's: same owner, epoch and expiry.
    """
    held = isinstance(guard, Lease) and o.hold_lease
    lease_sql = f"{_NOW} + %s" if held else "%s"
    lease: tuple[Any, ...] = (
        (guard.owner, guard.ttl_s, guard.epoch)
        if held and isinstance(guard, Lease)
        else (None, o.send_deadline, None)
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
        return (
            "INSERT INTO durably_tool_operations (status, result_json, error_json, "
            "failure_category, external_operation_id, attempt, lease_owner, lease_until, "
            "lease_epoch, tenant_id, idempotency_key, run_id, step_id, plan_version, "
            "tool_name, tool_version, input_hash, arguments_json, created_at, updated_at, "
            "row_version) VALUES (%s, %s, %s, %s, %s, %s, %s, "
            f"{lease_sql}, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {_NOW}, {_NOW}, 1)",
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
    return (
        "UPDATE durably_tool_operations SET status = %s, result_json = %s, "
        "error_json = %s, failure_category = %s, "
        "external_operation_id = coalesce(%s, external_operation_id), attempt = %s, "
        f"lease_owner = %s, lease_until = {lease_sql}, lease_epoch = %s, "
        f"updated_at = {_NOW}, row_version = row_version + 1 "
        "WHERE tenant_id = %s AND idempotency_key = %s AND row_version = %s "
        "RETURNING row_version",
        (*values, o.tenant, o.idempotency_key, o.expect_row_version),
    )


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
            raise StoreUnavailable(f"cannot migrate {shown_url(self.url)}: {exc}") from exc

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
