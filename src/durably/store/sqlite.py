"""The embedded store: one SQLite file, stdlib ``sqlite3``.

Statements run on the calling thread inside the ``async`` methods. A commit here costs one
fsync (~150 µs); SQLite serialises writers anyway, and a hop to a helper thread would cost
about as much as it could overlap, so the event loop simply waits for it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from durably.errors import (
    ApprovalExpired,
    ConfigurationError,
    InvalidTransition,
    StoreUnavailable,
)
from durably.keys import plain_json
from durably.status import RunStatus
from durably.store.base import (
    CLAIMABLE,
    WAITING,
    Approval,
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
from durably.store.migrations import Migrator, split_statements
from durably.store.sqlite_file import connect

# sqlite3 raises the base DatabaseError itself for a damaged file ("database disk image is
# malformed"); its subclasses other than OperationalError are about the statement.
_OUTAGES = (sqlite3.OperationalError, sqlite3.DatabaseError)
_CLAIMABLE_SQL = ", ".join(f"'{s.value}'" for s in CLAIMABLE)


def path_from_url(url: str) -> str:
    """``sqlite:///rel.db`` → ``rel.db``; ``sqlite:////abs.db`` → ``/abs.db``."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix) or "\x00" in url:
        raise ConfigurationError(
            f"not a SQLite URL: {url!r}; write sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    return url[len(prefix) :]


def _json_or_none(value: Any) -> str | None:
    return None if value is None else plain_json(value)


class SQLiteStore(Store):
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

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        # BEGIN IMMEDIATE takes the write lock up front, so two writers never deadlock
        # upgrading read locks, and a read-then-write (claims) is atomic.
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                if type(exc) not in _OUTAGES:
                    raise
                # Locked past the busy timeout, disk full, I/O error, a damaged file: not the
                # run's fault (a constraint or a programming error is, and is raised as is).
                # A failed COMMIT can leave the transaction open: close it, or every later
                # BEGIN would fail too.
                if self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                raise StoreUnavailable(f"{shown_url(self.url)}: {exc}") from exc

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.DatabaseError as exc:
                if type(exc) not in _OUTAGES:
                    raise
                raise StoreUnavailable(f"{shown_url(self.url)}: {exc}") from exc

    # -- schema -------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        return Migrator("sqlite", self).apply()

    def schema_version(self) -> int:
        with self._lock:
            exists = self._conn.execute(
                "SELECT 1 FROM sqlite_master WHERE name = 'durably_schema_migrations'"
            ).fetchone()
            if not exists:
                return 0
            row = self._conn.execute(
                "SELECT max(version) FROM durably_schema_migrations"
            ).fetchone()
            return int(row[0] or 0)

    def apply_migration(self, version: int, name: str, sql: str) -> bool:
        with self._tx() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS durably_schema_migrations ("
                "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            # Another process may have applied it while we waited for the write lock.
            if db.execute(
                "SELECT 1 FROM durably_schema_migrations WHERE version = ?", (version,)
            ).fetchone():
                return False
            for statement in split_statements(sql):
                db.execute(statement)
            db.execute(
                "INSERT INTO durably_schema_migrations (version, name, applied_at) "
                "VALUES (?, ?, ?)",
                (version, name, time.time()),
            )
        return True

    async def close(self) -> None:
        with self._lock:
            self._conn.close()

    async def now(self) -> float:
        return time.time()

    # -- runs ---------------------------------------------------------------------------

    async def create_run(self, new: NewRun) -> tuple[RunRecord, bool]:
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT * FROM durably_runs WHERE run_id = ?", (new.run_id,))
            existing = row.fetchone()
            if existing is not None:
                return run_from_row(existing), False
            db.execute(
                "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, "
                "status, input_json, input_hash, key_scheme, last_sequence, state_version, "
                "available_at, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, 1, 1, ?, ?, ?)",
                (
                    new.run_id,
                    new.tenant,
                    new.workflow,
                    new.workflow_version,
                    new.input_json,
                    new.input_hash,
                    new.key_scheme,
                    now,
                    now,
                    now,
                ),
            )
            payload = {"workflow": new.workflow, "version": new.workflow_version}
            self._insert_event(db, new.run_id, 1, "run_started", None, payload, now)
            created = db.execute("SELECT * FROM durably_runs WHERE run_id = ?", (new.run_id,))
            return run_from_row(created.fetchone()), True

    async def claim_run(self, run_id: str, owner: str, ttl_s: float) -> Claim | None:
        sent_at, now = time.monotonic(), time.time()
        with self._tx() as db:
            return self._claim(db, run_id, owner, ttl_s, now, sent_at)

    async def claim_next(self, owner: str, ttl_s: float, workflows: list[str]) -> Claim | None:
        if not workflows:
            return None
        sent_at, now = time.monotonic(), time.time()
        marks = ", ".join("?" for _ in workflows)
        with self._tx() as db:
            row = db.execute(
                f"SELECT run_id FROM durably_runs WHERE status IN ({_CLAIMABLE_SQL}) "
                f"AND available_at <= ? AND (lease_owner IS NULL OR lease_until < ?) "
                f"AND workflow || '|' || workflow_version IN ({marks}) "
                f"ORDER BY available_at, created_at LIMIT 1",
                (now, now, *workflows),
            ).fetchone()
            if row is None:
                return None
            return self._claim(db, row["run_id"], owner, ttl_s, now, sent_at)

    def _claim(
        self,
        db: sqlite3.Connection,
        run_id: str,
        owner: str,
        ttl_s: float,
        now: float,
        sent_at: float,
    ) -> Claim | None:
        before = db.execute(
            f"SELECT status, lease_owner, lease_until FROM durably_runs WHERE run_id = ? "
            f"AND status IN ({_CLAIMABLE_SQL}) AND available_at <= ? "
            f"AND (lease_owner IS NULL OR lease_until < ? OR lease_owner = ?)",
            (run_id, now, now, owner),
        ).fetchone()
        if before is None:
            return None
        # In flight under any owner (a dead worker, or this one after a failed commit): its
        # effects are reconciled before anything else.
        recovered = before["status"] != RunStatus.QUEUED and before["lease_owner"] is not None
        row = db.execute(
            "UPDATE durably_runs SET lease_owner = ?, lease_until = ?, "
            "lease_epoch = lease_epoch + 1, state_version = state_version + 1, "
            "status = 'running', available_at = ?, updated_at = ? "
            "WHERE run_id = ? RETURNING *",
            (owner, now + ttl_s, now, now, run_id),
        ).fetchone()
        run = run_from_row(row)
        if recovered:
            sequence = db.execute(
                "UPDATE durably_runs SET last_sequence = last_sequence + 1 WHERE run_id = ? "
                "RETURNING last_sequence",
                (run_id,),
            ).fetchone()[0]
            payload = {"previous_owner": before["lease_owner"], "lease_until": before[2]}
            self._insert_event(db, run_id, sequence, "run_recovered", None, payload, now)
        return Claim(
            run=run,
            lease=Lease(run_id, owner, run.lease_epoch, ttl_s),
            recovered=recovered,
            previous_lease_until=before["lease_until"] if recovered else None,
            sent_at=sent_at,
        )

    async def heartbeat(self, lease: Lease) -> float:
        until = time.time() + lease.ttl_s
        with self._tx() as db:
            cur = db.execute(
                "UPDATE durably_runs SET lease_until = ? WHERE run_id = ? AND lease_owner = ? "
                "AND lease_epoch = ?",
                (until, lease.run_id, lease.owner, lease.epoch),
            )
            if cur.rowcount != 1:
                raise lease_lost(lease)
        return until

    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        now = time.time()
        t = transition
        with self._tx() as db:
            lease_until: float | None = None
            if isinstance(guard, Lease):
                lease_until = None if t.release else now + guard.ttl_s
                fenced = db.execute(
                    "UPDATE durably_runs SET last_sequence = last_sequence + ?, "
                    "state_version = state_version + 1, lease_until = ?, "
                    "lease_owner = CASE WHEN ? THEN NULL ELSE lease_owner END, updated_at = ? "
                    "WHERE run_id = ? AND lease_owner = ? AND lease_epoch = ? "
                    "RETURNING last_sequence, state_version, cancel_requested",
                    (
                        len(t.events),
                        lease_until,
                        t.release,
                        now,
                        guard.run_id,
                        guard.owner,
                        guard.epoch,
                    ),
                ).fetchone()
                if fenced is None:
                    raise lease_lost(guard)
            else:
                fenced = db.execute(
                    "UPDATE durably_runs SET last_sequence = last_sequence + ?, "
                    "state_version = state_version + 1, updated_at = ? "
                    "WHERE run_id = ? AND state_version = ? "
                    "AND (lease_owner IS NULL OR lease_until < ?) "
                    "RETURNING last_sequence, state_version, cancel_requested",
                    (len(t.events), now, guard.run_id, guard.state_version, now),
                ).fetchone()
                if fenced is None:
                    raise InvalidTransition(
                        f"run {guard.run_id} changed or is held by a worker; read it again and "
                        "retry",
                        run_id=guard.run_id,
                    )
            last_sequence, state_version = int(fenced[0]), int(fenced[1])
            cancel_requested = int(fenced[2])
            if t.run is not None:
                u = t.run
                db.execute(
                    "UPDATE durably_runs SET status = ?, status_reason = ?, "
                    "result_json = coalesce(?, result_json), error_json = ?, "
                    "waiting_for_json = ?, available_at = coalesce(?, available_at) "
                    "WHERE run_id = ?",
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
            if t.run is not None and t.run.status in WAITING:
                # A cancel requested while the run was still executing must not be lost
                # behind a wait: the run stays due, and its next execution cancels it.
                db.execute(
                    "UPDATE durably_runs SET status = 'queued', available_at = ? "
                    "WHERE run_id = ? AND cancel_requested > 0",
                    (now, guard.run_id),
                )
            if t.plan_version is not None:
                db.execute(
                    "UPDATE durably_runs SET plan_version = ? WHERE run_id = ?",
                    (t.plan_version, guard.run_id),
                )
            if t.wake_on_signal is not None:
                # The run is about to wait for this event name: one that arrived meanwhile
                # makes it due at once (delivery and this commit serialise on the run).
                db.execute(
                    "UPDATE durably_runs SET status = 'queued', available_at = ? "
                    "WHERE run_id = ? AND EXISTS (SELECT 1 FROM durably_signals "
                    "WHERE run_id = ? AND name = ? AND consumed_by IS NULL)",
                    (now, guard.run_id, guard.run_id, t.wake_on_signal),
                )
            if t.use_approval is not None:
                a = t.use_approval
                used = db.execute(
                    "UPDATE durably_approvals SET status = 'consumed', consumed_at = ? "
                    "WHERE approval_id = ? AND run_id = ? AND status = 'approved' "
                    "AND expires_at > ? AND input_hash = ? AND idempotency_key IS ? "
                    "AND plan_version = ?",
                    (
                        now,
                        a.approval_id,
                        guard.run_id,
                        now,
                        a.input_hash,
                        a.idempotency_key,
                        a.plan_version,
                    ),
                )
                if used.rowcount != 1:
                    raise ApprovalExpired(
                        f"approval {a.approval_id} is no longer usable (expired, used, or "
                        "bound to another call); a new approval is needed",
                        run_id=guard.run_id,
                    )
            if t.request_approval is not None:
                r = t.request_approval
                if r.replaces is not None:
                    db.execute(
                        "UPDATE durably_approvals SET status = CASE WHEN expires_at <= ? "
                        "THEN 'expired' ELSE 'superseded' END WHERE approval_id = ? "
                        "AND status IN ('requested', 'approved')",
                        (now, r.replaces),
                    )
                db.execute(
                    "INSERT INTO durably_approvals (approval_id, run_id, step_id, kind, name, "
                    "payload_json, input_hash, idempotency_key, plan_version, status, "
                    "requested_at, expires_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'requested', ?, ?)",
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
                        now,
                        r.expires_at,
                    ),
                )
            if t.consume_signal is not None:
                event_id, step_id = t.consume_signal
                consumed = db.execute(
                    "UPDATE durably_signals SET consumed_by = ? WHERE run_id = ? "
                    "AND event_id = ? AND consumed_by IS NULL",
                    (step_id, guard.run_id, event_id),
                )
                if consumed.rowcount != 1:
                    raise InvalidTransition(
                        f"event {event_id} of run {guard.run_id} was already consumed",
                        run_id=guard.run_id,
                        step_id=step_id,
                    )
            first = last_sequence - len(t.events) + 1
            for offset, event in enumerate(t.events):
                self._insert_event(
                    db, guard.run_id, first + offset, event.type, event.step_id, event.payload, now
                )
            if t.step is not None:
                self._upsert_step(db, guard.run_id, t, last_sequence, now)
            op_version = None
            if t.operation is not None:
                op_version = self._write_operation(db, guard, t, now, lease_until)
            if t.checkpoint is not None:
                cp, payload_json = t.checkpoint.seal(
                    state_version=state_version, last_event_sequence=last_sequence
                )
                db.execute(
                    "INSERT INTO durably_checkpoints (run_id, state_version, "
                    "last_event_sequence, schema_version, payload_json, checksum, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        cp.run_id,
                        cp.state_version,
                        cp.last_event_sequence,
                        cp.schema_version,
                        payload_json,
                        cp.checksum,
                        now,
                    ),
                )
        return Committed(last_sequence, state_version, op_version, lease_until, cancel_requested)

    def _insert_event(
        self,
        db: sqlite3.Connection,
        run_id: str,
        sequence: int,
        type_: str,
        step_id: str | None,
        payload: dict[str, Any],
        now: float,
    ) -> None:
        db.execute(
            "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (run_id, sequence, type_, step_id, plain_json(payload), now),
        )

    def _upsert_step(
        self, db: sqlite3.Connection, run_id: str, t: Transition, last_sequence: int, now: float
    ) -> None:
        s = t.step
        assert s is not None
        db.execute(
            "INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, "
            "input_hash, output_json, error_json, idempotency_key, attempts, settled_sequence, "
            "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status, "
            "output_json = excluded.output_json, error_json = excluded.error_json, "
            "attempts = excluded.attempts, "
            "settled_sequence = coalesce(excluded.settled_sequence, settled_sequence), "
            "updated_at = excluded.updated_at",
            (
                run_id,
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
                now,
                now,
            ),
        )

    def _write_operation(
        self,
        db: sqlite3.Connection,
        guard: Lease | Expect,
        t: Transition,
        now: float,
        lease_until: float | None,
    ) -> int:
        o = t.operation
        assert o is not None
        held = isinstance(guard, Lease) and o.hold_lease
        lease = (
            (guard.owner, lease_until, guard.epoch)
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
            now,
        )
        if o.expect_row_version is None:
            try:
                db.execute(
                    "INSERT INTO durably_tool_operations (status, result_json, error_json, "
                    "failure_category, external_operation_id, attempt, lease_owner, "
                    "lease_until, lease_epoch, updated_at, tenant_id, idempotency_key, run_id, "
                    "step_id, plan_version, tool_name, tool_version, input_hash, "
                    "arguments_json, created_at, row_version) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
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
                        now,
                    ),
                )
            except sqlite3.IntegrityError as exc:
                raise InvalidTransition(
                    f"operation {o.idempotency_key} already exists; it was recorded by another "
                    "writer",
                    run_id=o.run_id,
                    step_id=o.step_id,
                    idempotency_key=o.idempotency_key,
                ) from exc
            return 1
        row = db.execute(
            "UPDATE durably_tool_operations SET status = ?, result_json = ?, error_json = ?, "
            "failure_category = ?, external_operation_id = coalesce(?, external_operation_id), "
            "attempt = ?, lease_owner = ?, lease_until = ?, lease_epoch = ?, updated_at = ?, "
            "row_version = row_version + 1 "
            "WHERE tenant_id = ? AND idempotency_key = ? AND row_version = ? "
            "RETURNING row_version",
            (*values, o.tenant, o.idempotency_key, o.expect_row_version),
        ).fetchone()
        if row is None:
            raise InvalidTransition(
                f"operation {o.idempotency_key} changed under us (expected row_version "
                f"{o.expect_row_version}); another writer got there first",
                run_id=o.run_id,
                step_id=o.step_id,
                idempotency_key=o.idempotency_key,
            )
        return int(row[0])

    async def deliver_signal(
        self, run_id: str, event_id: str, name: str, payload_json: str
    ) -> bool:
        now = time.time()
        with self._tx() as db:
            run = db.execute(
                "SELECT status, waiting_for_json FROM durably_runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            check_open(run_id, run)
            inserted = db.execute(
                "INSERT INTO durably_signals (run_id, event_id, name, payload_json, received_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id, event_id) DO NOTHING",
                (run_id, event_id, name, payload_json, now),
            ).rowcount
            if not inserted:
                return False
            due = wakes(run["status"], run["waiting_for_json"], name)
            sequence = db.execute(
                "UPDATE durably_runs SET last_sequence = last_sequence + 1, "
                "state_version = state_version + 1, updated_at = ?, "
                "status = CASE WHEN ? THEN 'queued' ELSE status END, "
                "available_at = CASE WHEN ? THEN ? ELSE available_at END "
                "WHERE run_id = ? RETURNING last_sequence",
                (now, due, due, now, run_id),
            ).fetchone()[0]
            payload = {"name": name, "event_id": event_id, "wakes_run": due}
            self._insert_event(db, run_id, sequence, "event_received", None, payload, now)
        return True

    async def decide_approval(
        self,
        run_id: str,
        approval_id: str | None,
        decision: str,
        by: str,
        comment: str | None,
    ) -> tuple[Approval, bool]:
        now = time.time()
        with self._tx() as db:
            run = db.execute(
                "SELECT status FROM durably_runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            check_open(run_id, run)
            rows = db.execute(
                "SELECT * FROM durably_approvals WHERE run_id = ? "
                "AND (? IS NULL OR approval_id = ?) ORDER BY requested_at",
                (run_id, approval_id, approval_id),
            ).fetchall()
            target = pending_approval(run_id, approval_id, [approval_from_row(r) for r in rows])
            expired = target.expires_at <= now
            status = "expired" if expired else decision
            row = db.execute(
                "UPDATE durably_approvals SET status = ?, decided_at = ?, decided_by = ?, "
                "comment = ? WHERE approval_id = ? RETURNING *",
                (status, now, by, comment, target.approval_id),
            ).fetchone()
            sequence = db.execute(
                "UPDATE durably_runs SET last_sequence = last_sequence + 1, "
                "state_version = state_version + 1, updated_at = ?, "
                "status = CASE WHEN status = 'waiting_approval' THEN 'queued' ELSE status END, "
                "available_at = CASE WHEN status = 'waiting_approval' THEN ? "
                "ELSE available_at END WHERE run_id = ? RETURNING last_sequence",
                (now, now, run_id),
            ).fetchone()[0]
            payload = {"approval_id": target.approval_id, "decision": status, "by": by}
            self._insert_event(
                db, run_id, sequence, "approval_decided", target.step_id, payload, now
            )
        return approval_from_row(row), expired

    async def request_cancel(self, run_id: str, *, compensate: bool) -> RunRecord:
        now = time.time()
        with self._tx() as db:
            run = db.execute(
                "SELECT status, waiting_for_json FROM durably_runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            check_open(run_id, run)
            row = db.execute(
                "UPDATE durably_runs SET cancel_requested = ?, state_version = state_version + 1, "
                "updated_at = ?, status = CASE WHEN status IN ('waiting_external', "
                "'waiting_approval', 'paused') THEN 'queued' ELSE status END, "
                "available_at = CASE WHEN lease_owner IS NULL OR lease_until < ? THEN ? "
                "ELSE available_at END WHERE run_id = ? RETURNING *",
                (2 if compensate else 1, now, now, now, run_id),
            ).fetchone()
        return run_from_row(row)

    async def unresolved_effects(self) -> dict[str, tuple[int, float]]:
        with self._reading() as db:
            rows = db.execute(
                "SELECT tool_name, count(*), min(updated_at) FROM durably_tool_operations "
                "WHERE status IN ('unknown', 'reconciling') "
                "OR (status = 'executing' AND lease_until < ?) GROUP BY tool_name",
                (time.time(),),
            ).fetchall()
        return {r[0]: (int(r[1]), float(r[2])) for r in rows}

    async def undelivered(
        self, consumer: str, limit: int, *, skip_runs: Sequence[str] = ()
    ) -> list[Event]:
        # One placeholder per skipped run: the SQL's shape depends on a count, not on input.
        marks = ", ".join("?" for _ in skip_runs)
        with self._reading() as db:
            rows = db.execute(
                "SELECT * FROM durably_events e WHERE NOT EXISTS (SELECT 1 FROM durably_inbox i "
                "WHERE i.consumer = ? AND i.event_id = e.run_id || ':' || e.sequence) "
                f"AND e.run_id NOT IN ({marks}) "
                "ORDER BY e.created_at, e.run_id, e.sequence LIMIT ?",
                (consumer, *skip_runs, limit),
            ).fetchall()
        return [event_from_row(r) for r in rows]

    async def acknowledge(self, consumer: str, event_id: str) -> bool:
        with self._tx() as db:
            return bool(
                db.execute(
                    "INSERT INTO durably_inbox (consumer, event_id, received_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (consumer, event_id) DO NOTHING",
                    (consumer, event_id, time.time()),
                ).rowcount
            )

    # -- reads --------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        with self._reading() as db:
            row = db.execute("SELECT * FROM durably_runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else run_from_row(row)

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        with self._reading() as db:
            rows = db.execute(
                "SELECT * FROM durably_runs WHERE (? IS NULL OR status = ?) "
                "AND (? IS NULL OR workflow = ?) ORDER BY created_at DESC, run_id LIMIT ?",
                (status, status, workflow, workflow, limit),
            ).fetchall()
        return [run_from_row(r) for r in rows]

    async def load_journal(self, run_id: str, *, checkpoints: int = 3) -> Journal | None:
        # A deferred transaction gives one consistent snapshot of the three tables.
        with self._reading():
            self._conn.execute("BEGIN")
            try:
                row = self._conn.execute(
                    "SELECT * FROM durably_runs WHERE run_id = ?", (run_id,)
                ).fetchone()
                if row is None:
                    return None
                steps = self._conn.execute(
                    "SELECT * FROM durably_steps WHERE run_id = ? ORDER BY position", (run_id,)
                ).fetchall()
                ops = self._conn.execute(
                    # Every operation has its step row (same transaction), so the steps'
                    # keys find them without an index on run_id to maintain per effect.
                    "SELECT o.* FROM durably_steps s JOIN durably_tool_operations o "
                    "ON o.tenant_id = ? AND o.idempotency_key = s.idempotency_key "
                    "WHERE s.run_id = ?",
                    (row["tenant_id"], run_id),
                ).fetchall()
                cps = self._conn.execute(
                    "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = ? "
                    "ORDER BY state_version DESC LIMIT ?",
                    (run_id, checkpoints),
                ).fetchall()
                approvals = self._conn.execute(
                    "SELECT * FROM durably_approvals WHERE run_id = ? ORDER BY requested_at",
                    (run_id,),
                ).fetchall()
                signals = self._conn.execute(
                    "SELECT * FROM durably_signals WHERE run_id = ? AND consumed_by IS NULL "
                    "ORDER BY received_at, event_id",
                    (run_id,),
                ).fetchall()
            finally:
                self._conn.execute("COMMIT")
        return Journal(
            run=run_from_row(row),
            steps=[step_from_row(s) for s in steps],
            operations=[operation_from_row(o) for o in ops],
            checkpoints=[checkpoint_from_row(c) for c in cps],
            signals=[signal_from_row(r) for r in signals],
            approvals=[approval_from_row(r) for r in approvals],
        )

    async def events(self, run_id: str, *, after: int = 0) -> list[Event]:
        with self._reading() as db:
            rows = db.execute(
                "SELECT * FROM durably_events WHERE run_id = ? AND sequence > ? ORDER BY sequence",
                (run_id, after),
            ).fetchall()
        return [event_from_row(r) for r in rows]

    async def checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        with self._reading() as db:
            rows = db.execute(
                "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = ? "
                "ORDER BY state_version DESC",
                (run_id,),
            ).fetchall()
        return [checkpoint_from_row(r) for r in rows]

    async def next_wakeup(self, workflows: list[str]) -> float | None:
        if not workflows:
            return None
        marks = ", ".join("?" for _ in workflows)
        now = time.time()
        with self._reading() as db:
            row = db.execute(
                f"SELECT min(max(available_at, coalesce(lease_until, 0))) FROM durably_runs "
                f"WHERE status IN ({_CLAIMABLE_SQL}) "
                f"AND workflow || '|' || workflow_version IN ({marks}) "
                f"AND (lease_owner IS NULL OR lease_until < ?)",
                (*workflows, now),
            ).fetchone()
        return None if row[0] is None else float(row[0])
