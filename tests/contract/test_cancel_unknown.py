"""Cancelling a run that holds an effect of unknown outcome, over both stores.

With compensations, whether that effect is undone depends on whether it took effect: the
run pauses for a person to say, then the cancellation goes on. Without them, the run is
cancelled at once, and the effect can still be settled by hand later: a ledger entry that
stays unknown for good would be a lie of omission."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]


class Shop:
    """A booking and a charge, the charge's answer lost; each undo is recorded."""

    def __init__(self, app: durably.App) -> None:
        self.log: list[str] = []
        self.charge_answers = False

        def undo(op: durably.Operation) -> str:
            self.log.append(f"undo {op.tool}")
            return "undone"

        @app.tool(idempotent=True, compensate=undo)
        def book() -> str:
            self.log.append("book")
            return "booked"

        @app.tool(compensate=undo)
        def charge() -> str:
            self.log.append("charge")
            if not self.charge_answers:
                raise durably.OutcomeUnknown("the gateway timed out")
            return "charged"

        @app.workflow()
        async def order() -> str:
            await book()
            return await charge()

        self.book, self.charge, self.order = book, charge, order


@pytest.mark.parametrize(
    ("outcome", "undone"),
    [
        ("succeeded", ["undo charge", "undo book"]),
        ("failed", ["undo book"]),
        ("not_executed", ["undo book"]),
    ],
)
def test_a_cancel_with_compensations_waits_for_the_unknown_effect_then_undoes_what_happened(
    make_app: MakeApp,
    outcome: Literal["succeeded", "failed", "not_executed"],
    undone: list[str],
) -> None:
    app = make_app()
    shop = Shop(app)
    run = app.run(shop.order)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")

    held = app.cancel(run.run_id, compensate=True)
    assert (held.status, held.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert held.waiting_for is not None
    assert held.waiting_for["step_id"] == "charge#1"
    assert shop.log == ["book", "charge"]  # nothing undone, nothing sent again

    app.resolve_effect(run.run_id, "charge#1", outcome, result="charged")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).status is RunStatus.CANCELLED
    assert shop.log == ["book", "charge", *undone]  # newest first; a charge never re-sent


def test_a_cancel_reaching_an_unknown_effect_in_a_running_run_pauses_for_it(
    make_app: MakeApp,
) -> None:
    """Cancelled while the charge is in flight: its answer is lost, so the compensations
    wait for a person instead of skipping it."""
    app = make_app()
    operator = make_app()
    shop = Shop(app)
    sent: list[str] = []

    @app.tool(compensate=lambda op: sent.append("undo ship"))
    def ship() -> str:
        operator.cancel(run_id, compensate=True)  # asked while this call is in flight
        sent.append("ship")
        raise durably.OutcomeUnknown("the carrier timed out")

    @app.workflow()
    async def order_and_ship() -> str:
        await shop.book()
        await shop.charge()
        return await ship()

    shop.charge_answers = True
    run_id = app.start(order_and_ship)
    app.worker().run(until_idle=True)
    held = app.get_run(run_id)
    assert (held.status, held.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert held.waiting_for is not None
    assert held.waiting_for["step_id"] == "ship#1"
    app.resolve_effect(run_id, "ship#1", "succeeded", result="shipped")
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert shop.log == ["book", "charge", "undo charge", "undo book"]
    assert sent == ["ship", "undo ship"]


def test_a_plain_cancel_leaves_the_unknown_effect_settleable_and_the_run_cancelled(
    make_app: MakeApp,
) -> None:
    app = make_app()
    shop = Shop(app)
    run = app.run(shop.order)
    cancelled = app.cancel(run.run_id)
    assert cancelled.status is RunStatus.CANCELLED
    effects: dict[str, Any] = {e["step_id"]: e for e in app.describe(run.run_id)["effects"]}
    assert effects["charge#1"]["status"] == "unknown"

    # Checked at the gateway later: it did charge. The ledger says so; the run stays final.
    after = app.resolve_effect(run.run_id, "charge#1", "succeeded", result="charged")
    assert (after.status, after.status_reason) == (RunStatus.CANCELLED, "cancelled")
    effects = {e["step_id"]: e for e in app.describe(run.run_id)["effects"]}
    assert (effects["charge#1"]["status"], effects["charge#1"]["result"]) == (
        "succeeded",
        "charged",
    )
    assert [e.type for e in app.events(run.run_id)][-2:] == ["run_cancelled", "effect_resolved"]
    assert app.worker().run(until_idle=True) == 0  # nothing to run: cancelled is final
    assert shop.log == ["book", "charge"]
    with pytest.raises(durably.InvalidTransition, match="has succeeded"):
        app.resolve_effect(run.run_id, "charge#1", "failed")
    # The journal the resolution sealed still verifies: a fork from it starts cleanly.
    fork = app.fork(run.run_id)
    assert fork.status is RunStatus.QUEUED


def test_an_effect_resolved_after_another_branch_stopped_at_the_cancel_is_undone(
    make_app: MakeApp,
) -> None:
    """On the replay after the resolution, the other branch reaches a new call (and stops
    at the cancel) before this one reaches the charge again: the charge is undone all the
    same, since the cancellation undoes every effect the run made."""
    app = make_app()
    shop = Shop(app)
    log = shop.log

    def undo(op: durably.Operation) -> None:
        log.append(f"undo {op.tool}")

    @app.tool(idempotent=True, compensate=undo)
    def hold_seat() -> str:
        log.append("hold_seat")
        return "held"

    @app.tool(idempotent=True, compensate=undo)
    async def ship() -> str:
        await asyncio.sleep(0.3)  # the charge is recorded unknown first
        log.append("ship")
        return "shipped"

    @app.tool(idempotent=True)
    def notify() -> str:
        log.append("notify")
        return "sent"

    async def pay() -> str:
        await shop.book()
        await hold_seat()
        return await shop.charge()

    async def deliver() -> str:
        await ship()
        return await notify()

    @app.workflow()
    async def order_in_parallel() -> str:
        await durably.gather(pay(), deliver())
        return "done"

    run = app.run(order_in_parallel)
    assert run.status is RunStatus.PAUSED
    assert app.cancel(run.run_id, compensate=True).status is RunStatus.PAUSED
    app.resolve_effect(run.run_id, "gather#1.0/charge#1", "succeeded", result="charged")
    app.worker().run(until_idle=True)
    assert app.get_run(run.run_id).status is RunStatus.CANCELLED
    assert log[:4] == ["book", "hold_seat", "charge", "ship"]
    assert sorted(log[4:]) == ["undo book", "undo charge", "undo hold_seat", "undo ship"], log
    assert log.index("undo charge") < log.index("undo book")  # newest first in its branch


@pytest.mark.parametrize("then", ["old code deployed again", "plain cancel"])
def test_a_compensating_cancel_of_a_run_whose_code_diverged_pauses_it_for_the_code(
    make_app: MakeApp, then: str
) -> None:
    """No call is made by code that diverged from the run's history, compensations
    included: the run pauses ``non_determinism`` (before, it stayed running for good).
    Deployed again, the code it ran with compensates; an operator who cannot deploy it
    ends the run with a plain cancel, without compensations."""
    app = make_app()
    shop = Shop(app)
    log = shop.log

    @app.tool(idempotent=True)
    def audit() -> str:
        log.append("audit")
        return "ok"

    version = {"new": False}

    @app.workflow()
    async def trip() -> Any:
        if version["new"]:
            await audit()  # a call inserted before the recorded ones: a divergence
        await shop.book()
        return await durably.wait_for_event("go")

    run = app.run(trip)
    assert run.status is RunStatus.WAITING_EXTERNAL
    version["new"] = True
    held = app.cancel(run.run_id, compensate=True)
    assert (held.status, held.status_reason) == (RunStatus.PAUSED, "non_determinism")
    assert log == ["book"]
    if then == "plain cancel":
        assert app.cancel(run.run_id).status is RunStatus.CANCELLED
        assert log == ["book"]
    else:
        version["new"] = False
        assert app.resume(run.run_id).status is RunStatus.CANCELLED
        assert log == ["book", "undo book"]


def test_a_compensating_cancel_after_the_workflow_compensated_itself_undoes_nothing_twice(
    make_app: MakeApp,
) -> None:
    app = make_app()
    operator = make_app()
    shop = Shop(app)

    @app.tool(idempotent=True, compensate=lambda op: shop.log.append("undo hotel"))
    def hotel() -> str:
        shop.log.append("hotel")
        operator.cancel(run_id, compensate=True)  # arrives while the last call is in flight
        return "held"

    @app.workflow()
    async def trip() -> str:
        await shop.book()
        await durably.compensate("book#1")  # the workflow's own saga step
        return await hotel()

    run_id = app.start(trip)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert shop.log == ["book", "undo book", "hotel", "undo hotel"]


def test_a_compensating_cancel_of_a_run_refused_permission_cancels_it(make_app: MakeApp) -> None:
    """The refused call never ran: there is nothing to wait for before compensating."""
    app = make_app()
    shop = Shop(app)

    @app.tool(compensate=lambda op: shop.log.append("undo transfer"), authorize=lambda op: False)
    def transfer() -> str:
        shop.log.append("transfer")
        return "sent"

    @app.workflow()
    async def pay() -> str:
        await shop.book()
        return await transfer()

    run = app.run(pay)
    assert run.status_reason == "permission_denied"
    assert app.cancel(run.run_id, compensate=True).status is RunStatus.CANCELLED
    assert shop.log == ["book", "undo book"]


def test_a_plain_cancel_after_a_compensating_one_keeps_the_compensations(
    make_app: MakeApp,
) -> None:
    app = make_app()
    shop = Shop(app)
    run = app.run(shop.order)
    assert app.cancel(run.run_id, compensate=True).status is RunStatus.PAUSED
    again = app.cancel(run.run_id)  # an operator who did not see the first one
    assert (again.status, again.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    app.resolve_effect(run.run_id, "charge#1", "succeeded", result="charged")
    app.worker().run(until_idle=True)
    assert app.get_run(run.run_id).status is RunStatus.CANCELLED
    assert shop.log == ["book", "charge", "undo charge", "undo book"]


@pytest.mark.parametrize("how", ["retried", "reconciled"])
def test_a_call_known_not_to_have_acted_is_not_sent_again_after_a_cancel(
    make_app: MakeApp, how: str
) -> None:
    """A retry after a failure before sending, or a send again after reconcile= says it
    never happened: both are new sends, which a pending cancel stops."""
    app = make_app(reconcile_grace=timedelta(0))
    operator = make_app()
    sent: list[str] = []

    def lookup(op: durably.Operation) -> durably.Reconciliation:
        return durably.Reconciliation.not_executed()

    @app.tool(
        retry=durably.RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=50)),
        reconcile=lookup if how == "reconciled" else None,
    )
    def charge() -> str:
        if not sent:
            sent.append("refused")
            operator.cancel(run_id)  # asked while the first attempt is under way
            if how == "retried":
                raise durably.ToolError(
                    "connection refused", category=durably.FailureCategory.TRANSIENT_BEFORE_SEND
                )
            raise durably.OutcomeUnknown("it never reached the gateway")
        sent.append("charged")
        return "charged"

    @app.workflow()
    async def pay() -> str:
        return await charge()

    run_id = app.start(pay)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert sent == ["refused"]


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_cancel_during_a_retrys_backoff_stops_the_retry(
    make_app: MakeApp, idempotent: bool
) -> None:
    """The cancel lands while the retry waits out its backoff, after the last check the
    call made: the claim that ends the wait is where it is seen, and nothing is sent."""
    app = make_app()
    operator = make_app()
    sent: list[str] = []

    @app.tool(
        idempotent=idempotent,
        # Long enough for the operator to see the failure and cancel on a slow machine.
        retry=durably.RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=2)),
    )
    def charge() -> str:
        if not sent:
            sent.append("refused")
            raise ConnectionRefusedError("the gateway is restarting")
        sent.append("charged")
        return "charged"

    @app.workflow()
    async def pay() -> str:
        return await charge()

    run_id = app.start(pay)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    deadline = time.monotonic() + 10
    while "effect_failed" not in [e.type for e in operator.events(run_id)]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    operator.cancel(run_id)
    worker.join(20)
    assert operator.get_run(run_id).status is RunStatus.CANCELLED
    assert sent == ["refused"]
    effects = operator.describe(run_id)["effects"]
    assert [e["status"] for e in effects] == ["intent_recorded"]


def test_a_cancel_just_before_a_new_calls_first_commit_stops_it(make_app: MakeApp) -> None:
    """An idempotent tool records its intent and claim in one commit: a cancel that lands
    after the run's last commit and before that one is seen there, and nothing is sent."""
    app = make_app()
    operator = make_app()
    sent: list[str] = []

    @app.step()
    def plan() -> str:
        return "plan"

    @app.tool(idempotent=True)
    def book() -> str:
        sent.append("book")
        return "booked"

    @app.workflow()
    async def trip() -> str:
        await plan()
        await operator.cancel_async(durably.current_run().run_id)  # after plan's commit
        return await book()

    run_id = app.start(trip)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert sent == []
    effects = app.describe(run_id)["effects"]
    assert [e["status"] for e in effects] == ["intent_recorded"]


def test_a_failure_after_sending_that_a_plain_cancel_stopped_at_stays_settleable(
    make_app: MakeApp,
) -> None:
    app = make_app()
    operator = make_app()

    @app.tool()
    def charge() -> str:
        operator.cancel(run_id)
        raise durably.ToolError(
            "connection reset after the request was sent",
            category=durably.FailureCategory.TRANSIENT_AFTER_SEND,
        )

    @app.workflow()
    async def pay() -> str:
        return await charge()

    run_id = app.start(pay)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert app.describe(run_id)["effects"][0]["status"] == "unknown"  # as a pause marks it
    app.resolve_effect(run_id, "charge#1", "succeeded", result="charged")
    effects = {e["step_id"]: e["status"] for e in app.describe(run_id)["effects"]}
    assert effects == {"charge#1": "succeeded"}


def test_a_worker_stalled_past_its_lease_cannot_write_over_an_operators_cancel(
    make_app: MakeApp,
) -> None:
    """Its loop blocked mid-call, the worker's lease runs out and an operator cancels the
    run. Awake again, the worker must neither record onto the cancelled run nor make the
    next call: the operator's commit took the lapsed lease away."""
    app = make_app(lease_ttl=timedelta(seconds=1))
    operator = make_app()
    sent: list[str] = []
    stalled = threading.Event()

    @app.tool()
    async def slow() -> str:
        stalled.set()
        time.sleep(2.5)  # blocks the loop: no heartbeat, the lease runs out
        sent.append("slow")
        return "done"

    @app.tool()
    def second() -> str:
        sent.append("second")
        return "done"

    @app.workflow()
    async def wf() -> str:
        await slow()
        return await second()

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    assert stalled.wait(10)
    time.sleep(1.5)  # past the lease
    assert operator.cancel(run_id).status is RunStatus.CANCELLED
    worker.join(20)
    assert operator.get_run(run_id).status is RunStatus.CANCELLED
    assert sent == ["slow"]
    assert [e.type for e in operator.events(run_id)][-1] == "run_cancelled"


@pytest.mark.parametrize("undo_refused", [False, True])
def test_the_workflows_own_undo_cut_short_by_a_compensating_cancel_is_taken_up(
    make_app: MakeApp, undo_refused: bool
) -> None:
    """The workflow's own ``durably.compensate()`` stops at the pending cancel before its
    undo is sent (or the undo is refused): the cancellation sends it (or reports its
    failure), never counts the booking undone while it stands."""
    app = make_app()
    operator = make_app()
    log: list[str] = []

    def undo(op: durably.Operation) -> str:
        log.append("undo book")
        if undo_refused:
            raise durably.ToolError(
                "too late to cancel", category=durably.FailureCategory.BUSINESS_REJECTED
            )
        return "undone"

    @app.tool(idempotent=True, compensate=undo)
    def book() -> str:
        log.append("book")
        return "booked"

    @app.tool()
    def pay() -> str:
        log.append("pay")
        if not undo_refused:
            operator.cancel(run_id, compensate=True)  # arrives while this call is in flight
        raise durably.ToolError("declined", category=durably.FailureCategory.BUSINESS_REJECTED)

    @app.tool(idempotent=True)
    def notify() -> str:
        operator.cancel(run_id, compensate=True)
        return "sent"

    @app.workflow()
    async def order() -> str:
        await book()
        try:
            return await pay()
        except durably.StepFailed:
            with contextlib.suppress(durably.StepFailed):
                await durably.compensate()  # the workflow's own saga
            return await notify()

    run_id = app.start(order)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    [cancelled] = [e.payload for e in app.events(run_id) if e.type == "run_cancelled"]
    effects = {e["step_id"]: e["status"] for e in app.describe(run_id)["effects"]}
    if undo_refused:
        assert log == ["book", "pay", "undo book"]  # refused once, not sent again
        assert effects["book#1"] == "succeeded"
        assert cancelled["compensated"] == []
        assert cancelled["compensation_error"]["type"] == "StepFailed"
    else:
        assert log == ["book", "pay", "undo book"]
        assert effects["book#1"] == "compensated"
        assert cancelled["compensated"] == ["book#1"]
