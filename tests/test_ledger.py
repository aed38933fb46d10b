"""The ledger's decision matrix, checked over every combination hypothesis can build."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from durably.ledger import Action, OperationView, decide
from durably.status import FailureCategory, OperationStatus

NOW = 1000.0
ME, MY_EPOCH = "me", 7

views = st.builds(
    OperationView,
    status=st.sampled_from(OperationStatus),
    input_hash=st.sampled_from(["h", "other"]),
    attempt=st.integers(0, 5),
    failure_category=st.none() | st.sampled_from(FailureCategory),
    confirmed_not_executed=st.booleans(),
    lease_owner=st.sampled_from([None, ME, "them"]),
    lease_epoch=st.sampled_from([None, MY_EPOCH, MY_EPOCH - 1]),
    lease_until=st.sampled_from([None, NOW - 1, NOW + 10]),
)


def decide_for(op: OperationView | None, can_reconcile: bool, max_attempts: int = 3) -> Action:
    return decide(
        op,
        input_hash="h",
        owner=ME,
        epoch=MY_EPOCH,
        now=NOW,
        max_attempts=max_attempts,
        can_reconcile=can_reconcile,
    )


def test_no_record_prepares_first() -> None:
    assert decide_for(None, True) is Action.PREPARE


@given(views, st.booleans())
def test_other_input_is_always_a_conflict(op: OperationView, can_reconcile: bool) -> None:
    if op.input_hash != "h":
        assert decide_for(op, can_reconcile) is Action.CONFLICT


@given(views, st.booleans())
def test_recorded_success_is_returned_never_executed(op: OperationView, rec: bool) -> None:
    action = decide_for(op, rec)
    if op.input_hash == "h" and op.status in (
        OperationStatus.SUCCEEDED,
        OperationStatus.COMPENSATED,
    ):
        assert action is Action.RETURN
    if action is Action.RETURN:
        assert op.status in (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)


@given(views, st.booleans())
def test_execution_only_under_this_executions_claim(op: OperationView, rec: bool) -> None:
    """EXECUTE happens only for an operation this very lease claimed."""
    if decide_for(op, rec) is Action.EXECUTE:
        assert op.status is OperationStatus.EXECUTING
        assert (op.lease_owner, op.lease_epoch) == (ME, MY_EPOCH)


@given(views, st.booleans())
def test_uncertain_outcomes_are_never_retried_blindly(op: OperationView, rec: bool) -> None:
    """Unknown, reconciling or another holder's execution never leads to a new execution."""
    uncertain = op.status in (OperationStatus.UNKNOWN, OperationStatus.RECONCILING) or (
        op.status is OperationStatus.EXECUTING
        and (op.lease_owner, op.lease_epoch) != (ME, MY_EPOCH)
    )
    if op.input_hash == "h" and uncertain:
        assert decide_for(op, rec) in (Action.RECONCILE, Action.PAUSE, Action.WAIT)
        if not rec:
            assert decide_for(op, rec) in (Action.PAUSE, Action.WAIT)


@given(views, st.booleans())
def test_live_foreign_lease_is_waited_for(op: OperationView, rec: bool) -> None:
    foreign = (op.lease_owner, op.lease_epoch) != (ME, MY_EPOCH)
    live = op.lease_until is not None and op.lease_until > NOW
    if op.input_hash == "h" and op.status is OperationStatus.EXECUTING and foreign and live:
        assert decide_for(op, rec) is Action.WAIT


@given(views, st.booleans(), st.integers(1, 5))
def test_retries_only_where_safe_and_bounded(op: OperationView, rec: bool, limit: int) -> None:
    action = decide_for(op, rec, max_attempts=limit)
    if action is Action.RETRY:
        assert op.status is OperationStatus.FAILED
        assert op.attempt < limit
        assert op.failure_category in (
            FailureCategory.TRANSIENT_BEFORE_SEND,
            FailureCategory.RATE_LIMIT,
        ) or (
            op.failure_category is FailureCategory.TRANSIENT_AFTER_SEND
            and op.confirmed_not_executed
        )


@given(views, st.booleans())
def test_permission_and_business_failures_are_never_retried(op: OperationView, rec: bool) -> None:
    if op.input_hash == "h" and op.status is OperationStatus.FAILED:
        action = decide_for(op, rec)
        if op.failure_category is FailureCategory.PERMISSION:
            assert action is Action.PAUSE
        if op.failure_category in (
            FailureCategory.BUSINESS_REJECTED,
            FailureCategory.PERMANENT_INPUT,
        ):
            assert action is Action.RAISE


def test_intent_never_claimed_is_claimed() -> None:
    op = OperationView(OperationStatus.INTENT_RECORDED, "h", 0, None, False, None, None, None)
    assert decide_for(op, False) is Action.CLAIM
