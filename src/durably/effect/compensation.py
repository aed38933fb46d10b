"""Compensations (sagas): the registered undo of each succeeded effect, once each."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, replace

from durably.definitions import ToolDef
from durably.effect.protocol import Effect
from durably.errors import InvalidTransition, StepFailed
from durably.execution import RunContext
from durably.keys import json_value, undo_key
from durably.reconcile import Operation
from durably.status import OperationStatus
from durably.store.base import (
    EventWrite,
    OperationRecord,
    OperationWrite,
    Transition,
)

log = logging.getLogger("durably")


UNDO_PREFIX = "compensate:"
"""The step id of an effect's undo is the effect's, after this."""


async def compensate(
    ctx: RunContext, step_ids: tuple[str, ...], *, every_effect: bool = False
) -> list[str]:
    """Run the registered compensations of succeeded effects, newest first; once each.

    Only effects this execution has reached, so a replay compensates exactly what the
    original execution did at this point (the workflow's own ``durably.compensate``);
    ``every_effect`` for the run's cancellation: every effect it recorded."""
    done_states = (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)
    order = {step_id: i for i, step_id in enumerate(ctx.reached)}
    made = [o for o in ctx.operations.values() if o.status in done_states]
    if every_effect:
        # Calls the replay has not reached again have no place in its order: the order in
        # which their intents were recorded stands for both.
        candidates = sorted(made, key=lambda o: (o.created_at, order.get(o.step_id, -1)))
    else:
        candidates = sorted((o for o in made if o.step_id in order), key=lambda o: order[o.step_id])
    candidates.reverse()
    done = []
    for op in candidates:
        if step_ids and op.step_id not in step_ids:
            continue
        tool = undoable(ctx, op)
        if tool is None:
            continue
        undo_id = f"{UNDO_PREFIX}{op.step_id}"
        if op.status is OperationStatus.COMPENSATED and (every_effect or undo_id not in ctx.steps):
            # Undone already: by the workflow, before a crash, or (a fork's copy) by the
            # source after the fork point. The workflow's own undo recorded in this run is
            # replayed instead (its call is part of the run's history).
            done.append(op.step_id)
            continue
        if every_effect:
            # The workflow's own undo of it, cut short by the cancel or failed: the
            # cancellation takes it up (and meets its failure again, if it failed).
            ctx.reached.pop(undo_id, None)
        key = _undo_key(ctx, op, undo_id)
        if not _recorded_here(ctx, key) and await _undone_elsewhere(ctx, op, undo_id, key):
            done.append(op.step_id)
            continue
        undo = ctx.engine.registry.compensation_def(tool)
        operation = Operation(
            run_id=op.run_id,
            step_id=op.step_id,
            tool=op.tool,
            arguments=op.arguments,
            idempotency_key=op.idempotency_key,
            external_operation_id=op.external_operation_id,
            attempt=op.attempt,
            result=json_value(op.result_json or "null"),
        )
        undoing = Effect(ctx, undo, (asdict(operation),), {}, undo_id, key=key)
        undoing.compensating = True
        try:
            await undoing.settle()
        except InvalidTransition:
            # Another run recorded the undo between the look and this run's intent.
            if _recorded_here(ctx, key) or not await _undone_elsewhere(ctx, op, undo_id, key):
                raise
            done.append(op.step_id)
            continue
        await _compensated(ctx, op)
        done.append(op.step_id)
    return done


def _undo_key(ctx: RunContext, op: OperationRecord, undo_id: str) -> str:
    """The key ``op`` is undone under: derived from the effect's first record, so a fork
    and its source share it; or the one its undo was recorded with (by an older durably,
    whose undo keys were the run's own)."""
    recorded = ctx.steps.get(undo_id)
    if recorded is not None and recorded.idempotency_key is not None:
        return recorded.idempotency_key
    return undo_key(op.origin_key or op.idempotency_key)


def _recorded_here(ctx: RunContext, key: str) -> bool:
    """Whether this run recorded the undo under ``key``. Its journal may hold another run's:
    the step of an undo that waited here for its approval carries the shared key, which
    finds the other run's record once that run made the undo."""
    undo = ctx.operations.get(key)
    return undo is not None and undo.run_id == ctx.run.run_id


async def _undone_elsewhere(ctx: RunContext, op: OperationRecord, undo_id: str, key: str) -> bool:
    """Whether another run holding a record of the same effect (a fork and its source) has
    undone it: then ``op`` is marked compensated here, and nothing is sent. An undo still
    under way there is waited for (up to half this run's lease); one that did not succeed
    raises, naming that run: this run never undoes the effect a second time."""
    deadline = time.monotonic() + ctx.lease.ttl_s / 2
    while True:
        undo = await ctx.store.operation(ctx.run.tenant, key)
        if undo is None or undo.run_id == ctx.run.run_id:
            return False
        under_way = undo.status in (OperationStatus.INTENT_RECORDED, OperationStatus.EXECUTING)
        if not under_way or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    if undo.status is not OperationStatus.SUCCEEDED:
        raise StepFailed(
            f"the undo of {op.tool} at {op.step_id} is run {undo.run_id}'s (the same effect, "
            f"which that run also holds), and is {undo.status.value} there: this run does not "
            f"undo it again. Settle it in run {undo.run_id} (durably describe {undo.run_id})",
            run_id=ctx.run.run_id,
            step_id=undo_id,
            idempotency_key=undo.idempotency_key,
        )
    await _compensated(ctx, op, by_run=undo.run_id)
    return True


async def _compensated(ctx: RunContext, op: OperationRecord, **payload: str) -> None:
    """Mark ``op`` compensated once its undo succeeded (here, or in ``by_run``)."""
    current = ctx.operations[op.idempotency_key]
    if current.status is not OperationStatus.SUCCEEDED:
        return
    await ctx.commit(
        Transition(
            events=[
                EventWrite(
                    "effect_compensated",
                    op.step_id,
                    {"tool": op.tool, "idempotency_key": op.idempotency_key, **payload},
                )
            ],
            operation=OperationWrite.update_of(current, OperationStatus.COMPENSATED),
        )
    )
    ctx.operations[op.idempotency_key] = replace(
        current, status=OperationStatus.COMPENSATED, row_version=current.row_version + 1
    )


def undoable(ctx: RunContext, op: OperationRecord) -> ToolDef | None:
    """The tool of ``op`` if it registered a compensation."""
    tool = ctx.engine.registry.tool_def(op.tool, missing_ok=True)
    return tool if tool is not None and tool.compensate is not None else None
