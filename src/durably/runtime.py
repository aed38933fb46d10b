"""Executes a workflow coroutine against its journal: replay, suspension, and how the run
ends (a step's own call is :mod:`durably.steps`).

A workflow is a durable function. Every time a run is resumed its coroutine starts again
from the top; each step or tool call at a position that the journal already settled returns
the recorded result instead of running, so the code between calls must be deterministic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from durably import context
from durably.checkpoint import PRUNE_EVERY, JournalState
from durably.definitions import WorkflowDef
from durably.effect import compensate, undoable
from durably.errors import (
    CheckpointCorrupted,
    CheckpointNotMigratable,
    IdempotencyConflict,
    LeaseLostError,
    NonDeterminismError,
    NotAwaited,
    NotJSONSerializable,
    PayloadTooLarge,
    ReplayBlocked,
    RunStopped,
    StoreUnavailable,
)
from durably.execution import Cancel, RunContext, Suspend, ending, error_dict, released
from durably.keys import canonical_json, sha256_hex
from durably.status import OperationStatus, PauseReason, RunStatus
from durably.store.base import (
    Claim,
    EventWrite,
    OperationRecord,
    RunRecord,
    RunUpdate,
    Transition,
)
from durably.values import storable_text
from durably.verification import verified

if TYPE_CHECKING:
    from durably.engine import Engine

log = logging.getLogger("durably")

_PAUSE_REASONS: dict[type[BaseException], PauseReason] = {
    NonDeterminismError: PauseReason.NON_DETERMINISM,
    IdempotencyConflict: PauseReason.IDEMPOTENCY_CONFLICT,
    CheckpointCorrupted: PauseReason.CHECKPOINT_CORRUPTED,
    CheckpointNotMigratable: PauseReason.CHECKPOINT_NOT_MIGRATABLE,
    NotAwaited: PauseReason.CALL_NOT_AWAITED,
    ReplayBlocked: PauseReason.REPLAY_BLOCKED,
}


async def load_context(engine: Engine, claim: Claim) -> RunContext:
    """Read and verify the run's journal; raises CheckpointCorrupted if it cannot be trusted,
    CheckpointNotMigratable if its checkpoint cannot be read by this code."""
    store = engine.store
    journal = claim.journal or await store.load_journal(claim.run.run_id)
    assert journal is not None, "a claimed run exists"
    if claim.new:
        state, corrupted = JournalState(journal.run.run_id, key=engine.secret_key), None
    else:
        state, corrupted = await verified(store, journal, engine.secret_key)
        if corrupted is None:
            # Earlier executions (a wait, a crash, a release each end one) may have left up
            # to PRUNE_EVERY checkpoints unpruned: the first checkpoint of this one prunes.
            # Not after a checkpoint_corrupted report, whose evidence stays.
            state.unpruned = PRUNE_EVERY
    ctx = RunContext(
        engine=engine,
        store=store,
        run=journal.run,
        lease=claim.lease,
        journal=state,
        steps={s.step_id: s for s in journal.steps},
        operations={o.idempotency_key: o for o in journal.operations},
        signals=list(journal.signals),
        cancel_requested=journal.run.cancel_requested,
        pause_requested=journal.run.pause_requested,
        lease_deadline=claim.sent_at + claim.lease.ttl_s,
        previous_lease_until=claim.previous_lease_until,
        at=(journal.run.state_version, journal.run.last_sequence),
    )
    for approval in journal.approvals:
        ctx.approvals.setdefault(approval.step_id, []).append(approval)
    if corrupted is not None:
        engine.metrics.step_recovery.labels(state="checkpoint_corrupted").inc()
        await ctx.commit(
            Transition(
                events=[corrupted],
                checkpoint=ctx.journal.draft(status=ctx.run.status, current_step=None),
            )
        )
    return ctx


async def drive(
    engine: Engine,
    claim: Claim,
    draining: asyncio.Event | None = None,
    *,
    report: bool = False,
) -> RunRecord | None:
    """Execute a claimed run until it completes, fails, pauses or waits; then release it.

    If the lease is lost or the store fails, this execution stops writing and returns; the
    run is continued from what the store holds, by this worker or another.

    ``report``: return the run as this execution's release left it, read back by the
    releasing commit (None if it did not release it: the store has it).
    """
    try:
        return await _drive(engine, claim, draining, report)
    except (LeaseLostError, StoreUnavailable) as exc:
        log.warning("run %s: stopped executing (%s)", claim.run.run_id, exc)
        return None
    except RunStopped as exc:
        # A stop meant for the workflow that got past it (a bug): the run is left to its
        # lease, and the worker, with its other runs, goes on.
        log.error("run %s: a stop escaped its execution (%r)", claim.run.run_id, exc)
        return None


async def _drive(
    engine: Engine, claim: Claim, draining: asyncio.Event | None, report: bool
) -> RunRecord | None:
    if claim.recovered:
        engine.metrics.lease_expired.inc()
    wf = engine.registry.workflow_def(claim.run.workflow)
    try:
        ctx = await load_context(engine, claim)
    except (CheckpointCorrupted, CheckpointNotMigratable) as exc:
        paused = ending(RunStatus.PAUSED, _PAUSE_REASONS[type(exc)], exc, None)
        return (await engine.store.commit(claim.lease, replace(paused, read_back=report))).run
    ctx.reports_run = report
    for op in ctx.operations.values():
        if op.status not in (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED):
            engine.metrics.step_recovery.labels(state=op.status.value).inc()
    if claim.recovered:
        await _reconciling(ctx)
    ctx.draining = draining
    heartbeat = asyncio.create_task(_heartbeat(ctx))
    token = context._run.set(ctx)
    try:
        await _execute(ctx, wf)
    except Suspend:
        pass
    except asyncio.CancelledError:
        # This execution is cancelled (Ctrl-C, a caller's timeout), in the workflow or while
        # it ends: never in the middle of an effect. The calls in flight land and are
        # recorded, and the run is released for whoever goes on, before the cancellation
        # goes on.
        await asyncio.shield(_interrupted(ctx))
        raise
    finally:
        ctx.drop_unawaited()  # left by a workflow that raised: closed, not warned about
        context._run.reset(token)
        heartbeat.cancel()
    return ctx.released_as


async def _execute(ctx: RunContext, wf: WorkflowDef) -> None:
    """Run the workflow's code to its end and record how it ended (raises Suspend if the
    execution stopped)."""
    args = ctx.run.input.get("args", [])
    kwargs = ctx.run.input.get("kwargs", {})
    outcome: BaseException | None = None
    try:
        result = await _stop_unwrapped(wf.fn(*args, **kwargs))
    except Cancel:
        await _cancel(ctx)
        return
    except Suspend:
        await ctx.wind_up()
        if ctx.poisoned is None:
            return
        # A divergence: paused below once the calls still in flight have landed.
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        # SystemExit and KeyboardInterrupt too: raised by workflow or tool code (a wrapped
        # command line's exit), they are the run's failure, not the end of the thread that
        # runs every run of the process.
        outcome = exc
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # this execution itself is cancelled: see _drive
        # Raised by the workflow's own code (a tool's cancellation it passed on): a failure
        # of the workflow, not a stop of the worker running it.
        outcome = exc
    else:
        await ctx.let_started_calls_start()
        # A what-if replay must also have made every call its source recorded.
        outcome = _not_awaited(ctx, ctx.drop_unawaited()) if ctx.unawaited else ctx.unreached()
    if (ctx.cancel_raised or ctx.cancel_requested) and not ctx.stopped:
        # The workflow caught its cancellation and went on (every later call stopped too),
        # or ended after a cancel this execution had seen: its end is a boundary too, so the
        # run is cancelled all the same.
        await _cancel(ctx)
        return
    # A branch cancelled while it released the run finishes that release first, and
    # parallel calls may still be executing: record their outcomes before the run ends.
    await ctx.wind_up()
    await ctx.quiesce()
    # A call that landed by releasing the run (an approval to ask for) ends it that way.
    await ctx.wind_up()
    if ctx.stopped:
        # Lease lost or store failure (logged when it happened), possibly swallowed or
        # re-raised as something else by workflow code: nothing more is written.
        return
    failure = ctx.poisoned or outcome
    unknown = _unknown_outcomes(ctx)
    if unknown and (failure is None or type(failure) not in _PAUSE_REASONS):
        # Ending now (completed, or failed: final) would leave effects that may have happened
        # unsettled for good: a person settles them first.
        await _pause_for_unknown(ctx, unknown, failure)
        return
    if failure is not None:
        reason = _PAUSE_REASONS.get(type(failure))
        if reason is not None:
            # The code or the data changed under the run: a person must look; failing
            # it would be final, and guessing would be worse.
            await _finish(ctx, RunStatus.PAUSED, reason, failure)
        else:
            await _finish(ctx, RunStatus.FAILED, None, failure)
        return
    await _complete(ctx, wf.name, result)


async def _interrupted(ctx: RunContext) -> None:
    await ctx.wind_up()
    await ctx.quiesce()
    # A call that landed by releasing the run (an approval to ask for) ends it that way.
    await ctx.wind_up()
    if ctx.stopped:
        return
    try:
        await ctx.commit(released("interrupted"))
    except (LeaseLostError, StoreUnavailable, Suspend) as lost:
        log.warning("run %s: could not release it (%r)", ctx.run.run_id, lost)


_UNSETTLED = (OperationStatus.EXECUTING, OperationStatus.UNKNOWN, OperationStatus.RECONCILING)


def _unknown_outcomes(ctx: RunContext) -> list[OperationRecord]:
    """The run's calls with no known outcome, oldest first. On recovery: what the replay
    settles first. Once the workflow has ended and every call in flight has landed: calls a
    recovery found unsettled that the replay never reached again (a branch cancelled before
    it got there), or a call whose tool ended in something no outcome was known for."""
    return sorted(
        (op for op in ctx.operations.values() if op.status in _UNSETTLED),
        key=lambda op: op.created_at,
    )


def _pending_action(op: OperationRecord) -> dict[str, Any]:
    """``op`` as a checkpoint's pending action: what recovery must settle first."""
    return {
        "tool": op.tool,
        "step_id": op.step_id,
        "idempotency_key": op.idempotency_key,
        "status": op.status.value,
    }


async def _pause_for_unknown(
    ctx: RunContext,
    unknown: list[OperationRecord],
    failure: BaseException | None,
    *,
    cancelling: bool = False,
) -> None:
    """Pause the run ``effect_state_unknown`` for the calls in ``unknown``: each is settled
    by hand (``durably resolve``), then ``resume`` ends the run as its workflow does (or
    as its cancellation does, compensating what took effect)."""
    first = unknown[0]
    calls = ", ".join(f"{op.tool} at {op.step_id}" for op in unknown)
    if cancelling:
        ended, why = "the run is cancelled with compensations", ""
    else:
        ended = "the workflow " + (
            "returned" if failure is None else f"raised {type(failure).__name__}"
        )
        why = " (left behind by a crash and not reached again, or cut off by a stop)"
    error = {
        "type": "EffectPaused",
        "message": storable_text(
            f"{ended}, but {len(unknown)} call(s) it made have no known outcome{why}: {calls}. "
            "Each may have taken effect: check the external system, then run `durably "
            f"resolve {ctx.run.run_id} {first.step_id} --succeeded|--not-executed|--failed`; "
            "the run then goes on, and pauses again for the next"
        ),
        "idempotency_keys": [op.idempotency_key for op in unknown],
    }
    reason = PauseReason.EFFECT_STATE_UNKNOWN.value
    pending = _pending_action(first)
    # The workflow has ended: running it again settles nothing (see Worker.recheck_paused).
    waiting = {**pending, "workflow_ended": True}
    try:
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite("run_paused", None, {"reason": reason, **error})],
                run=RunUpdate(
                    RunStatus.PAUSED, status_reason=reason, error=error, waiting_for=waiting
                ),
                checkpoint=ctx.journal.draft(
                    status=RunStatus.PAUSED, current_step=first.step_id, pending_action=pending
                ),
                release=True,
            )
        )
    except (LeaseLostError, StoreUnavailable, Suspend) as lost:
        log.warning("run %s: could not record its pause (%r)", ctx.run.run_id, lost)


async def _reconciling(ctx: RunContext) -> None:
    """A recovered run whose journal holds calls with no known outcome is ``reconciling``
    before it makes any new call: replay reaches each of them (in the order they were made)
    and settles it, reconciling or re-sending it; the last one settled makes it ``running``
    again (see ``EffectCore._back_to_running``)."""
    ops = _unknown_outcomes(ctx)
    if not ops:
        return
    keys = [op.idempotency_key for op in ops]
    first = ops[0]
    pending = _pending_action(first)
    ctx.unsettled.update(keys)
    await ctx.commit(
        Transition(
            events=[EventWrite("run_reconciling", None, {"idempotency_keys": keys})],
            run=RunUpdate(RunStatus.RECONCILING),
            checkpoint=ctx.journal.draft(
                status=RunStatus.RECONCILING, current_step=first.step_id, pending_action=pending
            ),
        )
    )


async def _stop_unwrapped(workflow: Coroutine[Any, Any, Any]) -> Any:
    """The workflow's result; a stop that reaches here inside an exception group (its
    calls ran in an ``asyncio.TaskGroup``) is raised on its own, a cancellation first:
    the run stops whatever else its other tasks raised."""
    try:
        return await workflow
    except BaseExceptionGroup as group:
        stops, _ = group.split(RunStopped)
        if stops is None:
            raise
        cancels, _ = stops.split(Cancel)
        raise _first(cancels or stops) from group


def _first(group: BaseExceptionGroup[RunStopped]) -> RunStopped:
    leaf = group.exceptions[0]
    return _first(leaf) if isinstance(leaf, BaseExceptionGroup) else leaf


async def _complete(ctx: RunContext, workflow: str, result: Any) -> None:
    """Record the run's result and release it; a result no store can hold fails the run."""
    try:
        result_json = canonical_json(
            result, what=f"the result of workflow {workflow}", limit=ctx.engine.max_payload_bytes
        )
    except (NotJSONSerializable, PayloadTooLarge) as exc:
        await _finish(ctx, RunStatus.FAILED, None, exc)
        return
    await ctx.commit(
        lambda: Transition(
            events=[EventWrite("run_completed", None, {"result_hash": sha256_hex(result_json)})],
            run=RunUpdate(RunStatus.COMPLETED, result_json=result_json),
            checkpoint=ctx.journal.draft(status=RunStatus.COMPLETED, current_step=None, prune=True),
            release=True,
        )
    )


def _not_awaited(ctx: RunContext, calls: list[str]) -> NotAwaited:
    return NotAwaited(
        f"the workflow returned without awaiting {', '.join(calls)}: never awaited, the call "
        "never happened. Add the missing `await`, deploy, then resume the run",
        run_id=ctx.run.run_id,
    )


async def _finish(
    ctx: RunContext, status: RunStatus, reason: PauseReason | None, exc: BaseException
) -> None:
    try:
        await ctx.commit(lambda: ending(status, reason, exc, ctx))
    except (LeaseLostError, StoreUnavailable, Suspend) as lost:
        log.warning("run %s: could not record %s (%r)", ctx.run.run_id, status, lost)


async def _cancel(ctx: RunContext) -> None:
    """Finish a cancelled run: compensate if asked, then record it cancelled (final)."""
    await ctx.quiesce(closing=False)  # the compensations still run here
    compensated: list[str] = []
    error: dict[str, Any] | None = None
    if ctx.cancel_requested == 2:
        if ctx.poisoned is not None:
            # The code diverged from the run's history: no call is made, compensations
            # included, before a person deploys the code it ran with.
            await _finish(ctx, RunStatus.PAUSED, _PAUSE_REASONS[type(ctx.poisoned)], ctx.poisoned)
            return
        unknown = [op for op in _unknown_outcomes(ctx) if undoable(ctx, op)]
        if unknown:
            # Whether each is undone depends on whether it took effect: a person says first.
            await _pause_for_unknown(ctx, unknown, None, cancelling=True)
            return
        ctx.cancelling = True
        try:
            # Every effect the run made, also those a branch of this replay had not reached
            # again when another one stopped at the cancel.
            compensated = await compensate(ctx, (), every_effect=True)
        except Suspend:
            await ctx.quiesce()
            if ctx.poisoned is None or ctx.stopped:
                return
            # An undo the run may not make (a fork's replay mode blocks it): nothing was
            # sent, and the run pauses for it rather than stay leased with nothing said.
            await _finish(ctx, RunStatus.PAUSED, _PAUSE_REASONS[type(ctx.poisoned)], ctx.poisoned)
            return
        except Exception as exc:
            if ctx.stopped:
                return
            error = error_dict(exc)
    await ctx.quiesce()  # a call begun before the cancel lands first; none starts now
    if ctx.stopped:
        return
    await ctx.commit(
        lambda: Transition(
            events=[
                EventWrite(
                    "run_cancelled", None, {"compensated": compensated, "compensation_error": error}
                )
            ],
            run=RunUpdate(RunStatus.CANCELLED, status_reason="cancelled", error=error),
            checkpoint=ctx.journal.draft(status=RunStatus.CANCELLED, current_step=None),
            release=True,
        )
    )


async def _heartbeat(ctx: RunContext) -> None:
    interval = max(ctx.lease.ttl_s / 3, 0.05)
    while True:
        await asyncio.sleep(interval)
        sent_at = time.monotonic()
        try:
            await ctx.store.heartbeat(ctx.lease)
            ctx.renewed(sent_at)
        except LeaseLostError as exc:
            ctx.stop_writing(exc)
            return
        except StoreUnavailable as exc:
            # The next heartbeat or commit tries again; the lease may still be ours.
            log.warning("run %s: heartbeat failed (%s)", ctx.run.run_id, exc)
