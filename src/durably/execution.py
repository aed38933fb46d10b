"""One execution of one run by one lease holder: its state, its commits, its stop signals.

The workflow's coroutine, the step and tool calls it makes, and the waits all share one
:class:`RunContext`. Control flow that must stop the workflow (the run suspended, paused or
cancelled) is a ``BaseException``, so no ``except Exception`` in workflow or framework code
can swallow it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NoReturn

from durably import faults
from durably.approval_join import AwaitedApproval, JoinsApprovals
from durably.calls import CallIdentity, Scope, prefix_of
from durably.checkpoint import JournalState
from durably.errors import (
    BudgetExceeded,
    DurablyError,
    InvalidTransition,
    LeaseLostError,
    NonDeterminismError,
    StoreUnavailable,
)
from durably.status import PauseReason, RunStatus
from durably.stops import Cancel, Suspend
from durably.store.base import (
    Approval,
    Committed,
    EventWrite,
    Lease,
    OperationRecord,
    RunRecord,
    RunUpdate,
    Signal,
    StepRecord,
    Store,
    Transition,
)
from durably.values import storable_text

if TYPE_CHECKING:
    from durably.engine import Engine

log = logging.getLogger("durably")


def error_dict(exc: BaseException) -> dict[str, Any]:
    """An exception as recorded: its message may hold anything (a NUL, a lone surrogate from
    a cut-off response), and recording the outcome must not fail on it."""
    return {"type": type(exc).__name__, "message": storable_text(str(exc))}


@dataclass
class RunContext(CallIdentity, JoinsApprovals):
    """One execution of one run by one lease holder."""

    engine: Engine
    store: Store
    run: RunRecord
    lease: Lease
    journal: JournalState
    steps: dict[str, StepRecord]
    operations: dict[str, OperationRecord]
    root: Scope = field(init=False)
    """The workflow's own sequence of positional calls (outside any gather branch)."""
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
    by_position: dict[tuple[str, int], StepRecord] = field(init=False)
    """Recorded positional calls by (scope prefix, position); calls with an explicit step
    id are recorded at position 0 and matched by their id alone."""
    reached: dict[str, None] = field(default_factory=dict)
    """Step ids allocated in this execution, in order (a dict: a long run checks each new
    id against all of them)."""
    patches: dict[str, bool] = field(default_factory=dict)
    """``durably.patched()`` decisions of this execution, by marker step id."""
    unawaited: dict[str, tuple[str, Coroutine[Any, Any, Any]]] = field(default_factory=dict)
    """Calls created (their step id allocated) but not awaited yet, by step id: one left
    at the end of the workflow is a missing ``await``, and its effect never happened."""
    starting: dict[str, None] = field(default_factory=dict)
    """Calls begun (awaited, or their task ran) and not yet in flight nor ended, by step id:
    such a call, made from a task the workflow did not wait for, still lands when the
    workflow returns (:meth:`let_started_calls_start`)."""
    all_begun: asyncio.Future[None] | None = None
    """Set once no call is starting, while the run's end waits for that."""
    inflight: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    """Tool executions between their call and their recorded outcome."""
    signals: list[Signal] = field(default_factory=list)
    """Events delivered to the run and not consumed yet, in arrival order."""
    cancel_requested: int = 0
    """0: no; 1: cancel at the next boundary; 2: cancel and compensate."""
    cancelling: bool = False
    cancel_raised: bool = False
    """Set once a call boundary stopped the run for its cancellation: the run ends cancelled
    even if workflow code caught the stop (``except BaseException``) and returned."""
    pause_requested: dict[str, Any] | None = None
    """An operator's pause request (the error the paused run shows): the run pauses at its
    next boundary."""
    closing: bool = False
    """Set when this execution is about to release the run: no step or tool call starts."""
    releasing: bool = False
    """Set once a branch began releasing the run (:meth:`release`): its commit ends it."""
    approvals: dict[str, list[Approval]] = field(default_factory=dict)
    """The run's approval requests by step id, oldest first."""
    usage: dict[str, float] = field(default_factory=dict)
    """Steps, tool calls, tokens and cost so far (recomputed by every replay)."""
    plan_version: int = 1
    """The plan version at this point of the execution: replay starts at 1 and each
    recorded ``replan()`` bumps it, so every call derives the key it had originally."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises this run's commits, so that checkpoints follow the order results commit in
    (parallel calls would otherwise race on separate connections)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once this execution released the run (see :meth:`release`)."""
    reports_run: bool = False
    """Whether this execution's caller returns the run as its release leaves it
    (``App.run``): then the commit that releases it reads it back (``released_as``)."""
    released_as: RunRecord | None = None
    """The run as the commit that released it left it, if ``reports_run``."""
    lease_deadline: float = float("inf")
    """``time.monotonic()`` by which the lease has run out unless renewed: the store fences
    late writes, but only this process can stop itself from sending late."""
    previous_lease_until: float | None = None
    """The previous holder's lease deadline (store clock), if this execution recovered the
    run from another holder whose sends may still be arriving."""
    awaited: list[AwaitedApproval] | None = None
    """The calls waiting for an approval, once one of them suspends the run: its parallel
    calls that need one too join them, so that a person sees and decides them all at once."""
    unsettled: set[str] = field(default_factory=set)
    """Keys of the operations a recovered run found unsettled (executing, unknown, being
    reconciled): the run is ``reconciling`` until each is settled or re-sent."""
    at: tuple[int, int] | None = None
    """(state_version, last_sequence) where this execution last saw the run: its journal, then
    each of its commits."""

    def __post_init__(self) -> None:
        self.root = Scope(self)
        self.by_position = {
            (prefix_of(s.step_id, s.name), s.position): s
            for s in self.steps.values()
            if s.position > 0
        }

    def check_running(self) -> None:
        """Refuse any new call once the run must stop: whatever workflow or framework code
        did with the first stop signal, nothing more of the run executes here."""
        if self.stopped or self.poisoned is not None:
            raise Suspend(self.poisoned or self.lost)

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
            run.pause_requested,
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

    def hold_lease(self, call: int | None = None) -> None:
        """:meth:`check_lease` for the runtime itself, right before a step body or a tool
        call starts: the stop unwinds the workflow as ``Suspend``, which no ``except
        Exception`` in workflow or framework code can swallow. Once the execution is closing
        only a tool call already in flight (``call``) may still go on: the release waits
        for it."""
        if self.closing and (call is None or call not in self.inflight):
            raise Suspend
        if self.poisoned is not None:
            raise Suspend(self.poisoned)
        try:
            self.check_lease()
        except DurablyError as exc:
            raise Suspend(exc) from exc

    def stop_writing(self, reason: DurablyError) -> None:
        self.stopped = True
        if self.lost is None:
            self.lost = reason
            log.warning("run %s: stopped (%s)", self.run.run_id, reason)

    def poison(self, error: DurablyError) -> Suspend:
        """Record a divergence the run must pause with, and the stop to raise for it: no
        ``except Exception`` can catch it, and no later call of the run executes."""
        if self.poisoned is None:
            self.poisoned = error
        stop = Suspend(error)
        stop.__cause__ = error
        return stop

    async def release(
        self, record: Callable[[], Awaitable[object]], *, exclude: int | None = None
    ) -> NoReturn:
        """End this execution here: once the run's in-flight calls have landed, ``record``
        commits the transition that releases the run (paused, waiting, released); then the
        workflow unwinds. Whatever ``record`` does, the execution is over afterwards, so the
        driver, unwound by another branch meanwhile, can wait for this one to finish."""

        self.releasing = True

        async def releasing() -> None:
            try:
                await self.quiesce(exclude=exclude)
                await record()
            finally:
                self.stopped = True
                self.ended.set()

        # Shielded: a branch cancelled meanwhile (a TaskGroup cancels the other tasks once
        # one of them stops) must still record the release, or the run would stay leased
        # with nothing recorded; the driver waits for it (wind_up).
        task = asyncio.ensure_future(releasing())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(task)
        raise Suspend

    async def wind_up(self) -> None:
        """Wait for a branch that is releasing the run (:meth:`release`) to finish: other
        branches unwind at once (no call may start), and the run must not be handed back
        before its release is recorded."""
        if self.releasing and not self.stopped:
            await self.ended.wait()

    async def quiesce(self, *, exclude: int | None = None, closing: bool = True) -> None:
        """Wait until the run's other in-flight tool executions have recorded their outcome.

        Parallel calls keep running when one of them fails or pauses the run; their
        outcomes must be recorded before the run is released, or they would need
        reconciling although this worker knew them. ``closing``: the execution is about to
        release the run, so no call may start any more (:meth:`hold_lease`): one starting
        after this wait would send while nobody holds the run.
        """
        if closing:
            self.closing = True
        if exclude is not None:
            self.landed(exclude)  # it waits here and sends nothing more: nobody waits for it
        pending = list(self.inflight.values())
        if pending:
            await asyncio.wait([asyncio.shield(f) for f in pending])

    async def let_started_calls_start(self) -> None:
        """Before the workflow's return ends the run: wait until every call begun in a task
        it left running is in flight (its outcome is then waited for) or has ended, so that
        none is dropped halfway through its start."""
        while self.starting and not self.closing:
            self.all_begun = asyncio.get_running_loop().create_future()
            await self.all_begun

    async def after_recovered_calls(self) -> None:
        """A new tool call of a ``reconciling`` run waits while a call the run found
        unsettled on recovery, which another branch has reached, is still being settled:
        the run makes no new effect until it is ``running`` again. A recovered call not
        reached yet is not waited for: the branch that reaches it may wait on this one."""
        while self.unsettled and not self.closing:
            reached = [
                op for key, op in self.operations.items()
                if key in self.unsettled and op.step_id in self.reached
            ]  # fmt: skip
            pending = list(self.inflight.values())
            if not reached or not pending:
                break
            await asyncio.wait([asyncio.shield(f) for f in pending], return_when="FIRST_COMPLETED")
        if self.closing:
            raise Suspend

    def in_flight(self, call: int, step_id: str, *, asking: bool = False) -> InFlight:
        """A tool call between its start and its recorded outcome: the run is released only
        after it lands. None starts once the execution is closing, but one ``asking`` for
        an approval while the run is being suspended for approvals: it only joins them."""
        if self.closing and not (asking and self.awaited is not None):
            raise Suspend
        return InFlight(self, call, step_id)

    def landed(self, call: int) -> None:
        done = self.inflight.pop(call, None)
        if done is not None and not done.done():
            done.set_result(None)

    def stop_for_cancel(self) -> NoReturn:
        """Stop the workflow here for the run's cancellation (see ``cancel_raised``)."""
        self.cancel_raised = True
        raise Cancel

    async def boundary(self, *, compensating: bool = False) -> None:
        """Before a call starts: stop here if the run is cancelled, pause it if an operator
        asked, or release it if the worker is shutting down. Never in the middle of an
        effect. While a cancelled run compensates, only its compensations go on."""
        if self.cancel_requested and not (self.cancelling and compensating):
            self.stop_for_cancel()
        if self.pause_requested is not None and not self.cancelling and not self.stopped:
            await self.release(lambda: self.commit(lambda: operator_paused(self)))
        if self.draining is not None and self.draining.is_set() and not self.stopped:
            await self.release(lambda: self.commit(released("shutdown")))

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
            before = self.journal.copy()
            if settle is not None:
                self.journal.settle(*settle)
            if effect is not None:
                self.journal.effect_completed(effect)
            self.journal.budget = self.budget()
            t = transition() if callable(transition) else transition
            if self.at is not None and (
                t.checkpoint is not None or t.operation is not None or t.run is not None
            ):
                t = replace(t, at=self.at)  # see Transition.at
            if t.release and self.reports_run:
                t = replace(t, read_back=True)
            if self.cancelling:
                t = replace(t, cancelling=True)
            sent_at = time.monotonic()
            try:
                committed = await (
                    self._outlast(t) if durable else self.store.commit(self.lease, t)
                )
            except (LeaseLostError, StoreUnavailable) as exc:
                self.stop_writing(exc)
                raise Suspend(exc) from exc
            except BaseException:
                self.journal = before  # refused: the journal stays as the store has it
                raise
            self.at = (committed.state_version, committed.last_sequence)
            self.cancel_requested = committed.cancel_requested
            self.pause_requested = committed.pause_requested
            if t.release:
                self.released_as = committed.run
            else:
                self.renewed(sent_at)
        if t.checkpoint is not None:
            faults.crash_point("checkpoint.after_write")
        return committed

    def budget(self) -> dict[str, Any]:
        return dict(self.usage)

    def count(self, what: str, amount: float = 1) -> None:
        self.usage[what] = self.usage.get(what, 0) + amount

    async def check_budget(self) -> None:
        """Pause the run (``budget_exceeded``) if its usage is over its workflow's budget."""
        over = self.engine.registry.workflow_def(self.run.workflow).budget.exceeded(self.usage)
        if over is None:
            return
        error = BudgetExceeded(
            f"run {self.run.run_id} is over its budget ({over}); raise the workflow's budget "
            "and resume it, or cancel it",
            run_id=self.run.run_id,
        )
        await self.release(
            lambda: self.commit(
                lambda: ending(RunStatus.PAUSED, PauseReason.BUDGET_EXCEEDED, error, self)
            )
        )


class InFlight:
    """``async with ctx.in_flight(call)``: a class, not an @asynccontextmanager, because
    every step enters one, and a generator-based one costs several times as much."""

    __slots__ = ("_call", "_ctx", "_step_id")

    def __init__(self, ctx: RunContext, call: int, step_id: str) -> None:
        self._ctx = ctx
        self._call = call
        self._step_id = step_id

    async def __aenter__(self) -> None:
        self._ctx.inflight[self._call] = asyncio.get_running_loop().create_future()
        self._ctx.begun(self._step_id)

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._ctx.landed(self._call)


def ending(
    status: RunStatus, reason: PauseReason | None, exc: BaseException, ctx: RunContext | None
) -> Transition:
    """The transition that records a failed or paused run and releases it."""
    error = error_dict(exc)
    if isinstance(exc, DurablyError) and exc.step_id:
        error["step_id"] = exc.step_id
    if isinstance(exc, NonDeterminismError) and exc.divergence is not None:
        error["divergence"] = exc.divergence
    event = "run_failed" if status is RunStatus.FAILED else "run_paused"
    return Transition(
        events=[EventWrite(event, None, {"reason": reason.value if reason else None, **error})],
        run=RunUpdate(status, status_reason=reason.value if reason else None, error=error),
        checkpoint=ctx.journal.draft(status=status, current_step=None) if ctx else None,
        release=True,
    )


def released(reason: str) -> Transition:
    """The transition that hands the run back, runnable at once, for whoever goes on."""
    return Transition(events=[EventWrite("run_released", None, {"reason": reason})], release=True)


def operator_paused(ctx: RunContext) -> Transition:
    """The transition that pauses the run for the operator who asked, and releases it."""
    assert ctx.pause_requested is not None
    error = dict(ctx.pause_requested)
    reason = PauseReason.OPERATOR.value
    return Transition(
        events=[EventWrite("run_paused", None, {"reason": reason, **error})],
        run=RunUpdate(RunStatus.PAUSED, status_reason=reason, error=error),
        checkpoint=ctx.journal.draft(status=RunStatus.PAUSED, current_step=None),
        release=True,
    )


__all__ = [
    "AwaitedApproval",
    "Cancel",
    "RunContext",
    "Suspend",
    "ending",
    "error_dict",
    "operator_paused",
    "released",
]
