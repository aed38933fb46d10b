"""The commit, as a plan (see :mod:`.plans`): the fence and every write that can refuse
the transaction first, then what follows from the fence; a step's commit, which needs
nothing the fence returns, in one round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

from durably.checkpoint import CHECKPOINTS_KEPT
from durably.errors import ApprovalExpired, InvalidTransition
from durably.keys import plain_json
from durably.store.base import (
    RUNNABLE,
    WAITING,
    Committed,
    Expect,
    Lease,
    NewRun,
    OperationWrite,
    RunRecord,
    StepWrite,
    Transition,
)
from durably.store.plans import (
    Plan,
    Query,
    Round,
    insert_checkpoint,
    insert_event,
    json_or_none,
    lease_lost,
    received,
)
from durably.store.rows import Row, loads, run_from_row

T = TypeVar("T")

# -- the commit: fence, refusals, then the rest ------------------------------------------


def commit(
    guard: Lease | Expect, t: Transition, *, step_statement: bool = False
) -> Plan[Committed]:
    """``Store.commit``: refused (nothing applies) unless the guard still holds, the
    operation's row is as expected, the signal is unconsumed and the approval usable.

    ``step_statement``: the backend has ``commit_step``, a step's commit as one statement.
    """
    run_id = guard.run_id
    if isinstance(guard, Lease):
        held = {
            "run_id": run_id,
            "owner": guard.owner,
            "epoch": guard.epoch,
            "ttl": guard.ttl_s,
            "events": len(t.events),
        }
        fence = ("fence_release", held) if t.release else ("fence_lease", held)
    else:
        fence = (
            "fence_expect",
            {"run_id": run_id, "state_version": guard.state_version, "events": len(t.events)},
        )
    refusing = [fence]
    if isinstance(guard, Lease) and _one_round(t):
        if step_statement and len(t.events) == 1 and t.step is not None and t.step.new_row:
            return (yield from _commit_step(guard, t))
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
    if t.read_back:
        following.append(_read_back(run_id))
    answers = yield Round(following, final=True, notify=wake)
    return _committed(
        row,
        None if o is None else 1 if o.expect_row_version is None else o.expect_row_version + 1,
        answers[-1] if t.read_back else None,
    )


def _read_back(run_id: str) -> Query:
    """The run as the commit leaves it, read last in the commit's transaction (see
    ``Transition.read_back``): no round of its own."""
    return ("get_run", {"run_id": run_id})


def _committed(
    fenced: Row, operation_row_version: int | None, read_back: list[Row] | None = None
) -> Committed:
    """What a commit tells its caller, from the row its fence returned (and ``read_back``,
    the answer to :func:`_read_back`)."""
    return Committed(
        int(fenced["last_sequence"]),
        int(fenced["state_version"]),
        operation_row_version,
        fenced["lease_until"],
        int(fenced["cancel_requested"]),
        loads(fenced["pause_requested"]),
        run_from_row(read_back[0]) if read_back else None,
    )


def _one_round(t: Transition) -> bool:
    """Whether the commit is only events and a step row: then it needs nothing the fence
    returns (a checkpoint seals its sequence and state version) and refuses nothing else."""
    return (
        t.checkpoint is None
        and t.operation is None
        and t.run is None
        and not t.release
        and not t.read_back
        and _fence_and_rows_only(t)
    )


def _fence_and_rows_only(t: Transition) -> bool:
    """Whether ``t`` refuses on nothing but the fence (and its operation's row) and writes
    nothing but its events, step, operation, run status and checkpoint: no approval used
    or requested, no signal consumed or awaited, no other step row, no new plan version."""
    return (
        t.use_approval is None
        and t.consume_signal is None
        and not t.request_approvals
        and not t.more_steps
        and t.plan_version is None
        and t.wake_on_signal is None
        and not t.wake_on_approvals
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


def _commit_step(guard: Lease, t: Transition) -> Plan[Committed]:
    """A step's commit (one event and its new step row) as one statement: a statement costs
    the client more than anything else in the commit, so this is the cheapest the fence
    allows."""
    assert t.step is not None
    (e,) = t.events
    params = {
        "run_id": guard.run_id,
        "owner": guard.owner,
        "epoch": guard.epoch,
        "ttl": guard.ttl_s,
        "type": e.type,
        "event_step_id": e.step_id,
        "payload_json": plain_json(e.payload),
        **_step(t.step),
        "settle": t.step.settle,
    }
    (fenced,) = yield Round([("commit_step", params)], final=True)
    if not fenced:
        raise lease_lost(guard)
    return _committed(fenced[0], None)


def create_fork(
    new: NewRun, copies: Sequence[Transition], owner: str | None, ttl_s: float
) -> Plan[RunRecord | None]:
    """``Store.create_fork``: the run as ``create_run`` inserts it, then each of ``copies``
    committed to it in turn, then (``owner``) leased, all in one transaction; None
    (nothing written) if the run id is taken."""
    (inserted,) = yield Round([("insert_run", vars(new))])
    if not inserted:
        return None
    state_version = int(inserted[0]["state_version"])
    yield Round(received(new, state_version))
    for t in copies:
        committed = yield from _within(commit(Expect(new.run_id, state_version), t))
        state_version = committed.state_version
    if owner is None:
        (row,) = yield Round([_read_back(new.run_id)], final=True, notify=True)
    else:
        leased = {"run_id": new.run_id, "owner": owner, "ttl": ttl_s}
        (row,) = yield Round([("lease_to_creator", leased)], final=True)
    return run_from_row(row[0])


def _within(plan: Plan[T]) -> Plan[T]:
    """``plan`` as a part of a larger transaction: none of its rounds commits."""
    sending = next(plan)
    while True:
        answers = yield replace(sending, final=False, notify=False)
        try:
            sending = plan.send(answers)
        except StopIteration as finished:
            result: T = finished.value
            return result


def fits_one_statement(t: Transition) -> bool:
    """Whether ``t`` fits ``commit_at``: it names the state it expects the run in, has one
    event, and writes an operation, a checkpoint or the run's new status (a bare step is
    ``commit_step``), with nothing that refuses but the fence and the operation's row and
    nothing that needs more than one statement: a wait also settles requests that arrived
    meanwhile, and a released run that can run again wakes the workers."""
    return (
        t.at is not None
        and len(t.events) == 1
        and (t.operation is not None or t.checkpoint is not None or t.run is not None)
        and (t.run is None or t.run.status not in WAITING)
        and (not t.release or (t.run is not None and t.run.status not in RUNNABLE))
        and _fence_and_rows_only(t)
    )


def commit_at(guard: Lease, t: Transition) -> Plan[Committed | None]:
    """``t`` as one statement, its checkpoint sealed at the state after ``t.at``; None
    (nothing written) unless the lease holds, the run is still at ``t.at`` and the
    operation's row is as ``t`` expects: then the caller commits ``t`` in full, which tells
    why."""
    assert t.at is not None
    at_state_version, at_sequence = t.at
    (e,) = t.events
    params: dict[str, Any] = {
        "run_id": guard.run_id,
        "owner": guard.owner,
        "epoch": guard.epoch,
        "ttl": guard.ttl_s,
        "release": t.release,
        "at_state_version": at_state_version,
        "at_sequence": at_sequence,
        "type": e.type,
        "event_step_id": e.step_id,
        "payload_json": plain_json(e.payload),
        **_NO_OPERATION,
        **_NO_RUN_UPDATE,
        **_NO_STEP,
        **_NO_CHECKPOINT,
    }
    o = t.operation
    if o is not None:
        name, op = _operation(guard, o)
        params.update({f"op_{key}": value for key, value in op.items()})
        params["op"] = "insert" if name == "insert_operation" else "update"
    if t.run is not None:
        u = t.run
        params.update(
            run_status=u.status.value,
            run_status_reason=u.status_reason,
            run_result_json=u.result_json,
            run_error_json=json_or_none(u.error),
            run_waiting_for_json=json_or_none(u.waiting_for),
            run_available_at=u.available_at,
        )
    if t.step is not None:
        params.update({f"step_{key}": value for key, value in _step(t.step).items()})
        params["step_settle"] = t.step.settle
    if t.checkpoint is not None:
        sealed = insert_checkpoint(t.checkpoint, at_state_version + 1, at_sequence + 1)[1]
        params.update(
            schema_version=sealed["schema_version"],
            checkpoint_json=sealed["payload_json"],
            checksum=sealed["checksum"],
            prune=t.checkpoint.prune,
        )
    queries = [("commit_at", params)]
    if t.read_back:
        queries.append(_read_back(guard.run_id))
    fenced, *read_back = yield Round(queries, final=True)
    if not fenced:
        return None
    written = None if o is None else 1 if o.expect_row_version is None else o.expect_row_version + 1
    return _committed(fenced[0], written, read_back[0] if read_back else None)


# commit_at's parameters for what a transition does not write.
# fmt: off
_NO_OPERATION: dict[str, Any] = {"op": None} | {f"op_{key}": None for key in (
    "tenant", "idempotency_key", "run_id", "step_id", "plan_version", "tool", "tool_version",
    "input_hash", "arguments_json", "status", "result_json", "error_json", "failure_category",
    "external_operation_id", "attempt", "held", "lease_owner", "lease_epoch", "ttl",
    "send_deadline", "expect_row_version",
)}
_NO_RUN_UPDATE: dict[str, Any] = {f"run_{key}": None for key in (
    "status", "status_reason", "result_json", "error_json", "waiting_for_json", "available_at",
)}
_NO_STEP: dict[str, Any] = {f"step_{key}": None for key in (
    "step_id", "position", "kind", "name", "status", "input_hash", "output_json", "error_json",
    "idempotency_key", "attempts", "model_call_json", "settle",
)}
_NO_CHECKPOINT: dict[str, Any] = {
    "schema_version": None, "checkpoint_json": None, "checksum": None, "prune": None,
    "keep": CHECKPOINTS_KEPT - 1,
}
# fmt: on


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
        "error_json": json_or_none(s.error),
        "idempotency_key": s.idempotency_key,
        "attempts": s.attempts,
        "model_call_json": json_or_none(s.model_call),
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
                    "error_json": json_or_none(u.error),
                    "waiting_for_json": json_or_none(u.waiting_for),
                },
            )
        )
        if u.status in WAITING:
            # Neither a pause nor a cancel requested while the run was still executing may
            # be lost behind a wait: it pauses now, or stays due and its next execution
            # cancels it.
            rest.append(("pause_if_requested", {"run_id": run_id}))
            if not t.cancelling:
                rest.append(("requeue_if_cancelled", {"run_id": run_id}))
    if t.plan_version is not None:
        rest.append(("set_plan_version", {"run_id": run_id, "plan_version": t.plan_version}))
    if t.wake_on_signal is not None:
        # The run is about to wait for this event name: one that arrived meanwhile makes it
        # due at once (delivery and this commit serialise on the run's row).
        rest.append(("wake_on_signal", {"run_id": run_id, "name": t.wake_on_signal}))
    for approval_id in t.wake_on_approvals:
        # Decided while this execution ran: the decision could not make the run due then.
        rest.append(("wake_on_approval", {"run_id": run_id, "approval_id": approval_id}))
    for r in t.request_approvals:
        if r.replaces is not None:
            rest.append(("supersede_approval", {"approval_id": r.replaces}))
        rest.append(("insert_approval", {**vars(r), "run_id": run_id}))
    first = last_sequence - len(t.events) + 1
    for offset, e in enumerate(t.events):
        rest.append(insert_event(run_id, first + offset, e.type, e.step_id, e.payload))
    for s in [*([] if t.step is None else [t.step]), *t.more_steps]:
        settled = last_sequence if s.settle else None
        rest.append(("upsert_step", {"run_id": run_id, **_step(s), "settled_sequence": settled}))
    if t.checkpoint is not None:
        rest.append(insert_checkpoint(t.checkpoint, state_version, last_sequence))
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
        "error_json": json_or_none(o.error),
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
        origin_key=o.origin_key,
    )
    return ("insert_operation", params)
