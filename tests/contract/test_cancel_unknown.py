"""Cancelling a run that holds an effect of unknown outcome, over both stores.

With compensations, whether that effect is undone depends on whether it took effect: the
run pauses for a person to say, then the cancellation goes on. Without them, the run is
cancelled at once, and the effect can still be settled by hand later: a ledger entry that
stays unknown for good would be a lie of omission."""

from __future__ import annotations

from collections.abc import Callable
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
