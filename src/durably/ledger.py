"""The ledger's decision matrix, as pure logic (docs/architecture.md#the-decision-matrix).

Given what the ledger holds for an idempotency key, :func:`decide` says what the runtime
must do next. It touches no database, so it is tested exhaustively on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from durably.status import FailureCategory, OperationStatus


class Action(Enum):
    PREPARE = "prepare"
    """No record: commit the intent before anything leaves the process."""
    CONFLICT = "conflict"
    """Same key, different input: refuse, never reuse the result."""
    RETURN = "return"
    """Already succeeded: return the recorded result (an idempotency hit)."""
    CLAIM = "claim"
    """Intent recorded and never claimed: claim it, then execute."""
    EXECUTE = "execute"
    """Claimed by this very execution: call the tool."""
    WAIT = "wait"
    """Another live holder may be executing it: wait, do not execute."""
    RECONCILE = "reconcile"
    """The outcome is not known: ask the external system before anything else."""
    RETRY = "retry"
    """Failed in a way that is safe to repeat, with attempts left: claim again after a delay."""
    RAISE = "raise"
    """Failed for good: raise in the workflow."""
    PAUSE = "pause"
    """Only a person can decide: pause the run."""


@dataclass(frozen=True)
class OperationView:
    """The fields of a ledger row the decision depends on."""

    status: OperationStatus
    input_hash: str
    attempt: int
    failure_category: FailureCategory | None
    confirmed_not_executed: bool
    lease_owner: str | None
    lease_epoch: int | None
    lease_until: float | None


_RETRYABLE = frozenset({FailureCategory.TRANSIENT_BEFORE_SEND, FailureCategory.RATE_LIMIT})


def decide(
    op: OperationView | None,
    *,
    input_hash: str,
    owner: str,
    epoch: int,
    now: float,
    max_attempts: int,
    can_reconcile: bool,
) -> Action:
    if op is None:
        return Action.PREPARE
    if op.input_hash != input_hash:
        return Action.CONFLICT
    status = op.status
    if status in (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED):
        return Action.RETURN
    if status is OperationStatus.INTENT_RECORDED:
        return Action.CLAIM
    if status is OperationStatus.EXECUTING:
        if op.lease_owner == owner and op.lease_epoch == epoch:
            return Action.EXECUTE
        if op.lease_until is not None and op.lease_until > now:
            return Action.WAIT
        return Action.RECONCILE if can_reconcile else Action.PAUSE
    if status in (OperationStatus.UNKNOWN, OperationStatus.RECONCILING):
        return Action.RECONCILE if can_reconcile else Action.PAUSE
    # FAILED
    category = op.failure_category
    if category is FailureCategory.PERMISSION:
        return Action.PAUSE
    retryable = category in _RETRYABLE or (
        category is FailureCategory.TRANSIENT_AFTER_SEND and op.confirmed_not_executed
    )
    if retryable:
        return Action.RETRY if op.attempt < max_attempts else Action.RAISE
    if category is FailureCategory.TRANSIENT_AFTER_SEND:
        if not can_reconcile:
            return Action.PAUSE
        return Action.RECONCILE if op.attempt < max_attempts else Action.RAISE
    return Action.RAISE
