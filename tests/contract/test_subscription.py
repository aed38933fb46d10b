"""The event log delivered to consumers: in order per run, acknowledged once per consumer."""

from __future__ import annotations

from collections.abc import Callable

import durably
from durably import Event, RunStatus

MakeApp = Callable[..., durably.App]


def make_runs(app: durably.App, n: int) -> list[str]:
    @app.step()
    def work(i: int) -> int:
        return i

    @app.workflow()
    async def wf(i: int) -> int:
        return await work(i) + await work(i + 1)

    return [app.run(wf, i).run_id for i in range(n)]


def test_every_event_is_delivered_in_order_and_acknowledged_once(make_app: MakeApp) -> None:
    app = make_app()
    run_ids = make_runs(app, 3)
    seen: list[Event] = []
    audit = app.subscribe(seen.append, consumer="audit")
    assert audit.run(until_idle=True) == sum(len(app.events(r)) for r in run_ids)
    for run_id in run_ids:
        mine = [e.sequence for e in seen if e.run_id == run_id]
        assert mine == list(range(1, len(app.events(run_id)) + 1))
    assert app.subscribe(seen.append, consumer="audit").run(until_idle=True) == 0
    # Another consumer has its own inbox: it gets everything too.
    others: list[Event] = []
    assert app.subscribe(others.append, consumer="ui").run(until_idle=True) == len(seen)


def test_a_failing_handler_holds_back_its_run_only(make_app: MakeApp) -> None:
    app = make_app()
    first, second = make_runs(app, 2)
    seen: list[str] = []
    broken = {"event": f"{first}:2"}

    def handler(event: Event) -> None:
        if event.event_id == broken["event"]:
            raise RuntimeError("downstream unavailable")
        seen.append(event.event_id)

    subscription = app.subscribe(handler, consumer="mirror")
    subscription.run(until_idle=True)
    assert f"{first}:1" in seen
    assert not [e for e in seen if e.startswith(f"{first}:") and e != f"{first}:1"]
    assert len([e for e in seen if e.startswith(f"{second}:")]) == len(app.events(second))
    broken["event"] = ""
    subscription.run(until_idle=True)
    mine = [int(e.split(":")[1]) for e in seen if e.startswith(f"{first}:")]
    assert mine == list(range(1, len(app.events(first)) + 1))


def test_events_committed_before_a_crash_are_still_delivered(make_app: MakeApp) -> None:
    """No dispatch step can be lost: the event is in the log from its own transaction."""
    app = make_app()

    @app.tool()
    def send() -> None:
        raise TimeoutError  # the run pauses: its worker stopped right after the commit

    @app.workflow()
    async def wf() -> None:
        await send()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    types: list[str] = []
    app.subscribe(lambda e: types.append(e.type), consumer="pager").run(until_idle=True)
    assert types[-2:] == ["effect_unknown", "run_paused"]


def test_a_failing_run_does_not_starve_the_others(make_app: MakeApp) -> None:
    """Even when the failing run's pending events alone would fill a whole batch."""
    app = make_app()
    first, second = make_runs(app, 2)
    seen: list[str] = []

    def handler(event: Event) -> None:
        if event.run_id == first:
            raise RuntimeError("downstream unavailable")
        seen.append(event.event_id)

    app.subscribe(handler, consumer="mirror", batch=2).run(until_idle=True)
    assert len(seen) == len(app.events(second))
