"""The operator's actions on runs, as engine functions: start, execute, resolve, resume,
pause and unpause, deliver an event, decide an approval, cancel.

Each validates what it is given (ids, texts, JSON) before anything is written, and writes
through the store's fenced commit; the App facade, the CLI and the console call these.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Literal

from durably import owners, runtime, verification
from durably.checkpoint import CheckpointDraft, JournalState
from durably.definitions import WorkflowDef
from durably.engine import Engine
from durably.errors import (
    ApprovalExpired,
    ConfigurationError,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    RunNotFound,
)
from durably.keys import KEY_SCHEME, canonical_json, plain_json, sha256_hex
from durably.status import FailureCategory, OperationStatus, PauseReason, RunStatus, StepStatus
from durably.store.base import (
    Approval,
    EventWrite,
    Expect,
    NewRun,
    OperationRecord,
    OperationWrite,
    RunRecord,
    RunUpdate,
    StepWrite,
    Store,
    Transition,
)
from durably.values import MAX_TEXT_CHARS, check_id, check_ref, check_text


def new_run_id() -> str:
    """Time-ordered, unique run ids: ``run_<ms hex><random hex>``."""
    return f"run_{int(time.time() * 1000):012x}{secrets.token_hex(5)}"


def receipt(engine: Engine, run_id: str) -> CheckpointDraft:
    """A new run's first checkpoint, written with it: the task received, nothing run yet."""
    state = JournalState(run_id=run_id, key=engine.secret_key)
    return state.draft(status=RunStatus.QUEUED, current_step=None)


async def start(
    engine: Engine,
    wf: WorkflowDef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    run_id: str | None,
    tenant: str,
    execute_here: bool = False,
) -> tuple[str, RunRecord | None]:
    """Record a new queued run of ``wf`` (idempotent on ``run_id``); its id, and the run as
    this process's execution left it, if it executed and released it.

    ``execute_here``: then execute it in this process. A new run is leased to this process
    by the transaction that records it (one commit less, and no worker takes it meanwhile).
    """
    if run_id is not None:
        check_id(run_id, "run id")
    check_id(tenant, "tenant")
    try:
        wf.signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidInput(
            f"workflow {wf.name} cannot take this input ({exc}); its signature is "
            f"{wf.name}{wf.signature}"
        ) from None
    store = await engine.open()
    run_input = {"args": list(args), "kwargs": kwargs}
    input_json = canonical_json(
        run_input, what=f"the input of {wf.name}", limit=engine.max_payload_bytes
    )
    ih = sha256_hex(canonical_json({"workflow": wf.name, "input": run_input}))
    run_id = run_id or new_run_id()
    new = NewRun(
        run_id=run_id,
        tenant=tenant,
        workflow=wf.name,
        workflow_version=wf.version,
        input=run_input,
        input_json=input_json,
        input_hash=ih,
        key_scheme=KEY_SCHEME,
        receipt=receipt(engine, run_id),
    )
    if not execute_here:
        record, created = await store.create_run(new)
        return asked_for(new, record, created).run_id, None
    owner = owners.owner_name("inproc")
    record, created, claim = await store.start_run(new, owner, engine.lease_ttl.total_seconds())
    asked_for(new, record, created)
    if claim is not None:
        return run_id, await runtime.drive(engine, claim, report=True)
    if not created:
        return run_id, await execute(engine, run_id, owner=owner, record=record)
    return run_id, None


def asked_for(new: NewRun, record: RunRecord, created: bool) -> RunRecord:
    """The run ``new`` asked for, unless its id is another run's."""
    if not created and (record.input_hash != new.input_hash or record.tenant != new.tenant):
        raise IdempotencyConflict(
            f"run {new.run_id} already exists with another workflow, input or tenant; "
            "use a new run_id for a new run",
            run_id=new.run_id,
        )
    return record


async def execute(
    engine: Engine, run_id: str, *, owner: str | None = None, record: RunRecord | None = None
) -> RunRecord | None:
    """Execute a runnable run in this process, if no live worker holds it; the run as this
    execution left it, if it released it. ``record``: the run as its caller just read or
    created it (its workflow and version are checked)."""
    check_ref(run_id, "run id")
    store = await engine.open()
    if record is None:
        record = await store.get_run(run_id)
    if record is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    wf = engine.registry.workflow_def(record.workflow)
    if not wf.runs(record.workflow_version):
        raise ConfigurationError(
            f"run {run_id} is pinned to {wf.name} version {record.workflow_version!r}, but "
            f"this code has version {wf.version!r}; run it with a worker that has that "
            "version, or register this one with migrates_from=["
            f"{record.workflow_version!r}] and its new paths behind durably.patched()",
            run_id=run_id,
        )
    claim = await store.claim_run(
        run_id, owner or owners.owner_name("inproc"), engine.lease_ttl.total_seconds()
    )
    if claim is None:
        return None
    return await runtime.drive(engine, claim, report=True)


async def resolve_effect(
    engine: Engine,
    run_id: str,
    step_id: str,
    outcome: Literal["succeeded", "not_executed", "failed"],
    *,
    result: Any = None,
    by: str = "operator",
) -> None:
    """Settle a paused run's unknown effect by hand (``App.resolve_effect`` says how)."""
    check_ref(run_id, "run id")
    check_text(step_id, "step id")
    check_text(by, "by")
    store = await engine.open()
    journal = await store.load_journal(run_id)
    if journal is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    run = journal.run
    # A run cancelled without compensations may leave an effect unknown: recording what
    # happened keeps the ledger true, and the run stays cancelled.
    cancelled = run.status is RunStatus.CANCELLED
    if run.status is not RunStatus.PAUSED and not cancelled:
        raise InvalidTransition(
            f"run {run_id} is {run.status}; only the effects of a paused (or cancelled) run "
            "are resolved by hand",
            run_id=run_id,
        )
    if run.status_reason == PauseReason.OPERATOR:
        # Resolving queues the run: it would lift the operator's pause behind their back.
        raise InvalidTransition(
            f"run {run_id} was paused by an operator, not for an effect; unpause it first",
            run_id=run_id,
        )
    ops = [o for o in journal.operations if o.step_id == step_id]
    refused = bool(ops) and verification.refused_result(ops[0]) and outcome == "succeeded"
    if not ops or (not _settleable(run, ops[0]) and not refused):
        found = ops[0].status.value if ops else "no effect"
        raise InvalidTransition(
            f"step {step_id} of run {run_id} has {found}; only an unknown (or stuck) effect "
            "can be resolved",
            run_id=run_id,
            step_id=step_id,
        )
    op = ops[0]
    step = next(s for s in journal.steps if s.step_id == step_id)
    # Verify first: a new checkpoint over an altered journal would launder the damage.
    journal_state, corrupted = await verification.verified(store, journal, engine.secret_key)
    result_json = None
    external_id: str | None = None
    error: dict[str, Any] | None = None
    category = None
    if outcome == "succeeded":
        result_json = canonical_json(
            result, what="the resolved result", limit=engine.max_payload_bytes
        )
        journal_state.settle(step_id, sha256_hex(result_json))
        journal_state.effect_completed(op.idempotency_key)
        op_status = OperationStatus.SUCCEEDED
        tool = engine.registry.tool_def(op.tool, missing_ok=True)
        if tool is not None:
            try:
                external_id = tool.external_id_of(result)
            except Exception as exc:
                raise InvalidTransition(
                    f"the result given for {step_id} is not shaped like what {op.tool} "
                    f"returns (its external_id function failed: {exc!r}); pass the "
                    "service's record as the tool would have returned it",
                    run_id=run_id,
                    step_id=step_id,
                ) from exc
    elif outcome == "not_executed":
        op_status = OperationStatus.INTENT_RECORDED
    elif outcome == "failed":
        op_status = OperationStatus.FAILED
        category = FailureCategory.BUSINESS_REJECTED.value
        error = {"type": "ResolvedAsFailed", "message": f"resolved as failed by {by}"}
    else:
        raise ConfigurationError(f"unknown outcome {outcome!r}")
    await store.commit(
        Expect(run_id, run.state_version),
        Transition(
            events=[
                *([corrupted] if corrupted else []),
                EventWrite(
                    "effect_resolved",
                    step_id,
                    {
                        "outcome": outcome,
                        "by": by,
                        "idempotency_key": op.idempotency_key,
                        "output_hash": sha256_hex(result_json) if result_json else None,
                    },
                ),
            ],
            step=StepWrite(
                step_id,
                step.position,
                "tool",
                step.name,
                StepStatus(op_status.value),
                step.input_hash,
                output_json=result_json,
                error=error,
                idempotency_key=op.idempotency_key,
                attempts=op.attempt,
                settle=result_json is not None,
            ),
            operation=OperationWrite.update_of(
                op,
                op_status,
                result_json=result_json,
                error=error,
                failure_category=category,
                external_operation_id=external_id,
            ),
            run=None if cancelled else RunUpdate(RunStatus.QUEUED),
            checkpoint=journal_state.draft(
                status=run.status if cancelled else RunStatus.QUEUED, current_step=step_id
            ),
        ),
    )


def _settleable(run: RunRecord, op: OperationRecord) -> bool:
    """Whether a person may settle ``op`` of ``run`` (paused, or cancelled) by hand."""
    if op.status in (
        OperationStatus.UNKNOWN,
        OperationStatus.RECONCILING,
        OperationStatus.EXECUTING,
    ):
        return True
    if op.status is not OperationStatus.FAILED:
        return False
    # The failure the run is paused at (a permission refused): not yet seen by the
    # workflow. Any other failure was raised in it already, and acted on.
    return (run.waiting_for or {}).get("step_id") == op.step_id


async def _open_run(engine: Engine, run_id: str) -> tuple[Store, RunRecord]:
    """The store and the run, which must exist and not be finished."""
    check_ref(run_id, "run id")
    store = await engine.open()
    record = await store.get_run(run_id)
    if record is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    if record.status.is_final:
        raise InvalidTransition(
            f"run {run_id} is {record.status} (final); fork a new run to do more",
            run_id=run_id,
        )
    return store, record


async def resume(engine: Engine, run_id: str) -> RunRecord | None:
    """Make a paused run runnable again and execute it here; the run as this execution left
    it, if it released it."""
    store, record = await _open_run(engine, run_id)
    waiting = record.waiting_for or {}
    if record.status in (RunStatus.WAITING_EXTERNAL, RunStatus.WAITING_APPROVAL):
        if record.status is RunStatus.WAITING_APPROVAL:
            until = "its approval is decided (approve or reject it)"
        elif waiting.get("kind") == "event":
            until = f"the event {waiting.get('event')!r} arrives (send it)"
        else:
            until = "its timer fires"
        raise InvalidTransition(
            f"run {run_id} is {record.status}: it goes on by itself once {until}; resume is "
            "for a paused run",
            run_id=run_id,
        )
    if record.status is RunStatus.PAUSED and record.status_reason == PauseReason.OPERATOR:
        await unpause(engine, run_id, by="resume")
    elif record.status_reason == PauseReason.PERMISSION and waiting.get("step_id"):
        # Resuming after re-authorisation: the refused call is attempted again.
        await resolve_effect(engine, run_id, str(waiting["step_id"]), "not_executed", by="resume")
    elif record.status is RunStatus.PAUSED:
        await store.commit(
            Expect(run_id, record.state_version),
            Transition(
                events=[EventWrite("run_resumed", None, {"from": record.status_reason})],
                run=RunUpdate(RunStatus.QUEUED),
            ),
        )
    return await execute(engine, run_id)


async def pause(engine: Engine, run_id: str, *, reason: str | None, by: str) -> RunRecord:
    """Pause the run at its next call boundary (at once if it is queued or waits): an effect
    in flight lands and is recorded first. Asking again changes nothing."""
    check_ref(run_id, "run id")
    check_text(by, "by")
    if reason is not None:
        check_text(reason, "reason", max_chars=MAX_TEXT_CHARS, lines=True)
    store = await engine.open()
    message = f"paused by {by}" + (f": {reason}" if reason else "")
    request = {"type": "OperatorPause", "message": message, "by": by, "reason": reason}
    return await store.request_pause(run_id, plain_json(request))


async def unpause(engine: Engine, run_id: str, *, by: str) -> RunRecord:
    """Continue an operator-paused run (queued for a worker; a waiting run waits again for
    the same thing), or withdraw a pause its worker has not reached yet."""
    check_ref(run_id, "run id")
    check_text(by, "by")
    store = await engine.open()
    return await store.withdraw_pause(run_id, by)


async def send_event(
    engine: Engine, run_id: str, name: str, payload: Any = None, *, event_id: str | None = None
) -> Literal["delivered", "duplicate ignored"]:
    """Deliver an event to a run, once per ``event_id``."""
    check_ref(run_id, "run id")
    check_text(name, "event name")
    if event_id is not None:
        check_text(event_id, "event id")
    store = await engine.open()
    payload_json = canonical_json(
        payload, what=f"the payload of event {name!r}", limit=engine.max_payload_bytes
    )
    delivered = await store.deliver_signal(run_id, event_id or uuid.uuid4().hex, name, payload_json)
    return "delivered" if delivered else "duplicate ignored"


async def decide(
    engine: Engine,
    run_id: str,
    approval_id: str | None,
    decision: Literal["approved", "rejected"],
    *,
    by: str = "operator",
    comment: str | None = None,
) -> Approval:
    """Record one decision on the run's pending approval (``approval_id`` may be omitted)."""
    check_ref(run_id, "run id")
    if approval_id is not None:
        check_text(approval_id, "approval id")
    check_text(by, "by")
    if comment is not None:
        check_text(comment, "comment", max_chars=MAX_TEXT_CHARS, lines=True)
    store = await engine.open()
    approval, expired = await store.decide_approval(run_id, approval_id, decision, by, comment)
    if expired:
        raise ApprovalExpired(
            f"approval {approval.approval_id} of run {run_id} expired at "
            f"{approval.expires_at:.0f} (unix) before it was decided; the run will ask "
            "for a new one",
            run_id=run_id,
            step_id=approval.step_id,
        )
    return approval


async def cancel(engine: Engine, run_id: str, *, compensate: bool = False) -> None:
    """Cancel the run at its next call boundary (after its compensations, if asked)."""
    store, record = await _open_run(engine, run_id)
    leased = record.lease_owner is not None and (record.lease_until or 0) > time.time()
    # A cancel asked with compensations (a run paused for an effect it would undo) is not
    # withdrawn by a later plain one: the compensations still run. Unless the run's code
    # diverged from its history, or it is a fork whose replay mode blocked an undo: it
    # makes no such call (before the code it ran with is deployed again, or ever), and a
    # plain cancel is the way to end it without them.
    makes_no_undo = record.status_reason in (
        PauseReason.NON_DETERMINISM,
        PauseReason.IDEMPOTENCY_CONFLICT,
        PauseReason.REPLAY_BLOCKED,
    )
    compensate = compensate or (record.cancel_requested == 2 and not makes_no_undo)
    if not leased and not compensate:
        try:
            await store.commit(
                Expect(run_id, record.state_version),
                Transition(
                    events=[EventWrite("run_cancelled", None, {"compensated": []})],
                    run=RunUpdate(RunStatus.CANCELLED, status_reason="cancelled"),
                ),
            )
            return
        except InvalidTransition:
            pass  # a worker took it meanwhile: ask it to stop at its next boundary
    await store.request_cancel(run_id, compensate=compensate)
    if not leased:
        # Compensations are effects: replay the run here up to its next boundary.
        await execute(engine, run_id)
