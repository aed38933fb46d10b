"""Executes a workflow coroutine against its journal: replay, step calls, suspension.

A workflow is a durable function. Every time a run is resumed its coroutine starts again
from the top; each step or tool call at a position that the journal already settled returns
the recorded result instead of running, so the code between calls must be deterministic.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from durably import context, faults
from durably.checkpoint import JournalState, SettledResult, verify_journal
from durably.definitions import StepDef, bind_arguments, invoke
from durably.errors import (
    CheckpointCorrupted,
    DurablyError,
    IdempotencyConflict,
    LeaseLostError,
    NonDeterminismError,
    NotJSONSerializable,
    PayloadTooLarge,
    StepFailed,
    StoreUnavailable,
)
from durably.keys import canonical_json, input_hash, sha256_hex
from durably.status import OperationStatus, PauseReason, RunStatus, StepStatus
from durably.store.base import (
    Claim,
    Committed,
    EventWrite,
    Journal,
    Lease,
    OperationRecord,
    RunRecord,
    RunUpdate,
    StepRecord,
    StepWrite,
    Store,
    Transition,
)

if TYPE_CHECKING:
    from durably.app import App

log = logging.getLogger("durably")

CHECKPOINTS_READ = 3
"""Checkpoints read on resume; more are read only when all of these fail their checksum."""


_PAUSE_REASONS: dict[type[Exception], PauseReason] = {
    NonDeterminismError: PauseReason.NON_DETERMINISM,
    IdempotencyConflict: PauseReason.IDEMPOTENCY_CONFLICT,
    CheckpointCorrupted: PauseReason.CHECKPOINT_CORRUPTED,
}


class Suspend(BaseException):
    """Unwinds a workflow whose run stopped here (paused or waiting); already committed.

    A BaseException so that a workflow's ``except Exception`` cannot swallow it.
    """


def error_dict(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc)}


@dataclass
class RunContext:
    """One execution of one run by one lease holder."""

    app: App
    store: Store
    run: RunRecord
    lease: Lease
    journal: JournalState
    steps: dict[str, StepRecord]
    operations: dict[str, OperationRecord]
    counters: Counter[str] = field(default_factory=Counter)
    positions: int = 0
    stopped: bool = False
    """Set when this execution must write nothing more: the lease is lost or the store
    failed. The store, read again by whoever continues the run, is then the truth."""
    draining: asyncio.Event | None = None
    """Set when the worker shuts down: the run is released at its next call boundary."""
    by_position: dict[int, StepRecord] = field(init=False)

    def __post_init__(self) -> None:
        self.by_position = {s.position: s for s in self.steps.values()}

    def allocate(self, name: str, explicit: str | None) -> tuple[str, int]:
        """The deterministic step id of the next call: ``<name>#<n>`` or the explicit one."""
        if self.stopped:
            raise Suspend
        self.positions += 1
        self.counters[name] += 1
        return (explicit or f"{name}#{self.counters[name]}"), self.positions

    async def boundary(self) -> None:
        """Before a call starts: release the run here if the worker is shutting down."""
        if self.draining is not None and self.draining.is_set() and not self.stopped:
            await self.commit(
                Transition(
                    events=[EventWrite("run_released", None, {"reason": "shutdown"})], release=True
                )
            )
            self.stopped = True
            raise Suspend

    async def commit(self, transition: Transition) -> Committed:
        try:
            committed = await self.store.commit(self.lease, transition)
        except (LeaseLostError, StoreUnavailable):
            self.stopped = True
            raise
        if transition.checkpoint is not None:
            faults.crash_point("checkpoint.after_write")
        return committed

    def replayed(self, step_id: str, position: int, kind: str, name: str, ih: str) -> None:
        """Raise if the journal holds a different call at this position or step id."""
        step = self.steps.get(step_id)
        if step is None:
            other = self.by_position.get(position)
            if other is not None:
                raise NonDeterminismError(
                    f"call #{position} of this run was recorded as {other.kind} "
                    f"{other.step_id!r} but the workflow now calls {kind} {step_id!r} there; "
                    "the workflow code changed under a running run. Deploy the old code for "
                    "it, or start a new run",
                    run_id=self.run.run_id,
                    step_id=step_id,
                )
            return
        if step.kind != kind or step.name != name:
            raise NonDeterminismError(
                f"step {step.step_id} was recorded as {step.kind} {step.name!r} but the "
                f"workflow now calls {kind} {name!r} there; the workflow code changed under a "
                "running run. Deploy the old code for it, or give the new call step_id=...",
                run_id=self.run.run_id,
                step_id=step.step_id,
            )
        if kind == "step" and step.input_hash != ih:
            raise NonDeterminismError(
                f"step {step.step_id} ({name}) is called with other arguments than recorded; "
                "workflow code between calls must be deterministic (no clock, random or I/O "
                "outside steps)",
                run_id=self.run.run_id,
                step_id=step.step_id,
            )

    def budget(self) -> dict[str, Any]:
        return {"steps": self.counters.total(), "positions": self.positions}


async def call_step(
    ctx: RunContext,
    sdef: StepDef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    explicit: str | None,
) -> Any:
    step_id, position = ctx.allocate(sdef.name, explicit)
    arguments = bind_arguments(sdef.signature, sdef.name, args, kwargs)
    ih = input_hash(sdef.name, sdef.version, arguments)
    ctx.replayed(step_id, position, "step", sdef.name, ih)
    recorded = ctx.steps.get(step_id)
    if recorded is None:
        await ctx.boundary()
    if recorded is not None and recorded.status is StepStatus.SUCCEEDED:
        return json.loads(recorded.output_json or "null")
    if recorded is not None and recorded.status is StepStatus.FAILED:
        raise _step_failed(ctx, step_id, recorded.error or {})
    attempt = 0
    while True:
        attempt += 1
        try:
            value = await invoke(sdef.fn, *args, **kwargs)
            break
        except Exception as exc:
            if attempt < sdef.retry.max_attempts:
                log.info("step %s attempt %d failed (%r); retrying", step_id, attempt, exc)
                await asyncio.sleep(sdef.retry.delay_s(attempt))
                continue
            error = error_dict(exc)
            await ctx.commit(
                Transition(
                    events=[EventWrite("step_failed", step_id, {"name": sdef.name, **error})],
                    step=StepWrite(
                        step_id,
                        position,
                        "step",
                        sdef.name,
                        StepStatus.FAILED,
                        ih,
                        error=error,
                        attempts=attempt,
                    ),
                )
            )
            raise _step_failed(ctx, step_id, error) from exc
    output_json = canonical_json(
        value, what=f"the result of step {step_id}", limit=ctx.app.max_payload_bytes
    )
    ctx.journal.settle(step_id, output_json)
    ctx.journal.budget = ctx.budget()
    await ctx.commit(
        Transition(
            events=[
                EventWrite(
                    "step_succeeded",
                    step_id,
                    {"name": sdef.name, "output_hash": sha256_hex(output_json)},
                )
            ],
            step=StepWrite(
                step_id,
                position,
                "step",
                sdef.name,
                StepStatus.SUCCEEDED,
                ih,
                output_json=output_json,
                attempts=attempt,
                settle=True,
            ),
            checkpoint=ctx.journal.draft(status=RunStatus.RUNNING, current_step=step_id),
        )
    )
    # Result, event and checkpoint are one transaction: checkpoint.after_write (fired by
    # the commit) and this window are the same moment.
    faults.crash_point("step.after_record")
    return value


def _step_failed(ctx: RunContext, step_id: str, error: dict[str, Any]) -> StepFailed:
    return StepFailed(
        f"step {step_id} failed: {error.get('type')}: {error.get('message')}",
        run_id=ctx.run.run_id,
        step_id=step_id,
        error_type=str(error.get("type", "")),
        error_message=str(error.get("message", "")),
    )


def _journal_state(
    run_id: str, steps: list[StepRecord], ops: list[OperationRecord]
) -> JournalState:
    state = JournalState(run_id=run_id)
    for step in sorted(
        (s for s in steps if s.settled_sequence is not None), key=lambda s: s.settled_sequence or 0
    ):
        state.settle(step.step_id, step.output_json or "null")
    for op in sorted(ops, key=lambda o: o.created_at):
        if op.status is OperationStatus.SUCCEEDED:
            state.effect_completed(op.idempotency_key)
    return state


async def verified(store: Store, journal: Journal) -> tuple[JournalState, EventWrite | None]:
    """The journal's state, verified against its checkpoints (and the event log if needed).

    Raises :class:`CheckpointCorrupted` if the journal cannot be trusted. The event returned
    (if any) reports checkpoints that failed their checksum; commit it with the next write.
    """
    run_id = journal.run.run_id
    settled = [
        SettledResult(s.step_id, s.settled_sequence, sha256_hex(s.output_json or "null"))
        for s in journal.steps
        if s.settled_sequence is not None
    ]
    stored = [(c.payload, c.checksum) for c in journal.checkpoints]
    try:
        verification = verify_journal(settled, stored, lambda seq: {})
    except CheckpointCorrupted:
        verification = None
    if verification is None or verification.corrupted_checkpoints:
        # The slow path: read every checkpoint and the event log, check all against them.
        stored = [(c.payload, c.checksum) for c in await store.checkpoints(run_id)]
        events = await store.events(run_id)

        def from_events(sequence: int) -> dict[str, str]:
            return {
                e.step_id: str(e.payload["output_hash"])
                for e in events
                if e.sequence > sequence and e.step_id and e.payload.get("output_hash")
            }

        verification = verify_journal(settled, stored, from_events)
    state = _journal_state(run_id, journal.steps, journal.operations)
    if not verification.corrupted_checkpoints:
        return state, None
    anchor = verification.anchor
    return state, EventWrite(
        "checkpoint_corrupted",
        None,
        {
            "checkpoint_ids": verification.corrupted_checkpoints,
            "recovered_from": anchor.checkpoint_id if anchor else "event_log",
        },
    )


async def load_context(app: App, claim: Claim) -> RunContext:
    """Read and verify the run's journal; raises CheckpointCorrupted if it cannot be trusted."""
    journal = await app.store.load_journal(claim.run.run_id, checkpoints=CHECKPOINTS_READ)
    assert journal is not None, "a claimed run exists"
    state, corrupted = await verified(app.store, journal)
    ctx = RunContext(
        app=app,
        store=app.store,
        run=journal.run,
        lease=claim.lease,
        journal=state,
        steps={s.step_id: s for s in journal.steps},
        operations={o.idempotency_key: o for o in journal.operations},
    )
    if corrupted is not None:
        app.metrics.step_recovery.labels(state="checkpoint_corrupted").inc()
        await ctx.commit(
            Transition(
                events=[corrupted],
                checkpoint=ctx.journal.draft(status=ctx.run.status, current_step=None),
            )
        )
    return ctx


async def drive(app: App, claim: Claim, draining: asyncio.Event | None = None) -> None:
    """Execute a claimed run until it completes, fails, pauses or waits; then release it.

    If the lease is lost or the store fails, this execution stops writing and returns; the
    run is continued from what the store holds, by this worker or another.
    """
    try:
        await _drive(app, claim, draining)
    except (LeaseLostError, StoreUnavailable) as exc:
        log.warning("run %s: stopped executing (%s)", claim.run.run_id, exc)


async def _drive(app: App, claim: Claim, draining: asyncio.Event | None) -> None:
    if claim.recovered:
        app.metrics.lease_expired.inc()
    wf = app.workflow_def(claim.run.workflow)
    try:
        ctx = await load_context(app, claim)
    except CheckpointCorrupted as exc:
        await _finish(app, claim.lease, RunStatus.PAUSED, PauseReason.CHECKPOINT_CORRUPTED, exc)
        return
    for op in ctx.operations.values():
        if op.status not in (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED):
            app.metrics.step_recovery.labels(state=op.status.value).inc()
    ctx.draining = draining
    heartbeat = asyncio.create_task(_heartbeat(ctx))
    token = context._run.set(ctx)
    try:
        args = ctx.run.input.get("args", [])
        kwargs = ctx.run.input.get("kwargs", {})
        try:
            result = await wf.fn(*args, **kwargs)
        except Suspend:
            return
        except Exception as exc:
            if ctx.stopped:
                # Lease lost or store failure, possibly swallowed and re-raised as something
                # else by workflow code: nothing more is written from here.
                log.warning("run %s: stopped (%r)", ctx.run.run_id, exc)
                return
            reason = _PAUSE_REASONS.get(type(exc))
            if reason is not None:
                # The code or the data changed under the run: a person must look; failing
                # it would be final, and guessing would be worse.
                await _finish(app, ctx.lease, RunStatus.PAUSED, reason, exc, ctx)
            else:
                await _finish(app, ctx.lease, RunStatus.FAILED, None, exc, ctx)
            return
        if ctx.stopped:
            return
        try:
            result_json = canonical_json(
                result, what=f"the result of workflow {wf.name}", limit=app.max_payload_bytes
            )
        except (NotJSONSerializable, PayloadTooLarge) as exc:
            await _finish(app, ctx.lease, RunStatus.FAILED, None, exc, ctx)
            return
        ctx.journal.budget = ctx.budget()
        await ctx.commit(
            Transition(
                events=[
                    EventWrite("run_completed", None, {"result_hash": sha256_hex(result_json)})
                ],
                run=RunUpdate(RunStatus.COMPLETED, result_json=result_json),
                checkpoint=ctx.journal.draft(status=RunStatus.COMPLETED, current_step=None),
                release=True,
            )
        )
    finally:
        context._run.reset(token)
        heartbeat.cancel()


async def _finish(
    app: App,
    lease: Lease,
    status: RunStatus,
    reason: PauseReason | None,
    exc: BaseException,
    ctx: RunContext | None = None,
) -> None:
    error = error_dict(exc)
    if isinstance(exc, DurablyError) and exc.step_id:
        error["step_id"] = exc.step_id
    event = "run_failed" if status is RunStatus.FAILED else "run_paused"
    payload = {"reason": reason.value if reason else None, **error}
    try:
        await app.store.commit(
            lease,
            Transition(
                events=[EventWrite(event, None, payload)],
                run=RunUpdate(status, status_reason=reason.value if reason else None, error=error),
                checkpoint=ctx.journal.draft(status=status, current_step=None) if ctx else None,
                release=True,
            ),
        )
    except (LeaseLostError, StoreUnavailable) as lost:
        log.warning("run %s: could not record %s (%s)", lease.run_id, status, lost)


async def _heartbeat(ctx: RunContext) -> None:
    interval = max(ctx.lease.ttl_s / 3, 0.05)
    while True:
        await asyncio.sleep(interval)
        try:
            await ctx.store.heartbeat(ctx.lease)
        except LeaseLostError:
            ctx.stopped = True
            return
        except StoreUnavailable as exc:
            # The next heartbeat or commit tries again; the lease may still be ours.
            log.warning("run %s: heartbeat failed (%s)", ctx.run.run_id, exc)
