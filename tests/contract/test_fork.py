"""Forks: a new run that starts with another run's history, and effects past the fork point
under its replay mode. What the services received is counted by the tools themselves."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import ReplayMode, RunStatus
from tests.conftest import execute_sql

MakeApp = Callable[..., durably.App]


class Shop:
    """An order is charged, then a confirmation mailed; counts what really happened."""

    def __init__(self, app: durably.App) -> None:
        self.app = app
        self.sent: Counter[str] = Counter()

        @app.step()
        def plan(customer: str) -> dict[str, Any]:
            return {"customer": customer, "amount": 10}

        @app.tool(idempotent=True)
        def charge(customer: str, amount: int) -> dict[str, Any]:
            self.sent[f"charge {customer} {amount}"] += 1
            return {"charged": amount, "key": durably.idempotency_key()}

        @app.tool(idempotent=True, sandbox=lambda to, body: {"mailed": to, "sandbox": True})
        def email(to: str, body: str) -> dict[str, Any]:
            self.sent[f"email {to}"] += 1
            return {"mailed": to}

        @app.workflow()
        async def order(customer: str) -> list[Any]:
            p = await plan(customer)
            c = await charge(p["customer"], p["amount"])
            m = await email(customer, f"charged {c['charged']}")
            return [c["charged"], m]

    def run(self) -> durably.Run:
        run = self.app.run("order", "ann")
        assert run.status is RunStatus.COMPLETED
        assert self.sent == Counter({"charge ann 10": 1, "email ann": 1})
        return run

    def execute(self, forked: durably.Run) -> durably.Run:
        assert forked.status is RunStatus.QUEUED
        self.app.worker().run(until_idle=True)
        return self.app.get_run(forked.run_id)


def keys(app: durably.App, run_id: str) -> dict[str, str]:
    return {e["step_id"]: e["idempotency_key"] for e in app.describe(run_id)["effects"]}


def replays_blocked(app: durably.App) -> int:
    return app.engine.block(app.engine.store.ledger_figures()).replays_blocked


def test_disabled_replay_stops_before_the_first_new_effect(make_app: MakeApp) -> None:
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    blocked = replays_blocked(app)
    forked = shop.execute(app.fork(source.run_id, at="charge#1"))
    assert forked.status is RunStatus.PAUSED
    assert forked.status_reason == "replay_blocked"
    assert forked.error is not None
    assert "email at email#1" in forked.error["message"]
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 1}), "nothing sent again"
    assert replays_blocked(app) == blocked + 1, "read from the ledger"
    # The copied charge is the fork's own record, under the fork's own key.
    assert set(keys(app, forked.run_id)) == {"charge#1"}
    assert keys(app, forked.run_id)["charge#1"] != keys(app, source.run_id)["charge#1"]
    steps = {s["step_id"]: s["status"] for s in app.describe(forked.run_id)["steps"]}
    assert steps == {"plan#1": "succeeded", "charge#1": "succeeded"}


def test_recorded_replay_answers_from_the_source_ledger(make_app: MakeApp) -> None:
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    forked = shop.execute(app.fork(source.run_id, at="plan#1", replay=ReplayMode.RECORDED))
    assert forked.status is RunStatus.COMPLETED, forked.error
    assert forked.result == source.result
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 1})
    replayed = [e.step_id for e in app.events(forked.run_id) if e.type == "effect_replayed"]
    assert replayed == ["charge#1", "email#1"]


def test_sandbox_replay_calls_the_sandbox(make_app: MakeApp) -> None:
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    forked = shop.execute(app.fork(source.run_id, at="charge#1", replay=ReplayMode.SANDBOX))
    assert forked.status is RunStatus.COMPLETED, forked.error
    assert forked.result == [10, {"mailed": "ann", "sandbox": True}]
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 1})


def test_live_replay_needs_a_fresh_approval_bound_to_the_fork(make_app: MakeApp) -> None:
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    forked = shop.execute(
        app.fork(source.run_id, at="charge#1", replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    )
    assert forked.status is RunStatus.WAITING_APPROVAL
    assert forked.waiting_for is not None
    assert forked.waiting_for["tool"] == "email"
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 1})
    app.approve(forked.run_id, by="ana")
    done = app.resume(forked.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 2})
    assert keys(app, forked.run_id)["email#1"] != keys(app, source.run_id)["email#1"]


def test_a_fork_without_a_point_keeps_everything_and_runs_new_code(make_app: MakeApp) -> None:
    """A finished run continued with new code: the recorded calls are kept, the new one
    is blocked (DISABLED) rather than made."""
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    forked = shop.execute(app.fork(source.run_id))
    assert forked.status is RunStatus.COMPLETED
    assert forked.result == source.result
    assert shop.sent == Counter({"charge ann 10": 1, "email ann": 1})


@pytest.mark.parametrize("at", ["nope#1", "email#2"])
def test_an_unknown_fork_point_is_refused(make_app: MakeApp, at: str) -> None:
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    with pytest.raises(durably.InvalidInput, match="no settled step or checkpoint"):
        app.fork(source.run_id, at=at)
    with pytest.raises(durably.RunNotFound):
        app.fork("run_missing")


def test_a_worker_racing_the_fork_sees_it_only_with_its_whole_history(
    make_app: MakeApp,
) -> None:
    """A worker polling while the fork is written must not take it up before every copied
    call is there: it would run again what the source already did, and the fork's own
    copying would then be refused."""
    app = make_app()
    ran: Counter[int] = Counter()

    @app.step()
    async def work(k: int) -> int:
        ran[k] += 1
        return k

    @app.workflow()
    async def loop(n: int) -> int:
        total = 0
        for k in range(n):
            total += await work(k)
        return total

    source = app.run("loop", 40)
    assert source.status is RunStatus.COMPLETED
    worker = app.worker()

    async def race() -> durably.Run:
        forking = asyncio.ensure_future(app.fork_async(source.run_id))
        while not forking.done():
            await worker.run_async(until_idle=True)
            await asyncio.sleep(0)
        await worker.run_async(until_idle=True)
        return await forking

    forked = asyncio.run(race())
    done = app.get_run(forked.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == source.result
    assert ran == Counter(range(40)), "every step ran once, in the source"
    assert len(app.describe(forked.run_id)["steps"]) == 40


class Bookings:
    """``trip(n)`` books ``n`` times, each undoable, then waits for ``go``; counts what
    really happened."""

    def __init__(self, app: durably.App) -> None:
        self.sent: Counter[str] = Counter()

        def release(op: durably.Operation) -> None:
            self.sent[f"release {op.step_id}"] += 1

        @app.tool(idempotent=True, compensate=release)
        def book(k: int) -> int:
            self.sent[f"book {k}"] += 1
            return k

        @app.workflow()
        async def trip(n: int) -> Any:
            for k in range(n):
                await book(k)
            return await durably.wait_for_event("go")


@pytest.mark.parametrize("replay", [ReplayMode.DISABLED, ReplayMode.RECORDED])
def test_a_fork_whose_replay_mode_blocks_its_undos_pauses_then_cancels_plainly(
    make_app: MakeApp, replay: ReplayMode
) -> None:
    """Cancelling a fork with compensations would undo, for real, what the source booked:
    its replay mode blocks that like any new call, so the fork pauses ``replay_blocked``
    (recorded, never left running and leased), and a plain cancel then ends it."""
    app = make_app()
    booked = Bookings(app).sent
    source = app.run("trip", 3)
    assert source.status is RunStatus.WAITING_EXTERNAL
    forked = app.fork(source.run_id, replay=replay)
    paused = app.cancel(forked.run_id, compensate=True)
    assert paused.status is RunStatus.PAUSED, (paused.status, paused.error)
    assert paused.status_reason == "replay_blocked"
    assert app.cancel(forked.run_id).status is RunStatus.CANCELLED
    assert booked == Counter({"book 0": 1, "book 1": 1, "book 2": 1}), "nothing undone"
    assert app.get_run(source.run_id).status is RunStatus.WAITING_EXTERNAL


def test_a_forks_copied_effects_keep_the_order_they_were_made_in(make_app: MakeApp) -> None:
    """The copies are one transaction, so one created_at: the order of the source's calls
    stands (describe, and the latest effects a checkpoint lists)."""
    app = make_app()
    Bookings(app)
    source = app.run("trip", 12)
    made = [f"book#{k}" for k in range(1, 13)]
    forked = app.fork(source.run_id, replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)

    def effects(run_id: str) -> list[str]:
        return [e["step_id"] for e in app.describe(run_id)["effects"]]

    assert effects(source.run_id) == effects(forked.run_id) == made
    app.worker().run(until_idle=True)
    assert app.get_run(forked.run_id).status is RunStatus.WAITING_EXTERNAL
    keys = {e["idempotency_key"]: e["step_id"] for e in app.describe(forked.run_id)["effects"]}
    latest = app.checkpoints(forked.run_id)[0]["completed_effects"]["keys"]
    assert [keys[k] for k in latest] == made[-4:]


class Trip:
    """A booking, undone by the workflow itself (``undo_it``) or by a compensating cancel;
    counts what really happened."""

    def __init__(self, app: durably.App) -> None:
        self.app = app
        self.sent: Counter[str] = Counter()

        def release(op: durably.Operation) -> str:
            self.sent[f"release {op.run_id}"] += 1
            return "released"

        @app.tool(idempotent=True, compensate=release)
        def book(n: int) -> str:
            self.sent["book"] += 1
            return f"booked {n}"

        @app.workflow()
        async def trip(undo_it: bool) -> Any:
            booked = await book(1)
            if undo_it:
                return [booked, await durably.compensate()]
            return await durably.wait_for_event("go")


def test_a_run_that_compensated_itself_can_be_forked_and_replayed(make_app: MakeApp) -> None:
    app = make_app()
    trip = Trip(app)
    source = app.run("trip", True)
    assert source.status is RunStatus.COMPLETED, source.error
    assert source.result == ["booked 1", ["book#1"]]
    forked = app.fork(source.run_id)
    app.worker().run(until_idle=True)
    done = app.get_run(forked.run_id)
    assert (done.status, done.result) == (RunStatus.COMPLETED, source.result)
    assert app.replay(source.run_id).reproduced
    assert trip.sent == Counter({"book": 1, f"release {source.run_id}": 1}), "nothing again"


def test_a_fork_from_before_an_undo_does_not_undo_the_booking_again(make_app: MakeApp) -> None:
    """The source's cancellation released the booking after the fork point: the fork's copy
    of it says so, and the fork's own compensating cancel does not release it again."""
    app = make_app()
    trip = Trip(app)
    source = app.run("trip", False)
    assert app.cancel(source.run_id, compensate=True).status is RunStatus.CANCELLED
    forked = app.fork(source.run_id, at="book#1", replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    assert {e["step_id"]: e["status"] for e in app.describe(forked.run_id)["effects"]} == {
        "book#1": "compensated"
    }
    # Not one of the fork's confirmed effects: the recovery that reads it back agrees.
    assert app.checkpoints(forked.run_id)[0]["completed_effects"] == {"count": 0, "keys": []}
    app.worker().run(until_idle=True)
    assert app.get_run(forked.run_id).status is RunStatus.WAITING_EXTERNAL
    assert app.cancel(forked.run_id, compensate=True).status is RunStatus.CANCELLED
    assert approvals_asked(app, forked.run_id) == []
    assert trip.sent == Counter({"book": 1, f"release {source.run_id}": 1})


def approvals_asked(app: durably.App, run_id: str) -> list[str]:
    return [a["step_id"] for a in app.describe(run_id)["approvals"]]


def test_a_fork_taken_between_an_undo_and_its_mark_does_not_undo_again(
    make_app: MakeApp, database_url: str
) -> None:
    """The undo is recorded a commit before the effect is marked compensated: a fork taken
    between the two (here: the mark taken back behind durably's back) still copies the
    effect as undone."""
    app = make_app()
    trip = Trip(app)
    source = app.run("trip", False)
    app.cancel(source.run_id, compensate=True)
    execute_sql(
        database_url,
        "UPDATE durably_tool_operations SET status = 'succeeded' WHERE run_id = ?",
        (source.run_id,),
    )
    forked = app.fork(source.run_id, at="book#1", replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    effects = {e["step_id"]: e["status"] for e in app.describe(forked.run_id)["effects"]}
    assert effects == {"book#1": "compensated"}
    app.worker().run(until_idle=True)
    assert app.cancel(forked.run_id, compensate=True).status is RunStatus.CANCELLED
    assert trip.sent == Counter({"book": 1, f"release {source.run_id}": 1})


def test_an_undo_awaiting_its_approval_holds_the_cancelled_fork_still(make_app: MakeApp) -> None:
    """A live fork's undo asks a person first: the cancel it serves must not make the waiting
    run due again (each execution would ask again, a busy loop), and the approval finishes it."""
    app = make_app()
    booked = Bookings(app).sent
    source = app.run("trip", 1)
    forked = app.fork(source.run_id, replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    waiting = app.cancel(forked.run_id, compensate=True)
    assert waiting.status is RunStatus.WAITING_APPROVAL, (waiting.status, waiting.error)
    assert waiting.waiting_for is not None
    assert waiting.waiting_for["step_id"] == "compensate:book#1"
    assert app.worker().run(until_idle=True) == 0, "nothing is due before the decision"
    assert approvals_asked(app, forked.run_id) == ["compensate:book#1"]
    app.approve(forked.run_id, by="ana")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(forked.run_id).status is RunStatus.CANCELLED
    assert booked == Counter({"book 0": 1, "release book#1": 1})


class Travel:
    """``trip`` plans, then books a hotel and a flight at once; only the hotel has a sandbox.
    Counts what the real services and the sandbox received."""

    def __init__(self, app: durably.App, *, sandbox_refuses: int = 0) -> None:
        self.sent: Counter[str] = Counter()
        refusals = [sandbox_refuses]

        @app.step()
        def plan(who: str) -> str:
            return who

        def hotel_sandbox(who: str) -> str:
            self.sent[f"sandbox hotel {who}"] += 1
            if refusals[0] > 0:
                refusals[0] -= 1
                raise durably.ToolError("not now", category=durably.FailureCategory.PERMISSION)
            return f"hotel {who} (sandbox)"

        @app.tool(idempotent=True, sandbox=hotel_sandbox)
        async def hotel(who: str) -> str:
            self.sent[f"hotel {who}"] += 1
            return f"hotel {who}"

        @app.tool(idempotent=True)
        async def flight(who: str) -> str:
            self.sent[f"flight {who}"] += 1
            return f"flight {who}"

        @app.workflow()
        async def trip(who: str, fly: bool) -> list[str]:
            await plan(who)
            return list(await asyncio.gather(hotel(who), *([flight(who)] if fly else [])))


def effect_statuses(app: durably.App, run_id: str) -> dict[str, str]:
    return {e["step_id"]: e["status"] for e in app.describe(run_id)["effects"]}


def test_a_sandbox_call_stopped_by_a_blocked_parallel_call_is_never_sent_for_real(
    make_app: MakeApp,
) -> None:
    """The hotel's sandbox call is claimed when the flight, which has no sandbox, blocks the
    fork: the claim is withdrawn before anything is sent, so the cancel that follows has
    nothing to settle, and the real hotel never hears of the fork."""
    app = make_app(lease_ttl=timedelta(seconds=1))
    sent = Travel(app).sent
    source = app.run("trip", "ann", True)
    assert source.status is RunStatus.COMPLETED
    forked = app.fork(source.run_id, at="plan#1", replay=ReplayMode.SANDBOX)
    paused = app.resume(forked.run_id)
    assert (paused.status, paused.status_reason) == (RunStatus.PAUSED, "replay_blocked")
    assert effect_statuses(app, forked.run_id) == {"hotel#1": "intent_recorded"}
    assert app.cancel(forked.run_id).status is RunStatus.CANCELLED
    assert sent == Counter({"hotel ann": 1, "flight ann": 1}), "only the source's calls"


def test_a_sandbox_call_attempted_again_in_a_later_execution_stays_in_the_sandbox(
    make_app: MakeApp,
) -> None:
    """Refused once by the sandbox, the call is attempted again after ``resume``, by a new
    execution: the fork's replay mode, not the memory of the first one, sends it to the
    sandbox."""
    app = make_app()
    sent = Travel(app, sandbox_refuses=1).sent
    source = app.run("trip", "bo", False)
    forked = app.fork(source.run_id, at="plan#1", replay=ReplayMode.SANDBOX)
    paused = app.resume(forked.run_id)
    assert (paused.status, paused.status_reason) == (RunStatus.PAUSED, "permission_denied")
    done = app.resume(forked.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == ["hotel bo (sandbox)"]
    assert sent == Counter({"hotel bo": 1, "sandbox hotel bo": 2})


@pytest.mark.parametrize("first", ["source", "fork"])
def test_an_effect_held_by_a_run_and_its_fork_is_undone_once(make_app: MakeApp, first: str) -> None:
    """The fork's copy of a booking is the same booking: cancelled with compensations,
    the run and its live fork each undo it, whichever goes first; the second finds it
    undone and records so, without releasing it again."""
    app = make_app()
    booked = Bookings(app).sent
    source = app.run("trip", 1)
    forked = app.fork(source.run_id, replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)

    def cancel_source() -> None:
        assert app.cancel(source.run_id, compensate=True).status is RunStatus.CANCELLED

    def cancel_fork() -> None:
        waiting = app.cancel(forked.run_id, compensate=True)
        if waiting.status is RunStatus.WAITING_APPROVAL:  # a live fork's undo asks first
            app.approve(forked.run_id, by="ana")
            app.worker().run(until_idle=True)
        assert app.get_run(forked.run_id).status is RunStatus.CANCELLED

    for cancel in (
        (cancel_source, cancel_fork) if first == "source" else (cancel_fork, cancel_source)
    ):
        cancel()
    assert booked == Counter({"book 0": 1, "release book#1": 1})
    for run_id in (source.run_id, forked.run_id):
        assert effect_statuses(app, run_id)["book#1"] == "compensated"


def test_an_undo_under_way_in_the_source_is_not_made_again_by_its_fork(
    make_app: MakeApp,
) -> None:
    """The source's undo of a booking got no answer (unknown, paused for a person): the
    fork, cancelled with compensations, must not release the booking meanwhile; it ends
    cancelled, saying which run holds the undo."""
    app = make_app()
    sent: Counter[str] = Counter()

    def release(op: durably.Operation) -> None:
        sent[f"release {op.step_id}"] += 1
        raise TimeoutError("no answer")  # after acting

    @app.tool(compensate=release)  # neither its key nor a lookup: only a person can say
    def book(k: int) -> int:
        sent[f"book {k}"] += 1
        return k

    @app.workflow()
    async def trip() -> Any:
        await book(0)
        return await durably.wait_for_event("go")

    source = app.run(trip)
    forked = app.fork(source.run_id, replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    paused = app.cancel(source.run_id, compensate=True)
    assert (paused.status, paused.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    cancelled = app.cancel(forked.run_id, compensate=True)
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.error is not None
    assert source.run_id in cancelled.error["message"]
    assert sent == Counter({"book 0": 1, "release book#1": 1})


def test_a_fork_asked_again_under_its_run_id_is_the_same_fork(make_app: MakeApp) -> None:
    """Asked again (its first answer lost with the connection), a fork under the same new
    run id is the one already made, copied once; another fork under that id is refused."""
    app = make_app()
    shop = Shop(app)
    source = shop.run()
    first = app.fork(source.run_id, at="charge#1", new_run_id="run-fork-again")
    again = app.fork(source.run_id, at="charge#1", new_run_id="run-fork-again")
    assert again.run_id == first.run_id
    assert again.created_at == first.created_at
    assert [e.type for e in app.events(first.run_id)].count("step_forked") == 2
    with pytest.raises(durably.IdempotencyConflict, match="run-fork-again"):
        app.fork(source.run_id, at="plan#1", new_run_id="run-fork-again")


def test_a_sandbox_call_of_unknown_outcome_is_not_looked_up_at_the_real_service(
    make_app: MakeApp,
) -> None:
    """The sandbox gave no answer: the real service's lookup (``reconcile=``), which never
    saw the fork's call and might find the source's booking, is not asked; the call goes to
    the sandbox again."""
    app = make_app()
    sent: Counter[str] = Counter()

    def lookup(op: durably.Operation) -> durably.Reconciliation:
        sent["lookup"] += 1
        return durably.Reconciliation.not_executed()

    def rehearse(who: str) -> str:
        sent["sandbox"] += 1
        if sent["sandbox"] == 1:
            raise TimeoutError("no answer")
        return f"room for {who} (sandbox)"

    @app.step()
    def plan(who: str) -> str:
        return who

    @app.tool(reconcile=lookup, sandbox=rehearse)
    def hotel(who: str) -> str:
        sent["hotel"] += 1
        return f"room for {who}"

    @app.workflow()
    async def stay(who: str) -> str:
        return await hotel(await plan(who))

    source = app.run(stay, "cy")
    forked = app.fork(source.run_id, at="plan#1", replay=ReplayMode.SANDBOX)
    done = app.resume(forked.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == "room for cy (sandbox)"
    assert sent == Counter({"hotel": 1, "sandbox": 2})


@pytest.mark.parametrize("seed", range(3))
def test_a_run_and_its_fork_undoing_at_the_same_moment_undo_once(
    make_app: MakeApp, seed: int
) -> None:
    """The source is cancelled with compensations while its approved live fork undoes the
    same booking, from two threads: whichever looks first, and whether the other finds the
    undo made, under way or not yet recorded, the booking is released once and both runs
    end cancelled with it compensated."""
    app = make_app()
    sent: Counter[str] = Counter()
    lag = random.Random(seed)

    def release(op: durably.Operation) -> None:
        time.sleep(lag.random() * 0.2)
        sent[f"release {op.step_id}"] += 1

    @app.tool(idempotent=True, compensate=release)
    def book(k: int) -> int:
        sent[f"book {k}"] += 1
        return k

    @app.workflow()
    async def trip() -> Any:
        await book(0)
        return await durably.wait_for_event("go")

    source = app.run(trip)
    forked = app.fork(source.run_id, replay=ReplayMode.LIVE_WITH_NEW_APPROVAL)
    assert app.cancel(forked.run_id, compensate=True).status is RunStatus.WAITING_APPROVAL
    app.approve(forked.run_id, by="ana")
    together = threading.Barrier(2)

    def cancel_source() -> None:
        together.wait()
        time.sleep(lag.random() * 0.05)
        app.cancel(source.run_id, compensate=True)

    def run_fork() -> None:
        together.wait()
        time.sleep(lag.random() * 0.05)
        app.worker().run(until_idle=True)

    threads = [threading.Thread(target=cancel_source), threading.Thread(target=run_fork)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sent == Counter({"book 0": 1, "release book#1": 1})
    for run_id in (source.run_id, forked.run_id):
        ended = app.get_run(run_id)
        assert ended.status is RunStatus.CANCELLED, (run_id, ended.status, ended.error)
        assert ended.error is None
        assert effect_statuses(app, run_id)["book#1"] == "compensated"
