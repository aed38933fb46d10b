"""``agent_tool_idempotency_hit_total`` counts duplicate requests, not replays.

A run replays its recorded calls each time it resumes; those answers are the journal doing
its job. A hit is a call that would have made the effect a second time and was answered
instead: here, a reconciliation that found the effect had happened.
"""

from __future__ import annotations

from collections.abc import Callable

import durably
from durably import Reconciliation, RunStatus

MakeApp = Callable[..., durably.App]


def hits(app: durably.App, tool: str) -> float:
    return app.metrics.idempotency_hit.labels(tool=tool)._value.get()


def test_replaying_recorded_calls_is_no_hit(make_app: MakeApp) -> None:
    app = make_app()
    sent: list[str] = []

    @app.tool()
    def book(what: str) -> str:
        sent.append(what)
        return f"booked {what}"

    @app.workflow()
    async def trip() -> list[str]:
        done = [await book("flight"), await book("hotel")]
        for _ in range(3):  # each event resumes the run: the two calls are replayed
            done.append(await durably.wait_for_event("go"))
        return done

    run = app.run(trip)
    for i in range(3):
        assert run.status is RunStatus.WAITING_EXTERNAL
        app.send_event(run.run_id, "go", f"leg {i}")
        assert app.worker().run(until_idle=True) == 1
        run = app.get_run(run.run_id)
    assert run.status is RunStatus.COMPLETED
    assert sent == ["flight", "hotel"], "each sent once"
    assert hits(app, "book") == 0, "3 replays of 2 recorded calls are not duplicate requests"


def test_a_reconciliation_that_finds_the_effect_is_one_hit(make_app: MakeApp) -> None:
    app = make_app()
    shop: list[str] = []

    def lookup(op: durably.Operation) -> Reconciliation:
        return Reconciliation.succeeded("c1") if shop else Reconciliation.not_executed()

    @app.tool(reconcile=lookup)
    def issue(customer: str) -> str:
        shop.append(customer)
        raise TimeoutError("the coupon was issued but the answer came too late")

    @app.workflow()
    async def wf() -> str:
        coupon = await issue("c1")
        await durably.wait_for_event("go")
        return coupon

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_EXTERNAL
    app.send_event(run.run_id, "go")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).status is RunStatus.COMPLETED
    assert shop == ["c1"]
    assert hits(app, "issue") == 1, "the reconciliation, not the replay after the event"
