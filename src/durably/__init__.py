"""durably — durable execution for AI agents whose tools have real side effects.

Every business effect takes effect exactly once, whatever crashes, retries or replays
happen, for tools whose service honours the idempotency key (``idempotent=True``) or can be
asked what happened (``reconcile=``). Any other uncertain outcome stops at ``unknown`` and
goes to a person; durably never guesses.
"""

from __future__ import annotations

from durably.app import App
from durably.checkpoint import Checkpoint, register_checkpoint_migration
from durably.context import (
    RunInfo,
    check_lease,
    current_run,
    external_id,
    fenced,
    fencing_token,
    idempotency_key,
)
from durably.definitions import Budget, RetryPolicy
from durably.errors import (
    ApprovalExpired,
    ApprovalRejected,
    BudgetExceeded,
    CheckpointCorrupted,
    CheckpointNotMigratable,
    ConfigurationError,
    DurablyError,
    IdempotencyConflict,
    InputError,
    InvalidInput,
    InvalidTransition,
    LeaseLostError,
    NonDeterminismError,
    NotAwaited,
    NotJSONSerializable,
    OutcomeUnknown,
    OutsideRunError,
    PayloadTooLarge,
    ReplayBlocked,
    RunNotFound,
    RunStopError,
    RunStopped,
    SchemaTooNew,
    StepFailed,
    StoreError,
    StoreUnavailable,
    ToolError,
    WaitTimeout,
)
from durably.faults import crash_point
from durably.reconcile import Operation, Reconciliation
from durably.registration import Durable
from durably.status import (
    FailureCategory,
    OperationStatus,
    PauseReason,
    ReplayMode,
    RunStatus,
    StepStatus,
)
from durably.store.base import Approval, Event
from durably.subscription import Subscription
from durably.views import Run
from durably.waits import approval, replan, sleep, wait_for_event
from durably.whatif import Divergence, ReplayReport
from durably.workflow_api import charge, compensate, gather, patched

__all__ = [
    "App",
    "Approval",
    "ApprovalExpired",
    "ApprovalRejected",
    "Budget",
    "BudgetExceeded",
    "Checkpoint",
    "CheckpointCorrupted",
    "CheckpointNotMigratable",
    "ConfigurationError",
    "Divergence",
    "Durable",
    "DurablyError",
    "Event",
    "FailureCategory",
    "IdempotencyConflict",
    "InputError",
    "InvalidInput",
    "InvalidTransition",
    "LeaseLostError",
    "NonDeterminismError",
    "NotAwaited",
    "NotJSONSerializable",
    "Operation",
    "OperationStatus",
    "OutcomeUnknown",
    "OutsideRunError",
    "PauseReason",
    "PayloadTooLarge",
    "Reconciliation",
    "ReplayBlocked",
    "ReplayMode",
    "ReplayReport",
    "RetryPolicy",
    "Run",
    "RunInfo",
    "RunNotFound",
    "RunStatus",
    "RunStopError",
    "RunStopped",
    "SchemaTooNew",
    "StepFailed",
    "StepStatus",
    "StoreError",
    "StoreUnavailable",
    "Subscription",
    "ToolError",
    "WaitTimeout",
    "approval",
    "charge",
    "check_lease",
    "compensate",
    "crash_point",
    "current_run",
    "external_id",
    "fenced",
    "fencing_token",
    "gather",
    "idempotency_key",
    "patched",
    "register_checkpoint_migration",
    "replan",
    "sleep",
    "wait_for_event",
]
