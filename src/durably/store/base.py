"""The store contract: records, the one write path (``commit``), claims and reads.

Every write about a run goes through :meth:`Store.commit`, one transaction that is *fenced*:
it applies only if the writer still holds the run (its lease, or the state version it read).
The transaction assigns gap-free event sequences, writes the events and their outbox rows,
the step and tool-operation rows and the checkpoint together, so a crash leaves either all
of a transition or none of it.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from durably.checkpoint import CheckpointDraft
from durably.keys import plain_json
from durably.metrics import LedgerFigures
from durably.status import OperationStatus, RunStatus, StepStatus

RUNNABLE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RECONCILING)
WAITING = (RunStatus.WAITING_EXTERNAL, RunStatus.WAITING_APPROVAL)
CLAIMABLE = RUNNABLE + WAITING
"""Claimed once ``available_at`` is due: a waiting run's is its timer or wait timeout."""
FAR_FUTURE = 1e15
"""``available_at`` of a wait without timeout: only an event makes the run due."""


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    tenant: str
    workflow: str
    workflow_version: str
    plan_version: int
    status: RunStatus
    status_reason: str | None
    input: dict[str, Any]
    input_hash: str
    result_json: str | None
    error: dict[str, Any] | None
    waiting_for: dict[str, Any] | None
    lease_owner: str | None
    lease_until: float | None
    lease_epoch: int
    state_version: int
    last_sequence: int
    available_at: float
    created_at: float
    updated_at: float
    cancel_requested: int = 0
    """0: no; 1: cancel at the next boundary; 2: cancel and compensate."""
    key_scheme: int = 1
    """How this run's idempotency keys are derived (``keys.idempotency_key``); fixed at start."""
    pause_requested: dict[str, Any] | None = None
    """An operator's pause request (the error the paused run shows), until unpaused."""


@dataclass(frozen=True)
class StepRecord:
    run_id: str
    step_id: str
    position: int
    kind: str
    name: str
    status: StepStatus
    input_hash: str
    output_json: str | None
    error: dict[str, Any] | None
    idempotency_key: str | None
    attempts: int
    settled_sequence: int | None
    created_at: float
    updated_at: float
    model_call: dict[str, Any] | None = None
    """A model call's record (model_call_id, model, input, usage, latency...), for a step
    that asked a model; its answer is the output."""


@dataclass(frozen=True)
class OperationRecord:
    tenant: str
    idempotency_key: str
    run_id: str
    step_id: str
    plan_version: int
    tool: str
    tool_version: str
    input_hash: str
    arguments: dict[str, Any]
    status: OperationStatus
    result_json: str | None
    error: dict[str, Any] | None
    failure_category: str | None
    external_operation_id: str | None
    attempt: int
    lease_owner: str | None
    lease_until: float | None
    lease_epoch: int | None
    row_version: int
    created_at: float
    updated_at: float
    origin_key: str | None = None
    """A fork's copy of a call: the key of the operation that made the effect (see
    ``OperationWrite.origin_key``); None: this run made it."""


@dataclass(frozen=True)
class Event:
    run_id: str
    sequence: int
    event_id: str
    type: str
    step_id: str | None
    payload: dict[str, Any]
    created_at: float


@dataclass(frozen=True)
class Signal:
    """An event sent to a run, not yet consumed by a wait."""

    event_id: str
    name: str
    payload: Any
    received_at: float


@dataclass(frozen=True)
class Approval:
    approval_id: str
    run_id: str
    step_id: str
    kind: str
    name: str
    payload: Any
    input_hash: str
    idempotency_key: str | None
    plan_version: int
    status: str
    requested_at: float
    expires_at: float
    decided_at: float | None
    decided_by: str | None
    comment: str | None
    consumed_at: float | None


@dataclass(frozen=True)
class ApprovalRequest:
    """A new approval request; ``replaces`` is an earlier one of the same call, now void."""

    approval_id: str
    step_id: str
    kind: str
    name: str
    payload_json: str
    input_hash: str
    idempotency_key: str | None
    plan_version: int
    expires_at: float
    replaces: str | None = None


@dataclass(frozen=True)
class ApprovalUse:
    """Consume an approved request in the transaction that claims its effect: it must be
    approved, unexpired by the store's clock, and bound to exactly this call."""

    approval_id: str
    input_hash: str
    idempotency_key: str | None
    plan_version: int


@dataclass(frozen=True)
class StoredCheckpoint:
    payload: dict[str, Any]
    checksum: str


@dataclass(frozen=True)
class Lease:
    """The right to write about one run; every commit under it is fenced by (owner, epoch)."""

    run_id: str
    owner: str
    epoch: int
    ttl_s: float


@dataclass(frozen=True)
class Expect:
    """Fence for a writer without a lease (an operator): the run must be unleased and unchanged."""

    run_id: str
    state_version: int


@dataclass(frozen=True)
class NewRun:
    run_id: str
    tenant: str
    workflow: str
    workflow_version: str
    input: dict[str, Any]
    input_json: str
    input_hash: str
    key_scheme: int
    receipt: CheckpointDraft | None = None
    """The run's first checkpoint (empty journal, ``queued``), written with its insert."""


@dataclass(frozen=True)
class StepWrite:
    """Upsert of one step-ledger row. ``settle`` stamps it with this commit's last sequence.

    ``new_row``: the writer knows the step has no row yet (its journal has none), so a
    plain insert does; PostgreSQL writes one cheaper than an upsert.
    """

    step_id: str
    position: int
    kind: str
    name: str
    status: StepStatus
    input_hash: str
    output_json: str | None = None
    error: dict[str, Any] | None = None
    idempotency_key: str | None = None
    attempts: int = 0
    settle: bool = False
    model_call: dict[str, Any] | None = None
    new_row: bool = False


@dataclass(frozen=True)
class OperationWrite:
    """Insert (``expect_row_version=None``) or conditional update of a tool operation.

    ``hold_lease`` stamps the operation with the committing lease (owner, epoch, expiry);
    otherwise its ``lease_until`` keeps ``send_deadline``.
    """

    tenant: str
    idempotency_key: str
    run_id: str
    step_id: str
    plan_version: int
    tool: str
    tool_version: str
    input_hash: str
    arguments_json: str
    status: OperationStatus
    result_json: str | None = None
    error: dict[str, Any] | None = None
    failure_category: str | None = None
    external_operation_id: str | None = None
    attempt: int = 0
    expect_row_version: int | None = None
    hold_lease: bool = False
    send_deadline: float | None = None
    """When no lease holds the operation: the latest moment (store clock) a send of it may
    have started, kept as its ``lease_until``. A reconciliation's "not executed" is trusted
    only once that moment plus the reconcile grace has passed."""
    origin_key: str | None = None
    """A fork's copy of a call another run made: that run's operation key (the first one's,
    through forks of forks). Every run holding a record of the effect undoes it under one
    key derived from it, so it is undone once. Written with the insert only."""

    @classmethod
    def update_of(cls, op: OperationRecord, status: OperationStatus, **changes: Any) -> Self:
        """The conditional update of the recorded ``op`` to ``status``: its fields as recorded,
        but ``changes``; refused if another writer changed its row since it was read."""
        fields: dict[str, Any] = dict(
            tenant=op.tenant,
            idempotency_key=op.idempotency_key,
            run_id=op.run_id,
            step_id=op.step_id,
            plan_version=op.plan_version,
            tool=op.tool,
            tool_version=op.tool_version,
            input_hash=op.input_hash,
            arguments_json=plain_json(op.arguments),
            status=status,
            result_json=op.result_json,
            external_operation_id=op.external_operation_id,
            attempt=op.attempt,
            expect_row_version=op.row_version,
        )
        return cls(**{**fields, **changes})


@dataclass(frozen=True)
class EventWrite:
    type: str
    step_id: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunUpdate:
    status: RunStatus
    status_reason: str | None = None
    result_json: str | None = None
    error: dict[str, Any] | None = None
    waiting_for: dict[str, Any] | None = None
    available_at: float | None = None


@dataclass(frozen=True)
class Transition:
    events: list[EventWrite]
    step: StepWrite | None = None
    operation: OperationWrite | None = None
    run: RunUpdate | None = None
    checkpoint: CheckpointDraft | None = None
    release: bool = False
    consume_signal: tuple[str, str] | None = None
    """(event_id, step_id): the wait at step_id settles with this signal; exactly once."""
    wake_on_signal: str | None = None
    """The run starts waiting for events of this name: if one arrived meanwhile, it is due now."""
    wake_on_approvals: tuple[str, ...] = ()
    """Approvals requested earlier that the run starts waiting for: if one was decided
    meanwhile, it is due now."""
    plan_version: int | None = None
    """The run's new plan version (``durably.replan()``)."""
    cancelling: bool = False
    """Committed by the run's own cancellation (its compensations): a wait it starts, an undo
    asking for approval, is not made due again by the cancel it serves."""
    request_approvals: tuple[ApprovalRequest, ...] = ()
    """New approval requests: the calls of the run that wait for a person together."""
    more_steps: tuple[StepWrite, ...] = ()
    """Step rows written with ``step`` (the other calls waiting for approval with it)."""
    use_approval: ApprovalUse | None = None
    """Raises ApprovalExpired (and nothing of the transition applies) if not usable."""
    read_back: bool = False
    """Read the run after the commit, last in its transaction (``Committed.run``): its
    executor returns the run as its release left it (``App.run``)."""
    at: tuple[int, int] | None = None
    """(state_version, last_sequence) where the lease holder last saw the run. Where the run
    still is there, a backend may seal the checkpoint before the fence returns and commit in one
    statement; a run found elsewhere (a signal arrived, the lease was lost) takes the full
    commit instead."""


@dataclass(frozen=True)
class Committed:
    last_sequence: int
    state_version: int
    operation_row_version: int | None
    lease_until: float | None
    cancel_requested: int = 0
    pause_requested: dict[str, Any] | None = None
    """The operator's pause request, if any: the run pauses at its next boundary."""
    run: RunRecord | None = None
    """The run as the commit left it, if the transition asked for it (``read_back``)."""


CHECKPOINTS_READ = 3
"""Checkpoints a journal holds (the latest first); more are read only when all of these fail
their checksum."""


@dataclass(frozen=True)
class Journal:
    """What a worker needs to resume a run, read in one transaction.

    ``operations`` are found through the step rows: a tool operation is always written in
    the same transaction as its step row (which carries its idempotency key).
    """

    run: RunRecord
    steps: list[StepRecord]
    operations: list[OperationRecord]
    checkpoints: list[StoredCheckpoint]
    signals: list[Signal] = field(default_factory=list)
    """Events delivered to the run and not consumed yet, in arrival order."""
    approvals: list[Approval] = field(default_factory=list)
    """Every approval request of the run, oldest first."""
    recent_events: list[Event] = field(default_factory=list)
    """The events after the run's newest checkpoint: they verify the results settled since."""


@dataclass(frozen=True)
class Claim:
    run: RunRecord
    lease: Lease
    recovered: bool
    """The previous holder's lease had expired while the run was in flight."""
    previous_lease_until: float | None = None
    """When recovered: the previous holder's lease deadline (store clock). A send it began
    before then may still be arriving, so a service's "not executed" is trusted only later."""
    sent_at: float = 0.0
    """``time.monotonic()`` just before the claim was sent: the lease runs out no earlier
    than ``sent_at + ttl`` by this process's clock."""
    journal: Journal | None = None
    """The run's journal as the claim's transaction left it (with ``CHECKPOINTS_READ``
    checkpoints): what the new holder resumes from, without a read of its own."""
    new: bool = False
    """The claim's own transaction created the run (``start_run``): its journal is what
    that transaction wrote, not read back, so there is nothing in it to verify."""


class Store(abc.ABC):
    """A durable store. All methods are coroutines; one method is one transaction."""

    url: str

    @abc.abstractmethod
    async def migrate(self) -> list[int]:
        """Apply pending schema migrations; return the versions applied."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def close_ended_loops(self) -> None:
        """Close what event loops that have ended left open (connections a loop's own
        ``close`` would have closed); needs no event loop."""

    @abc.abstractmethod
    async def now(self) -> float:
        """The store's clock (UTC unix seconds): leases are judged by it, not a worker's."""

    @abc.abstractmethod
    async def create_run(self, new: NewRun) -> tuple[RunRecord, bool]:
        """Insert a queued run (with its ``run_started`` event) or return the existing one."""

    @abc.abstractmethod
    async def create_fork(
        self,
        new: NewRun,
        copies: Sequence[Transition],
        *,
        owner: str | None = None,
        ttl_s: float = 0.0,
    ) -> RunRecord | None:
        """``create_run`` and each of ``copies`` committed to the new run in turn (guarded
        by the state the one before left), in one transaction: no worker sees the run
        before its whole history. ``owner``: the run is then leased to it for ``ttl_s``,
        so that no worker takes it up and the creator's ``claim_run`` does (a what-if is
        executed by whoever asked for it). None, and nothing written, if the run id is
        taken."""

    @abc.abstractmethod
    async def start_run(
        self, new: NewRun, owner: str, ttl_s: float
    ) -> tuple[RunRecord, bool, Claim | None]:
        """``create_run``, and the new run leased to ``owner`` in the same transaction (the
        run is executed by its creator: ``App.run``). An existing run is returned as it is,
        not claimed."""

    @abc.abstractmethod
    async def claim_run(self, run_id: str, owner: str, ttl_s: float) -> Claim | None:
        """Lease this run if it is runnable and not leased by someone alive."""

    @abc.abstractmethod
    async def claim_next(self, owner: str, ttl_s: float, workflows: list[str]) -> Claim | None:
        """Lease the oldest runnable run of one of ``workflows``, if any.

        ``workflows`` are ``"<name>|<version>"`` keys: a worker only claims runs pinned to
        a version of the code it has.
        """

    @abc.abstractmethod
    async def claim_batch(
        self, owner: str, ttl_s: float, workflows: list[str], limit: int
    ) -> list[Claim]:
        """Lease up to ``limit`` runnable runs of ``workflows``, oldest first, in one
        transaction: each as ``claim_next`` would (its own new epoch, its recovery recorded),
        none held by another claimer at the same time."""

    @abc.abstractmethod
    async def heartbeat(self, lease: Lease) -> float:
        """Extend the lease; raise :class:`LeaseLostError` if it is no longer ours."""

    @abc.abstractmethod
    async def live_owners(self) -> list[str]:
        """The owners of the runs' leases that have not run out."""

    @abc.abstractmethod
    async def expire_leases(self, owners: Sequence[str]) -> int:
        """End now the leases of ``owners``, whose processes are gone (on the runs and the
        tool operations they held); returns how many runs can be claimed now."""

    @abc.abstractmethod
    async def commit(self, guard: Lease | Expect, transition: Transition) -> Committed:
        """Apply ``transition`` atomically if ``guard`` still holds (else LeaseLostError or
        InvalidTransition); a failed operation precondition raises InvalidTransition."""

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunRecord | None: ...

    @abc.abstractmethod
    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]: ...

    @abc.abstractmethod
    async def load_journal(
        self, run_id: str, *, checkpoints: int = CHECKPOINTS_READ
    ) -> Journal | None: ...

    @abc.abstractmethod
    async def operation(self, tenant: str, idempotency_key: str) -> OperationRecord | None:
        """The tool operation recorded under this key, whichever run recorded it."""

    @abc.abstractmethod
    async def events(self, run_id: str, *, after: int = 0) -> list[Event]: ...

    @abc.abstractmethod
    async def checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        """All checkpoints of a run, newest first."""

    @abc.abstractmethod
    async def next_wakeup(self, workflows: list[str]) -> float | None:
        """When the next runnable run of ``workflows`` (``"<name>|<version>"`` keys) becomes
        due (None: nothing runnable)."""

    @abc.abstractmethod
    async def deliver_signal(
        self, run_id: str, event_id: str, name: str, payload_json: str
    ) -> bool:
        """Record an event for a run, once per ``event_id`` (False: a duplicate, ignored).

        A run waiting for events of that name becomes due now. Raises RunNotFound, or
        InvalidTransition for a finished run.
        """

    @abc.abstractmethod
    async def request_cancel(self, run_id: str, *, compensate: bool) -> RunRecord:
        """Flag the run for cancellation at its next boundary and make it due if it waits.

        Raises RunNotFound, or InvalidTransition for a finished run.
        """

    @abc.abstractmethod
    async def request_pause(self, run_id: str, request_json: str) -> RunRecord:
        """Record an operator's pause request (once): a queued or waiting run nobody holds
        is paused now; a held one is paused by its holder at its next call boundary.

        Raises RunNotFound, or InvalidTransition for a finished run.
        """

    @abc.abstractmethod
    async def withdraw_pause(self, run_id: str, by: str) -> RunRecord:
        """Withdraw the operator's pause: an operator-paused run is queued, due now.

        Raises RunNotFound, or InvalidTransition for a finished run, one no operator asked
        to pause, or one paused for another reason.
        """

    @abc.abstractmethod
    async def decide_approval(
        self,
        run_id: str,
        approval_id: str | None,
        decision: str,
        by: str,
        comment: str | None,
    ) -> tuple[Approval, bool]:
        """Record ``decision`` ('approved' or 'rejected') on the run's pending approval.

        ``approval_id`` may be omitted when exactly one is pending. Returns the approval and
        whether it had expired (then it is marked expired and the run made due, so that it
        asks again). Raises RunNotFound, or InvalidTransition when nothing is pending, the
        approval was already decided, or several are pending and none was named.
        """

    @abc.abstractmethod
    async def ledger_figures(self) -> LedgerFigures:
        """The ledger's figures for metrics, read in one snapshot: effects an operator must
        settle (unknown, reconciling, or executing past their lease), duplicates found,
        replays blocked and approvals expired."""

    @abc.abstractmethod
    async def undelivered(
        self, consumer: str, limit: int, *, skip_runs: Sequence[str] = ()
    ) -> list[Event]:
        """Events ``consumer`` has not acknowledged, oldest first, in order within a run,
        leaving out the runs in ``skip_runs`` (held back by a failing handler)."""

    @abc.abstractmethod
    async def acknowledge(self, consumer: str, event_id: str) -> bool:
        """Record that ``consumer`` processed the event (False: it already had)."""

    async def wait_for_work(self, timeout_s: float) -> bool:
        """Sleep until a run may have become runnable (True) or ``timeout_s`` passed (False).

        The default just sleeps (callers poll); a backend with notifications wakes earlier.
        """
        await asyncio.sleep(timeout_s)
        return False


# The password runs from the user's colon to the last @: a malformed URL may hold any
# character in it (an unencoded @, /, ? or #), and masking some of the host is no loss.
_URL_PASSWORD = re.compile(r"(//[^/?#@:]*:)(.*)@", re.DOTALL)
_QUERY_PASSWORD = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` fit for an error message, a log line or an API answer: without its password
    (in the authority or as a ``password=`` parameter).

    A pattern, not a URL parser: it must also work on the malformed URLs it reports.
    """
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url))


def without_secrets(text: str, url: str) -> str:
    """``text`` (a driver's message about ``url``, which may quote any part of it) with the
    URL's password masked wherever it appears, whole or in pieces: a driver that misreads
    a malformed URL may quote the part of the password after a space or an @ as a host."""
    secrets = [m.group(2) for m in (_URL_PASSWORD.search(url),) if m]
    secrets += [m.group(2) for m in _QUERY_PASSWORD.finditer(url)]
    pieces = [p for s in secrets for p in re.split(r"[\s/?#@:\[\]]+", s) if len(p) >= 3]
    for secret in sorted({*filter(None, secrets), *pieces}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return shown_url(text)
