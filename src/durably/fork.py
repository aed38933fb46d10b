"""Forking a run: a new run that starts with another run's recorded history.

The fork's journal, up to the fork point, is the source's: each call the source settled
there is recorded in the fork with its result (a tool call under the fork's own idempotency
key, never the source's). The fork then executes the workflow as this code has it, from the
top: replay returns the copied results, and every call past them is new. A new tool call is
governed by the fork's :class:`~durably.ReplayMode` (``effect/replay.py``), so nothing real
happens unless the mode says so.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from durably.actions import asked_for, new_run_id, receipt
from durably.checkpoint import JournalState
from durably.effect.compensation import UNDO_PREFIX
from durably.engine import Engine
from durably.errors import InvalidInput, RunNotFound
from durably.keys import KEY_SCHEME, canonical_json, idempotency_key, plain_json, sha256_hex
from durably.status import OperationStatus, ReplayMode, RunStatus, StepStatus
from durably.store.base import (
    EventWrite,
    Journal,
    NewRun,
    OperationWrite,
    StepRecord,
    StepWrite,
    Transition,
)
from durably.values import check_id, check_ref, check_text


async def fork(
    engine: Engine,
    source_id: str,
    *,
    at: str | None,
    replay: ReplayMode,
    run_id: str | None,
    what_if: bool = False,
    owner: str | None = None,
) -> str:
    """Create the fork of ``source_id`` (queued, or held for ``owner``) and return its id.

    ``at``: the source's step id (or checkpoint id) to fork after; ``None`` keeps every
    call the source settled. ``what_if``: a what-if replay (``whatif.py``), whose every
    call must be one the source recorded. ``owner``: the fork is held for it (still queued,
    leased), who executes it at once (``actions.execute(..., owner=owner)``); no worker
    takes it while the lease lasts.
    """
    check_ref(source_id, "run id")
    if at is not None:
        check_text(at, "fork point", max_chars=1000)
    if run_id is not None:
        check_id(run_id, "run id")
    store = await engine.open()
    journal = await store.load_journal(source_id, checkpoints=0)
    if journal is None:
        raise RunNotFound(f"no run {source_id!r}", run_id=source_id)
    source = journal.run
    wf = engine.registry.workflow_def(source.workflow)
    kept = await _kept_steps(engine, journal, at)
    run_input: dict[str, Any] = {
        "args": source.input.get("args", []),
        "kwargs": source.input.get("kwargs", {}),
        "fork": {"of": source_id, "at": at, "replay": replay.value},
    }
    if what_if:
        run_input["fork"]["what_if"] = True
    input_json = canonical_json(run_input, what="the fork's input", limit=engine.max_payload_bytes)
    run_id = run_id or new_run_id()
    new = NewRun(
        run_id=run_id,
        tenant=source.tenant,
        workflow=wf.name,
        workflow_version=wf.version,
        input=run_input,
        input_json=input_json,
        input_hash=sha256_hex(canonical_json({"workflow": wf.name, "input": run_input})),
        key_scheme=KEY_SCHEME,
        receipt=receipt(engine, run_id),
    )
    ops = {o.step_id: o for o in journal.operations}
    # Undone by the source since (after the fork point, too; its undo is recorded a commit
    # before the effect is marked compensated): the fork's copy says so, or the fork would
    # undo the one real effect a second time.
    undone = {
        s.step_id.removeprefix(UNDO_PREFIX)
        for s in journal.steps
        if s.step_id.startswith(UNDO_PREFIX) and s.status is StepStatus.SUCCEEDED
    }
    undone.update(o.step_id for o in journal.operations if o.status is OperationStatus.COMPENSATED)
    state = JournalState(run_id=new.run_id, key=engine.secret_key)
    copies = []
    for step in kept:
        output_json = step.output_json or "null"
        state.settle(step.step_id, sha256_hex(output_json))
        op = ops.get(step.step_id)
        write = None
        key = None
        if step.kind == "tool" and op is not None:
            # A tool this code no longer has: its name was its operation group.
            tool = engine.registry.tool_def(op.tool, missing_ok=True)
            group = op.tool if tool is None else tool.operation_group or tool.name
            key = idempotency_key(new.tenant, new.run_id, op.plan_version, step.step_id, group)
            compensated = step.step_id in undone
            if not compensated:
                state.effect_completed(key)
            write = OperationWrite(
                tenant=new.tenant,
                idempotency_key=key,
                run_id=new.run_id,
                step_id=step.step_id,
                plan_version=op.plan_version,
                tool=op.tool,
                tool_version=op.tool_version,
                input_hash=op.input_hash,
                arguments_json=plain_json(op.arguments),
                status=OperationStatus.COMPENSATED if compensated else OperationStatus.SUCCEEDED,
                result_json=output_json,
                external_operation_id=op.external_operation_id,
                attempt=op.attempt,
                origin_key=op.origin_key or op.idempotency_key,
            )
        copies.append(
            Transition(
                events=[
                    EventWrite(
                        "step_forked",
                        step.step_id,
                        {"from": source_id, "output_hash": sha256_hex(output_json)},
                    )
                ],
                step=StepWrite(
                    step.step_id,
                    step.position,
                    step.kind,
                    step.name,
                    StepStatus.SUCCEEDED,
                    step.input_hash,
                    output_json=output_json,
                    idempotency_key=key,
                    attempts=step.attempts,
                    settle=True,
                    model_call=step.model_call,
                ),
                operation=write,
            )
        )
    if kept:
        # One checkpoint seals the whole copied journal: the fork is written at once.
        draft = state.draft(status=RunStatus.QUEUED.value, current_step=kept[-1].step_id)
        copies[-1] = replace(copies[-1], checkpoint=draft)
    # One transaction: a worker must not take the fork up before its whole history is
    # there (it would run again what the source did), nor find half of it after a crash.
    ttl_s = engine.lease_ttl.total_seconds()
    if await store.create_fork(new, copies, owner=owner, ttl_s=ttl_s) is None:
        # Asked again (its first answer lost with the connection, say): the same fork is
        # the one asked for; another run under that id is refused.
        existing = await store.get_run(new.run_id)
        assert existing is not None  # runs are never deleted
        asked_for(new, existing, created=False)
    return new.run_id


async def _kept_steps(engine: Engine, journal: Journal, at: str | None) -> list[StepRecord]:
    """The source's settled calls, in the order they settled, up to the fork point."""
    settled = sorted(
        (
            s
            for s in journal.steps
            if s.settled_sequence is not None and s.status is StepStatus.SUCCEEDED
        ),
        key=lambda s: s.settled_sequence or 0,
    )
    if at is None:
        return _without_undos(settled)
    last: int | None = next((s.settled_sequence for s in settled if s.step_id == at), None)
    if last is None:
        checkpoints = await engine.store.checkpoints(journal.run.run_id)
        last = next(
            (
                int(c.payload["last_event_sequence"])
                for c in checkpoints
                if c.payload.get("checkpoint_id") == at
            ),
            None,
        )
    if last is None:
        known = ", ".join(s.step_id for s in settled[-10:]) or "none"
        raise InvalidInput(
            f"run {journal.run.run_id} has no settled step or checkpoint {at!r} to fork at; "
            f"its latest settled steps: {known}"
        )
    return _without_undos([s for s in settled if (s.settled_sequence or 0) <= last])


def _without_undos(steps: list[StepRecord]) -> list[StepRecord]:
    """``steps`` but the undos of effects. An undo's input names the run and the key of
    the effect it undoes, so the fork's own undo could never replay it; instead the copy of
    an effect the source undid is ``compensated``, which the fork's compensations skip."""
    return [s for s in steps if not s.step_id.startswith(UNDO_PREFIX)]
