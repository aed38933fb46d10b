"""Executes a workflow coroutine against its journal: replay, step calls, suspension.

A workflow is a durable function. Every time a run is resumed its coroutine starts again
from the top; each step or tool call at a position that the journal already settled returns
the recorded result instead of running, so the code between calls must be deterministic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from durably import context, faults
from durably.checkpoint import JournalState, SettledResult, verify_journal
from durably.definitions import StepDef, bind_arguments, invoke
from durably.errors import (
    BudgetExceeded,
    CheckpointCorrupted,
    DurablyError,
    IdempotencyConflict,
    InvalidTransition,
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
    Approval,
    Claim,
    Committed,
    EventWrite,
    Journal,
    Lease,
    OperationRecord,
    RunRecord,
    RunUpdate,
    Signal,
    StepRecord,
    StepWrite,
    Store,
    Transition,
)
from durably.values import storable_text

if TYPE_CHECKING:
    from durably.app import App

log = logging.getLogger("durably")

CHECKPOINTS_READ = 3
"""Checkpoints read on resume; more are read only when all of these fail their checksum."""


_PAUSE_REASONS: dict[type[BaseException], PauseReason] = {
    NonDeterminismError: PauseReason.NON_DETERMINISM,
    IdempotencyConflict: PauseReason.IDEMPOTENCY_CONFLICT,
    CheckpointCorrupted: PauseReason.CHECKPOINT_CORRUPTED,
}


class Cancel(BaseException):
    """Unwinds a workflow whose cancellation was requested, at a call boundary."""


class Suspend(BaseException):
    """Unwinds a workflow whose run stopped here (paused or waiting); already committed.

    A BaseException so that a workflow's ``except Exception`` cannot swallow it.
    """


def error_dict(exc: BaseException) -> dict[str, Any]:
    """An exception as recorded: its message may hold anything (a NUL, a lone surrogate from
    a cut-off response), and recording the outcome must not fail on it."""
    return {"type": type(exc).__name__, "message": storable_text(str(exc))}


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
    lost: DurablyError | None = None
    """Why this execution stopped writing: LeaseLostError or StoreUnavailable."""
    poisoned: DurablyError | None = None
    """A divergence found in this execution (non-determinism, idempotency conflict): the
    run pauses with it even if workflow code caught the exception."""
    by_position: dict[int, StepRecord] = field(init=False)
    reached: list[str] = field(default_factory=list)
    """Step ids allocated in this execution, in order."""
    inflight: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    """Tool executions between their call and their recorded outcome."""
    signals: list[Signal] = field(default_factory=list)
    """Events delivered to the run and not consumed yet, in arrival order."""
    cancel_requested: int = 0
    """0: no; 1: cancel at the next boundary; 2: cancel and compensate."""
    cancelling: bool = False
    approvals: dict[str, list[Approval]] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)
    plan_version: int = 1
    """The plan version at this point of the execution: replay starts at 1 and each
    recorded ``replan()`` bumps it, so every call derives the key it had originally."""
    """Steps, tool calls, tokens and cost so far (recomputed by every replay)."""
    """The run's approval requests by step id, oldest first."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises this run's commits, so that checkpoints follow the order results commit in
    (parallel calls would otherwise race on separate connections)."""
    lease_deadline: float = float("inf")
    """``time.monotonic()`` by which the lease has run out unless renewed: the store fences
    late writes, but only this process can stop itself from sending late."""
    previous_lease_until: float | None = None
    """The previous holder's lease deadline (store clock), if this execution recovered the
    run from another holder whose sends may still be arriving."""

    def __post_init__(self) -> None:
        self.by_position = {s.position: s for s in self.steps.values()}

    def allocate(self, name: str, explicit: str | None) -> tuple[str, int]:
        """The deterministic step id of the next call: ``<name>#<n>`` or the explicit one."""
        if self.stopped:
            raise Suspend
        self.counters[name] += 1
        step_id = explicit or f"{name}#{self.counters[name]}"
        if step_id in self.reached:
            raise self.poison(
                NonDeterminismError(
                    f"step id {step_id!r} is used twice in this run; give each call its own "
                    "step id (with_step_id) or let durably number them",
                    run_id=self.run.run_id,
                    step_id=step_id,
                )
            )
        self.positions += 1
        self.reached.append(step_id)
        return step_id, self.positions

    async def _outlast(self, t: Transition) -> Committed:
        """Commit ``t``, retrying through a store outage for as long as the lease lasts.

        A retry after a COMMIT whose answer was lost may find it applied: the operation's
        row version then no longer matches, and the ledger is read back to confirm.
        """
        deadline = time.monotonic() + self.lease.ttl_s * 0.8
        delay = 0.1
        ambiguous = False
        while True:
            try:
                return await self.store.commit(self.lease, t)
            except StoreUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "run %s: store unavailable, retrying the record (%s)", self.run.run_id, exc
                )
                ambiguous = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except InvalidTransition:
                applied = await self._applied(t) if ambiguous else None
                if applied is None:
                    raise
                return applied

    async def _applied(self, t: Transition) -> Committed | None:
        """The commit of ``t`` if the store shows it applied (after a lost COMMIT answer)."""
        o = t.operation
        journal = await self.store.load_journal(self.run.run_id, checkpoints=0)
        if o is None or journal is None:
            return None
        op = next((x for x in journal.operations if x.idempotency_key == o.idempotency_key), None)
        if op is None or op.status is not o.status or op.result_json != o.result_json:
            return None
        run = journal.run
        if run.lease_owner != self.lease.owner or run.lease_epoch != self.lease.epoch:
            return None
        return Committed(
            run.last_sequence,
            run.state_version,
            op.row_version,
            run.lease_until,
            run.cancel_requested,
        )

    def renewed(self, sent_at: float) -> None:
        """The store extended the lease by a request sent at ``sent_at`` (monotonic)."""
        self.lease_deadline = max(self.lease_deadline, sent_at + self.lease.ttl_s)

    def check_lease(self) -> None:
        """Raise if this execution must not start anything: it stopped, or this process
        outlived its lease by its own clock (paused by GC, SIGSTOP, a slow network) and
        another worker may already own the run and be settling the same call."""
        if self.lost is not None:
            raise self.lost
        late = time.monotonic() - self.lease_deadline
        if late >= 0:
            error = LeaseLostError(
                f"run {self.run.run_id}: this worker's lease ran out {late:.2f}s ago by its own "
                "clock (the process was paused or starved); another worker may own the run "
                "now, so nothing more is started or sent from here",
                run_id=self.run.run_id,
            )
            self.stop_writing(error)
            raise error

    def hold_lease(self) -> None:
        """:meth:`check_lease` for the runtime itself, right before a step body or a tool
        call starts: the stop unwinds the workflow as ``Suspend``, which no ``except
        Exception`` in workflow or framework code can swallow."""
        try:
            self.check_lease()
        except DurablyError as exc:
            raise Suspend from exc

    def stop_writing(self, reason: DurablyError) -> None:
        self.stopped = True
        if self.lost is None:
            self.lost = reason
            log.warning("run %s: stopped (%s)", self.run.run_id, reason)

    def poison(self, error: DurablyError) -> DurablyError:
        if self.poisoned is None:
            self.poisoned = error
        return error

    async def quiesce(self, *, exclude: int | None = None) -> None:
        """Wait until the run's other in-flight tool executions have recorded their outcome.

        Parallel calls keep running when one of them fails or pauses the run; their
        outcomes must be recorded before the run is released, or they would need
        reconciling although this worker knew them.
        """
        pending = [f for key, f in self.inflight.items() if key != exclude]
        if pending:
            await asyncio.wait([asyncio.shield(f) for f in pending])

    async def boundary(self) -> None:
        """Before a call starts: stop here if the run is cancelled, or release it if the
        worker is shutting down. Never in the middle of an effect."""
        if self.cancel_requested and not self.cancelling:
            raise Cancel
        if self.draining is not None and self.draining.is_set() and not self.stopped:
            await self.quiesce()
            await self.commit(
                Transition(
                    events=[EventWrite("run_released", None, {"reason": "shutdown"})], release=True
                )
            )
            self.stopped = True
            raise Suspend

    async def commit(
        self,
        transition: Transition | Callable[[], Transition],
        *,
        settle: tuple[str, str] | None = None,
        effect: str | None = None,
        durable: bool = False,
    ) -> Committed:
        """Commit under this run's lease, one commit at a time.

        ``transition`` may be a function, called under the lock after ``settle`` (a step id
        and its output JSON) and ``effect`` (an idempotency key) were added to the journal,
        so the checkpoint it drafts includes them. ``durable``: the transition records an
        outcome only this process knows (a tool's result), so a store outage is waited out
        while the lease lasts instead of leaving the outcome to reconciliation.
        """
        async with self.lock:
            if self.stopped:
                raise Suspend
            before = replace(self.journal)
            if settle is not None:
                self.journal.settle(*settle)
            if effect is not None:
                self.journal.effect_completed(effect)
            self.journal.budget = self.budget()
            t = transition() if callable(transition) else transition
            sent_at = time.monotonic()
            try:
                committed = await (
                    self._outlast(t) if durable else self.store.commit(self.lease, t)
                )
            except (LeaseLostError, StoreUnavailable) as exc:
                self.stop_writing(exc)
                raise
            except BaseException:
                self.journal = before  # refused: the journal stays as the store has it
                raise
            self.cancel_requested = committed.cancel_requested
            if not t.release:
                self.renewed(sent_at)
        if t.checkpoint is not None:
            faults.crash_point("checkpoint.after_write")
        return committed

    def replayed(self, step_id: str, position: int, kind: str, name: str, ih: str) -> None:
        """Raise if the journal holds a different call at this position or step id."""
        step = self.steps.get(step_id)
        if step is None:
            other = self.by_position.get(position)
            if other is not None:
                raise self.poison(
                    NonDeterminismError(
                        f"call #{position} of this run was recorded as {other.kind} "
                        f"{other.step_id!r} but the workflow now calls {kind} {step_id!r} there; "
                        "the workflow code changed under a running run. Deploy the old code for "
                        "it, or start a new run",
                        run_id=self.run.run_id,
                        step_id=step_id,
                    )
                )
            return
        if step.kind != kind or step.name != name:
            raise self.poison(
                NonDeterminismError(
                    f"step {step.step_id} was recorded as {step.kind} {step.name!r} but the "
                    f"workflow now calls {kind} {name!r} there; the workflow code changed under a "
                    "running run. Deploy the old code for it, or give the new call step_id=...",
                    run_id=self.run.run_id,
                    step_id=step.step_id,
                )
            )
        if kind == "step" and step.input_hash != ih:
            raise self.poison(
                NonDeterminismError(
                    f"step {step.step_id} ({name}) is called with other arguments than recorded; "
                    "workflow code between calls must be deterministic (no clock, random or I/O "
                    "outside steps)",
                    run_id=self.run.run_id,
                    step_id=step.step_id,
                )
            )

    def budget(self) -> dict[str, Any]:
        return dict(self.usage)

    def count(self, what: str, amount: float = 1) -> None:
        self.usage[what] = self.usage.get(what, 0) + amount

    async def check_budget(self) -> None:
        """Pause the run (``budget_exceeded``) if its usage is over its workflow's budget."""
        over = self.app.workflow_def(self.run.workflow).budget.exceeded(self.usage)
        if over is None:
            return
        await self.quiesce()
        error = BudgetExceeded(
            f"run {self.run.run_id} is over its budget ({over}); raise the workflow's budget "
            "and resume it, or cancel it",
            run_id=self.run.run_id,
        )
        await self.commit(
            lambda: _ending(RunStatus.PAUSED, PauseReason.BUDGET_EXCEEDED, error, self)
        )
        self.stopped = True
        raise Suspend


def call_step(
    ctx: RunContext,
    sdef: StepDef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    explicit: str | None,
) -> Coroutine[Any, Any, Any]:
    """Allocate the call's step id now (creation order is the deterministic order, also
    for calls gathered in parallel) and return the coroutine that runs or replays it."""
    step_id, position = ctx.allocate(sdef.name, explicit)
    ctx.count("steps")
    arguments = bind_arguments(sdef.signature, sdef.name, args, kwargs)
    ih = input_hash(sdef.name, sdef.version, arguments)
    ctx.replayed(step_id, position, "step", sdef.name, ih)
    return _run_step(ctx, sdef, args, kwargs, step_id, position, ih)


async def _run_step(
    ctx: RunContext,
    sdef: StepDef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    step_id: str,
    position: int,
    ih: str,
) -> Any:
    recorded = ctx.steps.get(step_id)
    if recorded is not None and recorded.status is StepStatus.SUCCEEDED:
        return json.loads(recorded.output_json or "null")
    if recorded is not None and recorded.status is StepStatus.FAILED:
        raise _step_failed(ctx, step_id, recorded.error or {})
    await ctx.boundary()
    await ctx.check_budget()
    attempt = 0
    while True:
        attempt += 1
        # A step another worker may have recorded already is not run again (model calls
        # cost money), nor one whose result this process could no longer record.
        ctx.hold_lease()
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
    await ctx.commit(
        lambda: Transition(
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
        ),
        settle=(step_id, output_json),
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
    run_id: str, steps: list[StepRecord], ops: list[OperationRecord], key: bytes | None
) -> JournalState:
    state = JournalState(run_id=run_id, key=key)
    for step in sorted(
        (s for s in steps if s.settled_sequence is not None), key=lambda s: s.settled_sequence or 0
    ):
        state.settle(step.step_id, step.output_json or "null")
    for op in sorted(ops, key=lambda o: o.created_at):
        if op.status is OperationStatus.SUCCEEDED and op.result_json is not None:
            state.effect_completed(op.idempotency_key)
    return state


async def verified(
    store: Store, journal: Journal, key: bytes | None
) -> tuple[JournalState, EventWrite | None]:
    """The journal's state, verified against its checkpoints (and the event log if needed).

    ``key``, the App's secret, is the only seal trusted on a checkpoint and seals the next.
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
        verification = verify_journal(settled, stored, lambda seq: {}, key)
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

        verification = verify_journal(settled, stored, from_events, key)
    _check_ledger_matches_journal(journal)
    state = _journal_state(run_id, journal.steps, journal.operations, key)
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


def _check_ledger_matches_journal(journal: Journal) -> None:
    """Every settled tool result must be its operation's recorded result, and vice versa.

    The journal is verified against checkpoints and events; the tool ledger is checked
    against the journal, so neither an altered result nor an altered status is replayed.
    """
    ops = {o.idempotency_key: o for o in journal.operations}
    done = (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)
    for step in journal.steps:
        if step.kind != "tool" or step.idempotency_key is None:
            continue
        op = ops.get(step.idempotency_key)
        settled = step.settled_sequence is not None
        if op is None:
            bad = settled
        elif refused_result(op):
            bad = settled  # it happened, and waits for an operator to give its outcome
        elif settled or op.status in done:
            bad = (
                not settled
                or op.status not in done
                or op.result_json is None
                or sha256_hex(op.result_json) != sha256_hex(step.output_json or "null")
            )
        else:
            bad = False
        if bad:
            raise CheckpointCorrupted(
                f"the tool ledger disagrees with the verified journal at {step.step_id} "
                f"(operation {step.idempotency_key}); it was altered. Inspect the run's events "
                "before resolving it by hand",
                run_id=journal.run.run_id,
                step_id=step.step_id,
            )


def refused_result(op: OperationRecord) -> bool:
    """The operation took effect but its result could not be stored (the run paused)."""
    return op.status is OperationStatus.SUCCEEDED and op.result_json is None and bool(op.error)


async def load_context(app: App, claim: Claim) -> RunContext:
    """Read and verify the run's journal; raises CheckpointCorrupted if it cannot be trusted."""
    journal = await app.store.load_journal(claim.run.run_id, checkpoints=CHECKPOINTS_READ)
    assert journal is not None, "a claimed run exists"
    state, corrupted = await verified(app.store, journal, app.secret_key)
    ctx = RunContext(
        app=app,
        store=app.store,
        run=journal.run,
        lease=claim.lease,
        journal=state,
        steps={s.step_id: s for s in journal.steps},
        operations={o.idempotency_key: o for o in journal.operations},
        signals=list(journal.signals),
        cancel_requested=journal.run.cancel_requested,
        lease_deadline=claim.sent_at + claim.lease.ttl_s,
        previous_lease_until=claim.previous_lease_until,
    )
    for approval in journal.approvals:
        ctx.approvals.setdefault(approval.step_id, []).append(approval)
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
        ending = _ending(RunStatus.PAUSED, PauseReason.CHECKPOINT_CORRUPTED, exc, None)
        await app.store.commit(claim.lease, ending)
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
        except Cancel:
            await _cancel(ctx)
            return
        except Exception as exc:
            outcome: BaseException | None = exc
        else:
            outcome = None
        # Parallel calls may still be executing: record their outcomes before the run ends.
        await ctx.quiesce()
        if ctx.stopped:
            # Lease lost or store failure (logged when it happened), possibly swallowed or
            # re-raised as something else by workflow code: nothing more is written.
            return
        failure = ctx.poisoned or outcome
        if failure is not None:
            reason = _PAUSE_REASONS.get(type(failure))
            if reason is not None:
                # The code or the data changed under the run: a person must look; failing
                # it would be final, and guessing would be worse.
                await _finish(ctx, RunStatus.PAUSED, reason, failure)
            else:
                await _finish(ctx, RunStatus.FAILED, None, failure)
            return
        try:
            result_json = canonical_json(
                result, what=f"the result of workflow {wf.name}", limit=app.max_payload_bytes
            )
        except (NotJSONSerializable, PayloadTooLarge) as exc:
            await _finish(ctx, RunStatus.FAILED, None, exc)
            return
        await ctx.commit(
            lambda: Transition(
                events=[
                    EventWrite("run_completed", None, {"result_hash": sha256_hex(result_json)})
                ],
                run=RunUpdate(RunStatus.COMPLETED, result_json=result_json),
                checkpoint=ctx.journal.draft(status=RunStatus.COMPLETED, current_step=None),
                release=True,
            )
        )
    except Suspend:
        return
    finally:
        context._run.reset(token)
        heartbeat.cancel()


def _ending(
    status: RunStatus, reason: PauseReason | None, exc: BaseException, ctx: RunContext | None
) -> Transition:
    """The transition that records a failed or paused run and releases it."""
    error = error_dict(exc)
    if isinstance(exc, DurablyError) and exc.step_id:
        error["step_id"] = exc.step_id
    event = "run_failed" if status is RunStatus.FAILED else "run_paused"
    return Transition(
        events=[EventWrite(event, None, {"reason": reason.value if reason else None, **error})],
        run=RunUpdate(status, status_reason=reason.value if reason else None, error=error),
        checkpoint=ctx.journal.draft(status=status, current_step=None) if ctx else None,
        release=True,
    )


async def _finish(
    ctx: RunContext, status: RunStatus, reason: PauseReason | None, exc: BaseException
) -> None:
    try:
        await ctx.commit(lambda: _ending(status, reason, exc, ctx))
    except (LeaseLostError, StoreUnavailable, Suspend) as lost:
        log.warning("run %s: could not record %s (%r)", ctx.run.run_id, status, lost)


async def _cancel(ctx: RunContext) -> None:
    """Finish a cancelled run: compensate if asked, then record it cancelled (final)."""
    await ctx.quiesce()
    compensated: list[str] = []
    error: dict[str, Any] | None = None
    if ctx.cancel_requested == 2:
        ctx.cancelling = True
        try:
            compensated = await ctx.app.compensate_run(ctx)
        except Exception as exc:
            if ctx.stopped:
                return
            error = error_dict(exc)
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
