"""Durable timers, external events and cancellation, over both stores."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]


def event_types(app: durably.App, run_id: str) -> list[str]:
    return [e.type for e in app.events(run_id)]


def test_sleep_is_resumed_when_due_without_repeating_work(make_app: MakeApp) -> None:
    app = make_app()
    calls = Counter[str]()

    @app.step()
    def before() -> str:
        calls["before"] += 1
        return "b"

    @app.step()
    def after() -> str:
        calls["after"] += 1
        return "a"

    @app.workflow()
    async def wf() -> list[str]:
        first = await before()
        await durably.sleep(1.0)
        return [first, await after()]

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_EXTERNAL
    assert run.waiting_for is not None
    assert run.waiting_for["kind"] == "timer"
    until = float(run.waiting_for["until"])
    if until - time.time() > 0.3:  # still well before the due time (a loaded machine may lag)
        assert app.worker().run(until_idle=True) == 0  # not due yet: nothing to claim
    time.sleep(max(until - time.time(), 0) + 0.05)
    assert app.worker().run(until_idle=True) == 1
    done = app.get_run(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == ["b", "a"]
    assert calls == Counter(before=1, after=1)
    assert "timer_fired" in event_types(app, run.run_id)


def test_event_is_delivered_once_per_event_id(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> Any:
        return await durably.wait_for_event("approved")

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_EXTERNAL
    assert app.send_event(run.run_id, "approved", {"by": "ana"}, event_id="e1") == "delivered"
    assert (
        app.send_event(run.run_id, "approved", {"by": "eve"}, event_id="e1") == "duplicate ignored"
    )
    assert app.worker().run(until_idle=True) == 1
    done = app.get_run(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == {"by": "ana"}
    # A sender retrying after the run finished still hears that it was delivered.
    assert app.send_event(run.run_id, "approved", {"n": 2}, event_id="e1") == "duplicate ignored"

    with pytest.raises(durably.InvalidTransition):
        app.send_event(run.run_id, "approved", {}, event_id="e2")
    with pytest.raises(durably.RunNotFound):
        app.send_event("no-such-run", "approved", {})


def test_events_sent_early_or_out_of_order_are_kept_for_their_waits(make_app: MakeApp) -> None:
    app = make_app()

    @app.step()
    def prepare() -> int:
        return 1

    @app.workflow()
    async def wf() -> list[Any]:
        await prepare()
        paid = await durably.wait_for_event("paid")
        shipped = await durably.wait_for_event("shipped")
        again = await durably.wait_for_event("paid")
        return [paid, shipped, again]

    run_id = app.start(wf)
    # All three arrive before the run even started, "shipped" between the two "paid".
    assert app.send_event(run_id, "paid", 1, event_id="p1") == "delivered"
    assert app.send_event(run_id, "shipped", "s", event_id="s1") == "delivered"
    assert app.send_event(run_id, "paid", 2, event_id="p2") == "delivered"
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run_id).result == [1, "s", 2]


def test_wait_timeout_raises_in_the_workflow(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> str:
        try:
            await durably.wait_for_event("reply", timeout=0.2)
        except durably.WaitTimeout:
            return "gave up"
        return "got it"

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_EXTERNAL
    time.sleep(0.25)
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).result == "gave up"
    # A late reply changes nothing: the wait settled as timed out.
    with pytest.raises(durably.InvalidTransition):
        app.send_event(run.run_id, "reply", "late")


def test_event_arriving_while_the_run_is_executing_is_not_lost(make_app: MakeApp) -> None:
    """Delivered between the run's check for buffered events and its suspension."""
    app = make_app()
    other = make_app()
    entered = threading.Event()
    release = threading.Event()

    @app.step()
    def slow() -> None:
        entered.set()
        release.wait(10)

    @app.workflow()
    async def wf() -> Any:
        await slow()
        return await durably.wait_for_event("go")

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    assert entered.wait(10)
    assert other.send_event(run_id, "go", "now", event_id="g1") == "delivered"
    release.set()
    worker.join(20)
    assert app.worker().run(until_idle=True) <= 1
    assert app.get_run(run_id).result == "now"


def test_cancel_a_waiting_run(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> Any:
        return await durably.wait_for_event("never")

    run = app.run(wf)
    cancelled = app.cancel(run.run_id)
    assert cancelled.status is RunStatus.CANCELLED
    assert "run_cancelled" in event_types(app, run.run_id)
    with pytest.raises(durably.InvalidTransition):
        app.cancel(run.run_id)


def test_cancel_with_compensation_undoes_effects_once(make_app: MakeApp) -> None:
    app = make_app()
    undone: list[Any] = []

    def refund(op: durably.Operation) -> str:
        undone.append(op.result)
        return "refunded"

    @app.tool(idempotent=True, compensate=refund)
    def charge(amount: int) -> dict[str, int]:
        return {"charged": amount}

    @app.workflow()
    async def wf() -> Any:
        await charge(5)
        return await durably.wait_for_event("shipped")

    run = app.run(wf)
    done = app.cancel(run.run_id, compensate=True)
    assert done.status is RunStatus.CANCELLED
    assert undone == [{"charged": 5}]
    statuses = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert statuses == {"charge#1": "compensated", "compensate:charge#1": "succeeded"}


def test_cancel_reaches_a_running_run_at_its_next_boundary(make_app: MakeApp) -> None:
    app = make_app()
    operator = make_app()
    entered = threading.Event()
    release = threading.Event()
    calls = Counter[str]()

    @app.step()
    def slow() -> None:
        calls["slow"] += 1
        entered.set()
        release.wait(10)

    @app.tool(idempotent=True)
    def send() -> None:
        calls["send"] += 1

    @app.workflow()
    async def wf() -> None:
        await slow()
        await send()

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    assert entered.wait(10)
    assert operator.cancel(run_id).status is RunStatus.RUNNING  # the worker holds it
    release.set()
    worker.join(20)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
    assert calls == Counter(slow=1)  # stopped before the effect, never during it


def test_cancel_compensates_an_effect_whose_outcome_was_reconciled(make_app: MakeApp) -> None:
    """An effect of unknown outcome is reconciled, never abandoned; cancelling later with
    compensation undoes it once."""
    app = make_app()
    issued: list[str] = []
    refunded: list[Any] = []

    def lookup(op: durably.Operation) -> durably.Reconciliation:
        return (
            durably.Reconciliation.succeeded({"coupon": issued[0]})
            if issued
            else (durably.Reconciliation.not_executed())
        )

    def refund(op: durably.Operation) -> None:
        refunded.append(op.result)

    state = {"answer": False}

    @app.tool(reconcile=lookup, compensate=refund)
    def issue(customer: str) -> dict[str, str]:
        issued.append(customer)
        if not state["answer"]:
            raise durably.OutcomeUnknown("no answer")  # it happened; nobody knows yet
        return {"coupon": customer}

    @app.workflow()
    async def wf() -> Any:
        coupon = await issue("c-1")
        return await durably.wait_for_event("done", timeout=None) or coupon

    run = app.run(wf)  # reconciled at once: succeeded; the run then waits
    assert run.status is RunStatus.WAITING_EXTERNAL
    done = app.cancel(run.run_id, compensate=True)
    assert done.status is RunStatus.CANCELLED
    assert issued == ["c-1"]
    assert refunded == [{"coupon": "c-1"}]


def test_a_cancel_requested_just_before_a_wait_is_not_lost(make_app: MakeApp) -> None:
    app = make_app()
    operator = make_app()
    entered = threading.Event()
    release = threading.Event()

    @app.step()
    def slow() -> None:
        entered.set()
        release.wait(10)

    @app.workflow()
    async def wf() -> Any:
        await slow()
        return await durably.wait_for_event("never")

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    assert entered.wait(10)
    operator.cancel(run_id)  # the worker still holds the run: only a request
    release.set()
    worker.join(20)
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).status is RunStatus.CANCELLED
