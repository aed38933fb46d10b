"""Status sets and categories whose names are a contract (docs/architecture.md#status-sets)."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is. ``completed``, ``failed`` and ``cancelled`` are final."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING_APPROVAL = "waiting_approval"
    WAITING_EXTERNAL = "waiting_external"
    PAUSED = "paused"
    RECONCILING = "reconciling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in _FINAL_RUN


_FINAL_RUN = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})


class StepStatus(StrEnum):
    """Where one call (step or tool) of a run is, in the step ledger."""

    PENDING = "pending"
    READY = "ready"
    INTENT_RECORDED = "intent_recorded"
    EXECUTING = "executing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    RECONCILING = "reconciling"
    WAITING_APPROVAL = "waiting_approval"
    CANCELLED = "cancelled"


class OperationStatus(StrEnum):
    """Where an external side effect is, in the tool operation ledger."""

    INTENT_RECORDED = "intent_recorded"
    EXECUTING = "executing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    RECONCILING = "reconciling"
    COMPENSATED = "compensated"


class FailureCategory(StrEnum):
    """How a tool call failed, which decides whether retrying it is safe."""

    TRANSIENT_BEFORE_SEND = "TRANSIENT_BEFORE_SEND"
    """The request never left: safe to retry."""
    TRANSIENT_AFTER_SEND = "TRANSIENT_AFTER_SEND"
    """The request left and failed in a way that may be retried, after reconciling."""
    PERMANENT_INPUT = "PERMANENT_INPUT"
    """The input is wrong: fail the step; the workflow may replan."""
    PERMISSION = "PERMISSION"
    """Not allowed: pause until re-authorised; never retried automatically."""
    RATE_LIMIT = "RATE_LIMIT"
    """Throttled before acting: retry after the advised delay."""
    UNKNOWN_OUTCOME = "UNKNOWN_OUTCOME"
    """The request may have taken effect: reconcile, never retry blindly."""
    BUSINESS_REJECTED = "BUSINESS_REJECTED"
    """The service said no for a business reason: fail, no retry."""


class ReplayMode(StrEnum):
    """What an effect does when history is replayed (fork/replay)."""

    DISABLED = "DISABLED"
    RECORDED = "RECORDED"
    SANDBOX = "SANDBOX"
    LIVE_WITH_NEW_APPROVAL = "LIVE_WITH_NEW_APPROVAL"


class PauseReason(StrEnum):
    """Why a run is ``paused``; each needs a person or a fix before ``resume``."""

    EFFECT_STATE_UNKNOWN = "effect_state_unknown"
    PERMISSION = "permission_denied"
    CHECKPOINT_CORRUPTED = "checkpoint_corrupted"
    CHECKPOINT_NOT_MIGRATABLE = "checkpoint_not_migratable"
    """The newest intact checkpoint has a schema version this code cannot read (newer, or
    no migration registered): run the newer durably, or register the migration, then
    ``resume``."""
    NON_DETERMINISM = "non_determinism"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    BUDGET_EXCEEDED = "budget_exceeded"
    RESULT_NOT_STORABLE = "result_not_storable"
    """A tool took effect but returned a value no store can hold; an operator records the
    service's real outcome with ``resolve --succeeded --result``."""
    REPLAY_BLOCKED = "replay_blocked"
    """A fork reached a call its replay mode does not let through; nothing was sent."""
    OPERATOR = "operator_pause"
    """An operator paused the run (``pause``), at its next call boundary: ``unpause``
    continues it."""
    CALL_NOT_AWAITED = "call_not_awaited"
    """The workflow returned leaving a step or tool call it created un-awaited (a missing
    ``await``): that call never happened; fix the code, then ``resume``."""
