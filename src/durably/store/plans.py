"""The store's transactions, written once: which named statements run, in which order, with
which parameters, and what their rows must show for the transaction to apply.

A plan is a generator. It yields a :class:`Round` of queries, receives their rows, and
decides what follows (another round, a refusal, or its result). A backend only executes
plans: SQLite runs every round inside one ``BEGIN IMMEDIATE ... COMMIT`` on its own clock;
PostgreSQL sends each round as one round trip, ``BEGIN`` with the first and ``COMMIT`` with
the final one, on the server's clock. So a round is a PostgreSQL round trip, and a plan has
as many as its decisions need: a commit has two — first every statement whose "no row
matched" refuses the transaction, then everything that follows from the fence.

Statement names are those of ``sql/<backend>/queries.sql``. Parameters are named like the
fields of the records they come from, so ``vars(record)`` fills a statement off the hot path
(on it, an explicit dict costs less than copying one); ``now`` is the backend's (SQLite binds
its clock, PostgreSQL reads ``now()``), never a plan's.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from durably.checkpoint import CHECKPOINTS_KEPT
from durably.errors import ApprovalExpired, InvalidTransition, LeaseLostError, RunNotFound
from durably.keys import plain_json
from durably.status import RunStatus
from durably.store.base import (
    RUNNABLE,
    WAITING,
    Approval,
    Claim,
    Committed,
    Expect,
    Journal,
    Lease,
    NewRun,
    OperationWrite,
    RunRecord,
    StepWrite,
    Transition,
)
from durably.store.rows import (
    Row,
    approval_from_row,
    checkpoint_from_row,
    event_from_row,
    loads,
    operation_from_row,
    run_from_row,
    signal_from_row,
    step_from_row,
)

T = TypeVar("T")
Rows = list[Row]


Query = tuple[str, dict[str, Any]]
"""A statement's name in ``queries.sql`` and its parameters by name (a plain tuple: the
commit path builds several per transaction)."""


@dataclass(slots=True)
class Round:
    queries: list[Query]
    final: bool = False
    """The transaction commits with this round (PostgreSQL sends COMMIT in the same trip).
    A plan that ends after a round that is not final commits with nothing more to write."""
    notify: bool = False
    """The transaction may make a run claimable: workers asleep on PostgreSQL's NOTIFY wake."""


Plan = Generator[Round, list[Rows], T]
"""Yields rounds, receives each round's rows (one list per query), returns the result.

A write without ``RETURNING`` answers an empty row per row it changed, so "no row" means
"nothing matched" for every statement (a RETURNING costs SQLite a temporary table)."""


# -- the commit: fence, refusals, then the rest ------------------------------------------


def commit(guard: Lease | Expect, t: Transition) -> Plan[Committed]:
    """``Store.commit``: refused (nothing applies) unless the guard still holds, the
    operation's row is as expected, the signal is unconsumed and the approval usable."""
    run_id = guard.run_id
    if isinstance(guard, Lease):
        fence = (
            "fence_lease",
            {
                "run_id": run_id,
                "owner": guard.owner,
                "epoch": guard.epoch,
                "ttl": guard.ttl_s,
                "release": t.release,
                "events": len(t.events),
            },
        )
    else:
        fence = (
            "fence_expect",
            {"run_id": run_id, "state_version": guard.state_version, "events": len(t.events)},
        )
    refusing = [fence]
    if isinstance(guard, Lease) and _one_round(t):
        return (yield from _commit_in_one_round(guard, t, fence))
    o = t.operation
    if o is not None:
        refusing.append(_operation(guard, o))
    if t.use_approval is not None:
        refusing.append(("use_approval", {**vars(t.use_approval), "run_id": run_id}))
    if t.consume_signal is not None:
        event_id, step_id = t.consume_signal
        refusing.append(
            ("consume_signal", {"run_id": run_id, "event_id": event_id, "step_id": step_id})
        )
    fenced, *answers = yield Round(refusing)

    if not fenced:
        if isinstance(guard, Lease):
            raise lease_lost(guard)
        raise InvalidTransition(
            f"run {run_id} changed or is held by a worker; read it again and retry", run_id=run_id
        )
    written = answers.pop(0) if o is not None else None
    if t.use_approval is not None and not answers.pop(0):
        raise ApprovalExpired(
            f"approval {t.use_approval.approval_id} is no longer usable (expired, used, or "
            "bound to another call); a new approval is needed",
            run_id=run_id,
        )
    if t.consume_signal is not None and not answers.pop(0):
        raise InvalidTransition(
            f"event {t.consume_signal[0]} of run {run_id} was already consumed",
            run_id=run_id,
            step_id=t.consume_signal[1],
        )
    if o is not None and not written:
        raise InvalidTransition(
            f"operation {o.idempotency_key} already exists; it was recorded by another writer"
            if o.expect_row_version is None
            else f"operation {o.idempotency_key} changed under us (expected row_version "
            f"{o.expect_row_version}); another writer got there first",
            run_id=o.run_id,
            step_id=o.step_id,
            idempotency_key=o.idempotency_key,
        )

    row = fenced[0]
    last_sequence, state_version = int(row["last_sequence"]), int(row["state_version"])
    following = _following(guard, t, last_sequence, state_version)
    runnable = t.run is None or t.run.status in RUNNABLE
    # A released run, or one an operator made runnable, can be claimed at once.
    wake = runnable and (t.release or (isinstance(guard, Expect) and t.run is not None))
    yield Round(following, final=True, notify=wake)
    return _committed(
        row, None if o is None else 1 if o.expect_row_version is None else o.expect_row_version + 1
    )


def _committed(fenced: Row, operation_row_version: int | None) -> Committed:
    """What a commit tells its caller, from the row its fence returned."""
    return Committed(
        int(fenced["last_sequence"]),
        int(fenced["state_version"]),
        operation_row_version,
        fenced["lease_until"],
        int(fenced["cancel_requested"]),
        loads(fenced["pause_requested"]),
    )


def _one_round(t: Transition) -> bool:
    """Whether the commit is only events and a step row: then it needs nothing the fence
    returns (a checkpoint seals its sequence and state version) and refuses nothing else."""
    return (
        t.checkpoint is None
        and t.operation is None
        and t.run is None
        and not t.release
        and t.use_approval is None
        and t.consume_signal is None
        and t.request_approval is None
        and t.plan_version is None
        and t.wake_on_signal is None
    )


def _commit_in_one_round(guard: Lease, t: Transition, fence: Query) -> Plan[Committed]:
    """A step's commit: the fence and its writes in one round (one PostgreSQL round trip),
    each write conditional on the fence having held in the same transaction."""
    held = {"run_id": guard.run_id, "owner": guard.owner, "epoch": guard.epoch}
    queries = [fence]
    for offset, e in enumerate(t.events):
        queries.append(
            (
                "insert_event_fenced",
                {
                    **held,
                    "back": len(t.events) - 1 - offset,
                    "type": e.type,
                    "step_id": e.step_id,
                    "payload_json": plain_json(e.payload),
                },
            )
        )
    if t.step is not None:
        queries.append(("upsert_step_fenced", {**held, **_step(t.step), "settle": t.step.settle}))
    fenced, *_ = yield Round(queries, final=True)
    if not fenced:
        raise lease_lost(guard)
    return _committed(fenced[0], None)


def _step(s: StepWrite) -> dict[str, Any]:
    """A step row's parameters, but its settled sequence."""
    return {
        "step_id": s.step_id,
        "position": s.position,
        "kind": s.kind,
        "name": s.name,
        "status": s.status.value,
        "input_hash": s.input_hash,
        "output_json": s.output_json,
        "error_json": _json_or_none(s.error),
        "idempotency_key": s.idempotency_key,
        "attempts": s.attempts,
    }


def _following(
    guard: Lease | Expect, t: Transition, last_sequence: int, state_version: int
) -> list[Query]:
    """The statements of a commit that cannot refuse it: they follow the fence."""
    run_id = guard.run_id
    rest: list[Query] = []
    if t.run is not None:
        u = t.run
        rest.append(
            (
                "update_run",
                {
                    **vars(u),
                    "run_id": run_id,
                    "status": u.status.value,
                    "error_json": _json_or_none(u.error),
                    "waiting_for_json": _json_or_none(u.waiting_for),
                },
            )
        )
        if u.status in WAITING:
            # Neither a pause nor a cancel requested while the run was still executing may
            # be lost behind a wait: it pauses now, or stays due and its next execution
            # cancels it.
            rest.append(("pause_if_requested", {"run_id": run_id}))
            rest.append(("requeue_if_cancelled", {"run_id": run_id}))
    if t.plan_version is not None:
        rest.append(("set_plan_version", {"run_id": run_id, "plan_version": t.plan_version}))
    if t.wake_on_signal is not None:
        # The run is about to wait for this event name: one that arrived meanwhile makes it
        # due at once (delivery and this commit serialise on the run's row).
        rest.append(("wake_on_signal", {"run_id": run_id, "name": t.wake_on_signal}))
    if t.request_approval is not None:
        r = t.request_approval
        if r.replaces is not None:
            rest.append(("supersede_approval", {"approval_id": r.replaces}))
        rest.append(("insert_approval", {**vars(r), "run_id": run_id}))
    first = last_sequence - len(t.events) + 1
    for offset, e in enumerate(t.events):
        rest.append(_event(run_id, first + offset, e.type, e.step_id, e.payload))
    if t.step is not None:
        s = t.step
        settled = last_sequence if s.settle else None
        rest.append(("upsert_step", {"run_id": run_id, **_step(s), "settled_sequence": settled}))
    if t.checkpoint is not None:
        cp, payload_json = t.checkpoint.seal(
            state_version=state_version, last_event_sequence=last_sequence
        )
        rest.append(
            (
                "insert_checkpoint",
                {
                    "run_id": cp.run_id,
                    "state_version": cp.state_version,
                    "last_event_sequence": cp.last_event_sequence,
                    "schema_version": cp.schema_version,
                    "payload_json": payload_json,
                    "checksum": cp.checksum,
                },
            )
        )
        if t.checkpoint.prune:
            rest.append(("prune_checkpoints", {"run_id": run_id, "keep": CHECKPOINTS_KEPT}))
    return rest


def _operation(guard: Lease | Expect, o: OperationWrite) -> Query:
    """The operation's insert (``row_version`` 1), or its update if its row is still at
    ``expect_row_version`` (then one more); either changes no row if another writer got
    there first.

    An operation holding a lease holds the run's: same owner, epoch and expiry.
    """
    lease = guard if isinstance(guard, Lease) and o.hold_lease else None
    params = {
        "tenant": o.tenant,
        "idempotency_key": o.idempotency_key,
        "status": o.status.value,
        "result_json": o.result_json,
        "error_json": _json_or_none(o.error),
        "failure_category": o.failure_category,
        "external_operation_id": o.external_operation_id,
        "attempt": o.attempt,
        "held": lease is not None,
        "lease_owner": None if lease is None else lease.owner,
        "lease_epoch": None if lease is None else lease.epoch,
        "ttl": None if lease is None else lease.ttl_s,
        "send_deadline": o.send_deadline,
    }
    if o.expect_row_version is not None:
        params["expect_row_version"] = o.expect_row_version
        return ("update_operation", params)
    params.update(
        run_id=o.run_id,
        step_id=o.step_id,
        plan_version=o.plan_version,
        tool=o.tool,
        tool_version=o.tool_version,
        input_hash=o.input_hash,
        arguments_json=o.arguments_json,
    )
    return ("insert_operation", params)


def _event(
    run_id: str, sequence: int, type_: str, step_id: str | None, payload: dict[str, Any]
) -> Query:
    return (
        "insert_event",
        {
            "run_id": run_id,
            "sequence": sequence,
            "type": type_,
            "step_id": step_id,
            "payload_json": plain_json(payload),
        },
    )


def _json_or_none(value: Any) -> str | None:
    return None if value is None else plain_json(value)


# -- the other writes -----------------------------------------------------------------


def create_run(new: NewRun) -> Plan[tuple[RunRecord, bool]]:
    """Insert a queued run with its ``run_started`` event, or read the existing one."""
    (inserted,) = yield Round([("insert_run", vars(new))])
    if inserted:
        payload = {"workflow": new.workflow, "version": new.workflow_version}
        started = _event(new.run_id, 1, "run_started", None, payload)
        yield Round([started], final=True, notify=True)
        return run_from_row(inserted[0]), True
    (existing,) = yield Round([("get_run", {"run_id": new.run_id})], final=True)
    return run_from_row(existing[0]), False


def expire_leases(owners: Any) -> Plan[int]:
    """End the leases of ``owners`` (bound as a list), whose processes are gone: their runs
    and the operations they held. How many runs were freed."""
    runs, _ = yield Round(
        [
            ("expire_run_leases", {"owners": owners}),
            ("expire_operation_leases", {"owners": owners}),
        ],
        final=True,
        notify=True,
    )
    return len(runs)


def claim(pick: Plan[Row | None], owner: str, ttl_s: float, sent_at: float) -> Plan[Claim | None]:
    """The claim of the run ``pick`` leased (its row as leased, with ``old_status``,
    ``old_owner`` and ``old_until`` from before), recording a recovery."""
    row = yield from pick
    if row is None:
        return None
    # In flight under any owner (a dead worker, or this one after a failed commit or a cut
    # connection): its effects are reconciled before anything else.
    recovered = row["old_status"] != RunStatus.QUEUED and row["old_owner"] is not None
    run = run_from_row(row)
    if recovered:
        payload = {"previous_owner": row["old_owner"], "lease_until": row["old_until"]}
        sequence = run.last_sequence + 1
        yield Round(
            [
                ("next_sequence", {"run_id": run.run_id}),
                _event(run.run_id, sequence, "run_recovered", None, payload),
            ],
            final=True,
        )
    return Claim(
        run=run,
        lease=Lease(run.run_id, owner, run.lease_epoch, ttl_s),
        recovered=recovered,
        previous_lease_until=row["old_until"] if recovered else None,
        sent_at=sent_at,
    )


def deliver_signal(run_id: str, event_id: str, name: str, payload_json: str) -> Plan[bool]:
    """``Store.deliver_signal``: the signal once per event id, its event, the run due if
    it waits for that name. The run's row is locked first: its own commits serialise."""
    locked, inserted = yield Round(
        [
            ("lock_run", {"run_id": run_id}),
            (
                "insert_signal",
                {
                    "run_id": run_id,
                    "event_id": event_id,
                    "name": name,
                    "payload_json": payload_json,
                },
            ),
        ]
    )
    check_open(run_id, locked[0] if locked else None)
    if not inserted:
        return False
    run = locked[0]
    due = wakes(run["status"], run["waiting_for_json"], name)
    payload = {"name": name, "event_id": event_id, "wakes_run": due}
    received = _event(run_id, run["last_sequence"] + 1, "event_received", None, payload)
    yield Round([("bump_run", {"run_id": run_id, "due": due}), received], final=True, notify=True)
    return True


def decide_approval(
    run_id: str, approval_id: str | None, decision: str, by: str, comment: str | None
) -> Plan[tuple[Approval, bool]]:
    """``Store.decide_approval``: expiry is judged by the store's clock."""
    locked, found, clock = yield Round(
        [
            ("lock_run", {"run_id": run_id}),
            ("approvals", {"run_id": run_id, "approval_id": approval_id}),
            ("clock", {}),
        ]
    )
    check_open(run_id, locked[0] if locked else None)
    target = pending_approval(run_id, approval_id, [approval_from_row(r) for r in found])
    expired = target.expires_at <= float(clock[0]["now"])
    status = "expired" if expired else decision
    run = locked[0]
    payload = {"approval_id": target.approval_id, "decision": status, "by": by}
    decided, *_ = yield Round(
        [
            (
                "decide_approval",
                {"approval_id": target.approval_id, "status": status, "by": by, "comment": comment},
            ),
            ("bump_run", {"run_id": run_id, "due": run["status"] == RunStatus.WAITING_APPROVAL}),
            _event(run_id, run["last_sequence"] + 1, "approval_decided", target.step_id, payload),
        ],
        final=True,
        notify=True,
    )
    return approval_from_row(decided[0]), expired


def request_cancel(run_id: str, compensate: bool) -> Plan[RunRecord]:
    """``Store.request_cancel``: flagged, and due now if it waits or nobody holds it."""
    (locked,) = yield Round([("lock_run", {"run_id": run_id})])
    check_open(run_id, locked[0] if locked else None)
    (updated,) = yield Round(
        [("request_cancel", {"run_id": run_id, "cancel": 2 if compensate else 1})],
        final=True,
        notify=True,
    )
    return run_from_row(updated[0])


# -- reads ------------------------------------------------------------------------------


def load_journal(run_id: str, checkpoints: int) -> Plan[Journal | None]:
    """What a worker resumes from, in one round of a read-only snapshot."""
    run, steps, ops, cps, signals, approvals, recent = yield Round(
        [
            ("get_run", {"run_id": run_id}),
            ("steps", {"run_id": run_id}),
            # Every operation has its step row (same transaction), so the steps' keys find
            # them without an index on run_id to maintain per effect.
            ("operations", {"run_id": run_id}),
            ("latest_checkpoints", {"run_id": run_id, "limit": checkpoints}),
            ("pending_signals", {"run_id": run_id}),
            ("approvals", {"run_id": run_id, "approval_id": None}),
            ("events_after_checkpoint", {"run_id": run_id}),
        ],
        final=True,
    )
    if not run:
        return None
    return Journal(
        run=run_from_row(run[0]),
        steps=[step_from_row(r) for r in steps],
        operations=[operation_from_row(r) for r in ops],
        checkpoints=[checkpoint_from_row(r) for r in cps],
        signals=[signal_from_row(r) for r in signals],
        approvals=[approval_from_row(r) for r in approvals],
        recent_events=[event_from_row(r) for r in recent],
    )


# -- the rules the plans check --------------------------------------------------------


def lease_lost(lease: Lease) -> LeaseLostError:
    return LeaseLostError(
        f"lease on run {lease.run_id} (owner {lease.owner}, epoch {lease.epoch}) was lost: "
        "another worker took the run over; this worker stops working on it",
        run_id=lease.run_id,
    )


def pending_approval(run_id: str, approval_id: str | None, approvals: list[Approval]) -> Approval:
    """The approval a decision is about, or the InvalidTransition that says why none is."""
    pending = [a for a in approvals if a.status == "requested"]
    if approval_id is not None and not pending:
        if not approvals:
            raise InvalidTransition(f"run {run_id} has no approval {approval_id!r}", run_id=run_id)
        done = approvals[0]
        raise InvalidTransition(
            f"approval {approval_id} of run {run_id} is already {done.status}"
            + (f" (by {done.decided_by})" if done.decided_by else "")
            + "; a decision is recorded once",
            run_id=run_id,
        )
    if not pending:
        latest = approvals[-1] if approvals else None
        detail = ""
        if latest is not None:
            detail = f"; its latest approval {latest.approval_id} is {latest.status}"
            if latest.decided_by:
                detail += f" (by {latest.decided_by})"
        raise InvalidTransition(f"run {run_id} has no pending approval{detail}", run_id=run_id)
    if len(pending) > 1:
        ids = ", ".join(a.approval_id for a in pending)
        raise InvalidTransition(
            f"run {run_id} has {len(pending)} pending approvals ({ids}); name one", run_id=run_id
        )
    return pending[0]


def wakes(status: str, waiting_for_json: str | None, event_name: str) -> bool:
    """Whether an event of ``event_name`` ends the run's current wait (both stores' rule)."""
    waiting = loads(waiting_for_json) or {}
    return status == RunStatus.WAITING_EXTERNAL and waiting.get("event") == event_name


def check_open(run_id: str, run: Row | None) -> None:
    """Raise unless the run exists and is not finished."""
    if run is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    if RunStatus(run["status"]).is_final:
        raise InvalidTransition(
            f"run {run_id} is {run['status']} (final); nothing more can be delivered to it or "
            "decided for it",
            run_id=run_id,
        )
