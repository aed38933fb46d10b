"""What-if replay (``app.replay``): a completed run's workflow executed again with changed
code against its own record, reporting the first divergence. Each version of the code is
its own App on the same database, as a deploy would be; the tools count what really ran."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import ReplayMode, RunStatus

MakeApp = Callable[..., durably.App]


class Shop:
    """One version of the order workflow; ``change`` names what differs from the original."""

    def __init__(self, app: durably.App, change: str = "") -> None:
        self.app = app
        self.ran: Counter[str] = Counter()

        @app.step()
        def plan(customer: str) -> dict[str, Any]:
            self.ran["plan"] += 1
            return {"customer": customer, "amount": 10}

        @app.step()
        def audit(what: str) -> str:
            self.ran["audit"] += 1
            return what

        @app.tool(idempotent=True)
        def charge(customer: str, amount: int) -> dict[str, Any]:
            self.ran["charge"] += 1
            return {"charged": amount}

        @app.tool(idempotent=True)
        def email(to: str, body: str) -> dict[str, Any]:
            self.ran["email"] += 1
            return {"mailed": to}

        @app.workflow()
        async def order(customer: str) -> list[Any]:
            p = await plan(customer.upper() if change == "step arguments" else customer)
            if change == "call inserted":
                await audit("before charge")
            amount = p["amount"] + (1 if change == "tool arguments" else 0)
            c = await charge(p["customer"], amount)
            if change != "call removed":
                await email(customer, f"charged {c['charged']}")
            if change == "call added":
                await email(customer, "and a survey")
            return [c["charged"], "changed" if change == "result" else "same"]


def completed_run(make_app: MakeApp) -> tuple[durably.Run, Counter[str]]:
    shop = Shop(make_app())
    run = shop.app.run("order", "ann")
    assert run.status is RunStatus.COMPLETED, run.error
    return run, shop.ran


def test_unchanged_code_reproduces_the_run_and_runs_nothing(make_app: MakeApp) -> None:
    source, ran = completed_run(make_app)
    assert ran == Counter({"plan": 1, "charge": 1, "email": 1})
    shop = Shop(make_app())
    report = shop.app.replay(source.run_id, mode=ReplayMode.RECORDED)
    assert report.reproduced, report.divergence
    assert report.divergence is None
    assert report.matched == ["plan#1", "charge#1", "email#1"]
    assert report.result == report.recorded_result == source.result
    assert report.status is RunStatus.COMPLETED
    assert shop.ran == Counter(), "every call answered from the record"
    # The what-if is a fork of the source (its own run), never the source itself.
    assert report.what_if_run_id != source.run_id
    events = shop.app.events(report.what_if_run_id)
    forked = [e.payload["from"] for e in events if e.type == "step_forked"]
    assert forked == [source.run_id] * 3
    # Held for this process from its creation, then taken up by it: no recovery of a run
    # nobody else ever held.
    assert "run_recovered" not in [e.type for e in events]
    assert shop.app.get_run(source.run_id).status is RunStatus.COMPLETED


def test_a_worker_polling_meanwhile_leaves_the_what_if_to_its_caller(
    make_app: MakeApp,
) -> None:
    """The what-if is executed where it was asked for: a worker of the same code polling
    while it is written must not take it up, or the report would be read off a run still
    executing elsewhere."""
    source, _ = completed_run(make_app)
    shop = Shop(make_app())
    worker = shop.app.worker()

    async def race() -> durably.ReplayReport:
        replaying = asyncio.ensure_future(shop.app.replay_async(source.run_id))
        while not replaying.done():
            await worker.run_async(until_idle=True)
            await asyncio.sleep(0)
        return await replaying

    report = asyncio.run(race())
    assert report.reproduced, report.divergence
    assert report.status is RunStatus.COMPLETED
    assert worker.executed == 0
    assert shop.ran == Counter()


@pytest.mark.parametrize(
    ("change", "kind", "step_id", "matched"),
    [
        ("step arguments", "other_arguments", "plan#1", []),
        ("tool arguments", "other_arguments", "charge#1", ["plan#1"]),
        ("call inserted", "other_call", "audit#1", ["plan#1"]),
        ("call added", "new_call", "email#2", ["plan#1", "charge#1", "email#1"]),
        ("call removed", "missing_call", "email#1", ["plan#1", "charge#1"]),
        ("result", "other_result", None, ["plan#1", "charge#1", "email#1"]),
    ],
)
def test_changed_code_reports_the_first_divergence(
    make_app: MakeApp, change: str, kind: str, step_id: str | None, matched: list[str]
) -> None:
    source, _ = completed_run(make_app)
    shop = Shop(make_app(), change)
    report = shop.app.replay(source.run_id)
    assert not report.reproduced
    assert report.divergence is not None
    assert (report.divergence.kind, report.divergence.step_id) == (kind, step_id)
    assert report.matched == matched
    assert report.recorded_result == source.result
    assert shop.ran == Counter(), "nothing ran, not even the call that diverged"
    if kind == "other_result":
        assert report.status is RunStatus.COMPLETED
        assert report.result == [10, "changed"]
    else:
        # Stopped at the divergence, and left for no one to act on.
        assert report.status is RunStatus.CANCELLED
        assert report.result is None
        assert step_id is not None
        assert step_id in report.divergence.message
    assert report.to_dict()["divergence"]["kind"] == kind


def test_bad_input_is_a_typed_error(make_app: MakeApp) -> None:
    source, _ = completed_run(make_app)
    app = Shop(make_app()).app
    with pytest.raises(durably.RunNotFound):
        app.replay("run_missing")
    with pytest.raises(durably.InvalidInput):
        app.replay("run\x00x")
    with pytest.raises(durably.InvalidInput, match="supported mode is recorded"):
        app.replay(source.run_id, mode=ReplayMode.SANDBOX)
    with pytest.raises(durably.InvalidInput, match="supported mode is recorded"):
        app.replay(source.run_id, mode="live")

    @app.workflow()
    async def nothing() -> int:
        return 1

    empty = app.run("nothing")
    with pytest.raises(durably.InvalidInput, match="recorded no calls"):
        app.replay(empty.run_id)
