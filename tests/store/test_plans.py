"""The commit sequencing, without a database: which statements, in which round trip, and
what a missing row means. The contract suite (tests/contract) runs the same plans on both
backends."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from durably.checkpoint import JournalState
from durably.errors import ApprovalExpired, InvalidTransition, LeaseLostError
from durably.status import OperationStatus, RunStatus, StepStatus
from durably.store import commit_plan
from durably.store.base import (
    ApprovalUse,
    Committed,
    EventWrite,
    Expect,
    Lease,
    OperationWrite,
    RunUpdate,
    StepWrite,
    Transition,
)
from durably.store.plans import Plan, Round

LEASE = Lease("r1", "worker", 3, 30.0)
FENCED = [
    {
        "last_sequence": 7,
        "state_version": 9,
        "lease_until": 99.0,
        "cancel_requested": 0,
        "pause_requested": None,
    }
]


def step_commit(**changes: Any) -> Transition:
    fields: dict[str, Any] = {
        "events": [EventWrite("step_completed", "s#1")],
        "step": StepWrite("s#1", 1, "step", "s", StepStatus.SUCCEEDED, "h", "1", settle=True),
        "checkpoint": JournalState("r1").draft(status="running", current_step="s#1"),
    }
    return Transition(**{**fields, **changes})


def operation(**changes: Any) -> OperationWrite:
    fields: dict[str, Any] = {
        "tenant": "t",
        "idempotency_key": "k",
        "run_id": "r1",
        "step_id": "s#1",
        "plan_version": 1,
        "tool": "mail",
        "tool_version": "1",
        "input_hash": "h",
        "arguments_json": "{}",
        "status": OperationStatus.EXECUTING,
        "hold_lease": True,
    }
    return OperationWrite(**{**fields, **changes})


def names(round_: Round) -> list[str]:
    return [name for name, _ in round_.queries]


def first_round(plan: Plan[Committed]) -> Round:
    return next(plan)


def test_a_step_without_a_checkpoint_commits_in_one_round() -> None:
    """Most steps: the fence and writes conditional on it, one PostgreSQL round trip."""
    two_events = [EventWrite("a", "s#1"), EventWrite("step_completed", "s#1")]
    plan = commit_plan.commit(LEASE, step_commit(checkpoint=None, events=two_events))
    only = first_round(plan)
    assert names(only) == ["fence_lease", "insert_event_fenced", "insert_event_fenced",
                           "upsert_step_fenced"]  # fmt: skip
    assert only.final
    _, first, second, step = (params for _, params in only.queries)
    assert (first["back"], second["back"]) == (1, 0)  # counted back from the fence's sequence
    for params in (first, second, step):
        assert (params["owner"], params["epoch"]) == (LEASE.owner, LEASE.epoch)
    assert step["settle"] is True
    with pytest.raises(StopIteration) as done:
        plan.send([FENCED, [], [], []])
    assert done.value.value == Committed(7, 9, None, 99.0, 0)


def test_only_a_step_whose_row_is_new_commits_as_one_statement() -> None:
    """Where the backend has ``commit_step`` (a plain insert), a step whose writer knows it
    has no row yet takes it; any other step's row is upserted, after the fence."""
    new = replace(step_commit(checkpoint=None).step, new_row=True)
    plan = commit_plan.commit(LEASE, step_commit(checkpoint=None, step=new), step_statement=True)
    (statement,) = first_round(plan).queries
    assert statement[0] == "commit_step"
    assert (statement[1]["step_id"], statement[1]["settle"]) == ("s#1", True)
    plan = commit_plan.commit(LEASE, step_commit(checkpoint=None), step_statement=True)
    assert names(first_round(plan)) == ["fence_lease", "insert_event_fenced", "upsert_step_fenced"]


def test_a_step_in_one_round_refuses_a_lost_lease() -> None:
    plan = commit_plan.commit(LEASE, step_commit(checkpoint=None))
    first_round(plan)
    with pytest.raises(LeaseLostError):
        plan.send([[], [], []])


def test_a_checkpointed_step_commits_in_two_rounds_fence_first() -> None:
    plan = commit_plan.commit(LEASE, step_commit())
    first = first_round(plan)
    assert names(first) == ["fence_lease"]
    assert not first.final
    second = plan.send([FENCED])
    assert names(second) == ["insert_event", "upsert_step", "insert_checkpoint"]
    assert second.final
    assert not second.notify
    event, step, checkpoint = (params for _, params in second.queries)
    assert event["sequence"] == 7  # the last of the sequences the fence reserved
    assert step["settled_sequence"] == 7
    assert (checkpoint["state_version"], checkpoint["last_event_sequence"]) == (9, 7)
    with pytest.raises(StopIteration) as done:
        plan.send([[], [], []])
    assert done.value.value == Committed(7, 9, None, 99.0, 0)


def test_a_lost_lease_refuses_before_anything_else_is_sent() -> None:
    plan = commit_plan.commit(LEASE, step_commit())
    first_round(plan)
    with pytest.raises(LeaseLostError):
        plan.send([[]])


def test_an_operators_stale_read_refuses() -> None:
    plan = commit_plan.commit(Expect("r1", 4), step_commit(run=RunUpdate(RunStatus.QUEUED)))
    assert names(first_round(plan)) == ["fence_expect"]
    with pytest.raises(InvalidTransition, match="read it again"):
        plan.send([[]])


def test_every_write_that_can_refuse_goes_with_the_fence() -> None:
    t = step_commit(
        operation=operation(),
        use_approval=ApprovalUse("a1", "h", "k", 1),
        consume_signal=("e1", "s#1"),
    )
    plan = commit_plan.commit(LEASE, t)
    assert names(first_round(plan)) == [
        "fence_lease",
        "insert_operation",
        "use_approval",
        "consume_signal",
    ]
    second = plan.send([FENCED, [()], [()], [()]])
    assert "insert_operation" not in names(second)
    with pytest.raises(StopIteration) as done:
        plan.send([[]] * len(second.queries))
    assert done.value.value.operation_row_version == 1


@pytest.mark.parametrize(
    ("answers", "refusal", "message"),
    [
        ([[()], [], [()]], ApprovalExpired, "no longer usable"),
        ([[()], [()], []], InvalidTransition, "consumed"),
        ([[], [()], [()]], InvalidTransition, "changed under us"),
    ],
)
def test_a_missing_row_refuses_the_commit(
    answers: list[list[Any]], refusal: type[Exception], message: str
) -> None:
    t = step_commit(
        operation=operation(expect_row_version=4),
        use_approval=ApprovalUse("a1", "h", "k", 1),
        consume_signal=("e1", "s#1"),
    )
    plan = commit_plan.commit(LEASE, t)
    assert names(first_round(plan))[1] == "update_operation"
    with pytest.raises(refusal, match=message):
        plan.send([FENCED, *answers])


def test_an_operation_inserted_twice_is_a_conflict() -> None:
    plan = commit_plan.commit(LEASE, step_commit(operation=operation()))
    first_round(plan)
    with pytest.raises(InvalidTransition, match="already exists"):
        plan.send([FENCED, []])


def test_an_operation_held_by_the_lease_carries_it() -> None:
    plan = commit_plan.commit(LEASE, step_commit(operation=operation()))
    (_, (_, held)) = first_round(plan).queries
    assert (held["held"], held["lease_owner"], held["ttl"]) == (
        True,
        "worker",
        30.0,
    )
    loose = operation(hold_lease=False, send_deadline=12.5)
    (_, (_, sent)) = first_round(commit_plan.commit(LEASE, step_commit(operation=loose))).queries
    assert (sent["held"], sent["lease_owner"], sent["send_deadline"]) == (
        False,
        None,
        12.5,
    )


def test_a_released_runnable_run_wakes_workers() -> None:
    plan = commit_plan.commit(LEASE, step_commit(release=True, run=RunUpdate(RunStatus.QUEUED)))
    first_round(plan)
    assert plan.send([FENCED]).notify


def test_a_run_that_starts_waiting_stays_due_if_cancelled_meanwhile() -> None:
    waiting = RunUpdate(RunStatus.WAITING_EXTERNAL, waiting_for={"event": "paid"})
    plan = commit_plan.commit(LEASE, step_commit(run=waiting, wake_on_signal="paid", release=True))
    first_round(plan)
    second = plan.send([FENCED])
    assert names(second)[:4] == [
        "update_run",
        "pause_if_requested",
        "requeue_if_cancelled",
        "wake_on_signal",
    ]
    assert not second.notify
