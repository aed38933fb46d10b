"""A call cancelled by the code that awaits it still lands: frameworks and task groups
cancel a turn's other calls once one fails, and an effect cut between its intent and its
record would be left executing, its run running with nothing recorded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import RunStatus
from tests.conftest import fetch_sql

MakeApp = Callable[..., durably.App]


def test_a_task_group_cancelling_an_effect_in_flight_leaves_it_recorded(
    make_app: MakeApp, database_url: str
) -> None:
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True)
    async def refund(order: str) -> str:
        await asyncio.sleep(0.2)  # still sending when its sibling fails
        sent[order] += 1
        return f"refunded {order}"

    @app.step(retry=durably.RetryPolicy(max_attempts=1))
    async def check(order: str) -> str:
        await asyncio.sleep(0.02)
        raise ValueError(f"{order} is not refundable")

    @app.workflow()
    async def agent() -> Any:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(refund.with_step_id("call_1")("o-1"))
                group.create_task(check("o-2"))
        except* durably.StepFailed:
            pass  # the framework tells the model; the refund it started was cancelled
        return await refund.with_step_id("call_3")("o-3")

    run = app.run(agent)
    assert run.status is RunStatus.COMPLETED, run.error
    assert sent == Counter({"o-1": 1, "o-3": 1})
    statuses = dict(fetch_sql(database_url, "SELECT step_id, status FROM durably_tool_operations"))
    assert statuses == {"call_1": "succeeded", "call_3": "succeeded"}

    # Started again from the top, the cancelled call replays its recorded result.
    again = app.run(agent, run_id=run.run_id)
    assert again.status is RunStatus.COMPLETED
    assert sent == Counter({"o-1": 1, "o-3": 1})


def test_a_cancelled_call_whose_run_then_ends_is_recorded_before_the_release(
    make_app: MakeApp,
) -> None:
    """The workflow cancels the call and returns at once: the run completes only after the
    call it abandoned has landed, so nothing it started is left executing."""
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True)
    async def notify(to: str) -> str:
        await asyncio.sleep(0.1)
        sent[to] += 1
        return to

    @app.workflow()
    async def agent() -> str:
        task = asyncio.ensure_future(notify.with_step_id("call_n")("ana"))
        await asyncio.sleep(0.02)
        task.cancel()
        return "gave up"

    run = app.run(agent)
    assert run.status is RunStatus.COMPLETED
    assert sent == Counter({"ana": 1})
    [effect] = app.describe(run.run_id)["effects"]
    assert effect["status"] == "succeeded"


def test_a_tool_that_acts_then_raises_a_cancellation_leaves_its_outcome_unknown_not_executing(
    make_app: MakeApp,
) -> None:
    """A cancellation coming out of the tool itself (its HTTP client cancelled, a group
    holding one) is no failure the tool reported: the effect may stand. The workflow catches
    it, as frameworks catch everything, and goes on: the run pauses for the unknown outcome
    instead of completing with the call left ``executing``."""
    app = make_app()
    sent = Counter[str]()

    @app.tool()
    async def charge(card: str) -> str:
        sent[card] += 1
        raise asyncio.CancelledError  # after the effect: the answer never came back

    @app.workflow()
    async def agent() -> str:
        with contextlib.suppress(BaseException):  # what agent frameworks do
            await charge.with_step_id("call_1")("visa")
        return "done"

    run = app.run(agent)
    assert run.status is RunStatus.PAUSED, run
    assert run.status_reason == "effect_state_unknown"
    assert run.waiting_for is not None
    assert run.waiting_for["step_id"] == "call_1"
    [effect] = app.describe(run.run_id)["effects"]
    assert effect["status"] == "unknown"
    assert sent == Counter({"visa": 1})


def test_a_cancellation_a_tool_raises_through_the_workflow_pauses_the_run_not_the_worker(
    make_app: MakeApp,
) -> None:
    app = make_app()
    deliveries: dict[str, Counter[str]] = {}  # the service's own records, by idempotency key

    @app.tool(idempotent=True)
    async def ship(order: str) -> str:
        deliveries.setdefault(durably.idempotency_key(), Counter())[order] += 1
        if order == "o-1":
            raise asyncio.CancelledError
        return order

    @app.workflow()
    async def agent(order: str) -> str:
        return await ship.with_step_id("call_1")(order)

    cut = app.start(agent, "o-1")
    fine = app.start(agent, "o-2")
    assert app.worker(concurrency=2).run(until_idle=True) == 2
    run = app.get_run(cut)
    assert run.status is RunStatus.PAUSED, run
    assert run.status_reason == "effect_state_unknown"
    [effect] = app.describe(run.run_id)["effects"]
    assert effect["status"] == "unknown"
    assert app.get_run(fine).status is RunStatus.COMPLETED
    assert sorted(sum(c.values()) for c in deliveries.values()) == [1, 1]


def test_a_run_whose_workflow_swallows_its_cancellation_ends_cancelled(make_app: MakeApp) -> None:
    """Frameworks catch everything: the cancellation stops each later call, and the workflow,
    having caught every stop, returns. The run is cancelled, not completed."""
    app = make_app()
    sent = Counter[str]()

    @app.step()
    async def plan() -> str:
        await app.cancel_async(durably.current_run().run_id)  # an operator, meanwhile
        return "two emails"

    @app.tool(idempotent=True)
    async def email(to: str) -> str:
        sent[to] += 1
        return to

    @app.workflow()
    async def agent() -> list[str]:
        await plan()
        answers = []
        for to in ("ana", "bo"):
            try:
                answers.append(await email(to))
            except BaseException as exc:
                answers.append(f"error: {type(exc).__name__}")
        return answers

    run = app.run(agent)
    assert run.status is RunStatus.CANCELLED, run
    assert sent == Counter()
    assert [e.type for e in app.events(run.run_id)][-1] == "run_cancelled"


def test_a_call_begun_in_a_task_the_workflow_leaves_behind_lands_before_the_run_ends(
    make_app: MakeApp,
) -> None:
    """Fire and forget: the task has begun its call (one pass of the loop) when the workflow
    returns. The call lands and is recorded before the run completes, however far it got;
    one not begun at all pauses the run (``call_not_awaited``)."""
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True)
    async def notify(to: str) -> str:
        sent[to] += 1
        return to

    def agent_yielding(passes: int) -> durably.Durable[..., str]:
        @app.workflow(name=f"agent_{passes}")
        async def agent() -> str:
            left = asyncio.ensure_future(notify.with_step_id("bg")(f"to-{passes}"))
            left.add_done_callback(lambda _: None)  # never awaited: fire and forget
            for _ in range(passes):
                await asyncio.sleep(0)
            return "sent"

        return agent

    for passes in (1, 2, 3):
        run = app.run(agent_yielding(passes))
        assert run.status is RunStatus.COMPLETED, (passes, run)
        [effect] = app.describe(run.run_id)["effects"]
        assert effect["status"] == "succeeded", (passes, effect)
    assert sent == Counter({"to-1": 1, "to-2": 1, "to-3": 1})

    never = app.run(agent_yielding(0))
    assert never.status is RunStatus.PAUSED
    assert never.status_reason == "call_not_awaited"
    assert "to-0" not in sent


async def cancelled_once_sending(
    app: durably.App, agent: Callable[[], Any], sending: threading.Event
) -> None:
    """Execute ``agent`` as run r-1 and cancel that (Ctrl-C, a caller's timeout) once its
    tool is sending: however long the run takes to get there."""
    execution = asyncio.ensure_future(app.run_async(agent, run_id="r-1"))
    while not sending.is_set():
        await asyncio.sleep(0.005)
    execution.cancel()
    with pytest.raises(asyncio.CancelledError):
        await execution


def test_an_execution_cancelled_mid_effect_records_it_and_releases_the_run(
    make_app: MakeApp, database_url: str
) -> None:
    """Ctrl-C in a command, or a caller's timeout, cancels the execution while a tool is
    sending: the effect lands and is recorded, the run is released at once (no lease left
    to run out), and whoever goes on replays the effect instead of making it again."""
    app = make_app()
    sent = Counter[str]()
    sending = threading.Event()

    @app.tool()  # neither idempotent nor reconcilable: an unrecorded outcome needs a person
    async def charge(card: str) -> str:
        sending.set()
        await asyncio.sleep(0.3)
        sent[card] += 1
        return f"charged {card}"

    @app.workflow()
    async def agent() -> str:
        return await charge("visa")

    asyncio.run(cancelled_once_sending(app, agent, sending))
    assert sent == Counter({"visa": 1})
    [effect] = app.describe("r-1")["effects"]
    assert effect["status"] == "succeeded"
    owners = fetch_sql(database_url, "SELECT lease_owner FROM durably_runs WHERE run_id = 'r-1'")
    assert owners == [(None,)]
    assert [e.type for e in app.events("r-1")][-1] == "run_released"
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run("r-1").result == "charged visa"
    assert sent == Counter({"visa": 1})


def test_a_tool_ending_in_system_exit_pauses_its_run_and_the_worker_goes_on(
    make_app: MakeApp,
) -> None:
    """asyncio re-raises SystemExit out of its loop: let through, it ended the thread that
    runs every run of the process, and the worker hung for good."""
    app = make_app()
    sent = Counter[str]()

    @app.tool()
    def ship(order: str) -> str:
        sent[order] += 1
        if order == "o-1":
            raise SystemExit(2)  # a wrapped command line's main, after it acted
        return order

    @app.workflow()
    async def agent(order: str) -> str:
        return await ship(order)

    cut, fine = app.start(agent, "o-1"), app.start(agent, "o-2")
    assert app.worker(concurrency=2).run(until_idle=True) == 2
    run = app.get_run(cut)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert app.describe(cut)["effects"][0]["status"] == "unknown"
    assert app.get_run(fine).status is RunStatus.COMPLETED
    assert sent == Counter({"o-1": 1, "o-2": 1})


def test_an_execution_cancelled_while_its_run_ends_still_lands_and_releases(
    make_app: MakeApp, database_url: str
) -> None:
    """The workflow returned; the run's end waits for a call its task left behind, and the
    caller's timeout cancels it there: the call is recorded and the run released."""
    app = make_app()
    sent = Counter[str]()
    sending = threading.Event()

    @app.tool()
    async def charge(card: str) -> str:
        sending.set()
        await asyncio.sleep(0.3)
        sent[card] += 1
        return card

    @app.workflow()
    async def agent() -> str:
        left = asyncio.ensure_future(charge("visa"))
        left.add_done_callback(lambda _: None)
        await asyncio.sleep(0)
        return "done"

    asyncio.run(cancelled_once_sending(app, agent, sending))
    assert sent == Counter({"visa": 1})
    assert app.describe("r-1")["effects"][0]["status"] == "succeeded"
    owners = fetch_sql(database_url, "SELECT lease_owner FROM durably_runs WHERE run_id = 'r-1'")
    assert owners == [(None,)]
    assert [e.type for e in app.events("r-1")][-1] == "run_released"


def test_no_new_call_starts_while_a_cancelled_run_compensates(make_app: MakeApp) -> None:
    app = make_app()
    log: list[str] = []

    def refund(op: durably.Operation) -> str:
        log.append(f"refund {op.arguments['card']}")
        return "refunded"

    @app.tool(idempotent=True, compensate=refund)
    async def charge(card: str) -> str:
        log.append(f"charge {card}")
        return card

    @app.step()
    async def cancelled_meanwhile() -> None:
        await app.cancel_async(durably.current_run().run_id, compensate=True)

    @app.workflow()
    async def agent() -> str:
        await charge("a")
        await cancelled_meanwhile()
        left = asyncio.ensure_future(charge("b"))  # begins while the compensations run
        left.add_done_callback(lambda t: t.cancelled() or t.exception())
        await charge("c")  # stops here: the run is cancelled
        return "done"

    run = app.run(agent)
    assert run.status is RunStatus.CANCELLED, run
    assert log == ["charge a", "refund a"]
    statuses = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert statuses == {"charge#1": "compensated", "compensate:charge#1": "succeeded"}


def test_a_begun_call_that_asks_for_an_approval_holds_the_run_for_it(make_app: MakeApp) -> None:
    app = make_app()
    sent = Counter[int]()

    @app.tool(idempotent=True, requires_approval=True)
    async def wire(amount: int) -> str:
        sent[amount] += 1
        return f"wired {amount}"

    @app.workflow()
    async def agent(passes: int) -> str:
        left = asyncio.ensure_future(wire(100 + passes))
        left.add_done_callback(lambda t: t.cancelled() or t.exception())
        for _ in range(passes):
            await asyncio.sleep(0)
        return "done"

    for passes in (1, 2, 3):
        run = app.run(agent, passes)
        assert run.status is RunStatus.WAITING_APPROVAL, (passes, run)
        app.approve(run.run_id)
        assert app.worker().run(until_idle=True) == 1
        assert app.get_run(run.run_id).status is RunStatus.COMPLETED
    assert sent == Counter({101: 1, 102: 1, 103: 1})


def test_a_cancel_of_a_run_paused_for_calls_its_workflow_swallowed_compensates(
    make_app: MakeApp,
) -> None:
    app = make_app()
    log: list[str] = []

    def refund(op: durably.Operation) -> str:
        log.append("refund")
        return "refunded"

    @app.tool(idempotent=True, compensate=refund)
    async def charge() -> str:
        log.append("charge")
        return "charged"

    @app.tool()
    async def ship() -> str:
        log.append("ship")
        raise asyncio.CancelledError  # after acting

    @app.workflow()
    async def agent() -> str:
        for call in (charge, ship):
            with contextlib.suppress(BaseException):  # what agent frameworks do
                await call()
        return "done"

    run = app.run(agent)
    assert run.waiting_for is not None
    assert run.waiting_for["workflow_ended"] is True
    app.cancel(run.run_id, compensate=True)
    app.worker().run(until_idle=True)
    assert app.get_run(run.run_id).status is RunStatus.CANCELLED
    assert log == ["charge", "ship", "refund"]


def test_a_begun_step_between_its_attempts_is_waited_for(make_app: MakeApp) -> None:
    app = make_app()
    attempts = Counter[str]()

    @app.step(
        retry=durably.RetryPolicy(max_attempts=2, initial_interval=timedelta(milliseconds=50))
    )
    async def quote() -> int:
        attempts["quote"] += 1
        if attempts["quote"] == 1:
            raise ConnectionError("try again")
        return 42

    @app.workflow()
    async def agent() -> str:
        left = asyncio.ensure_future(quote())
        left.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.sleep(0)
        return "done"

    run = app.run(agent)
    assert run.status is RunStatus.COMPLETED
    assert attempts == Counter(quote=2)
    assert {s["step_id"]: s["status"] for s in app.describe(run.run_id)["steps"]} == {
        "quote#1": "succeeded"
    }


def test_a_compensation_of_unknown_outcome_pauses_the_cancelled_run_for_a_person(
    make_app: MakeApp,
) -> None:
    """The refund of a cancelled run acts, then its answer is lost: only a person can say.
    The run pauses for it (the worker goes on), and once it is resolved the cancellation
    completes, the refund never sent twice."""
    app = make_app()
    log: list[str] = []

    def refund(op: durably.Operation) -> str:
        log.append("refund")
        raise TimeoutError("no answer")  # after acting

    @app.tool(compensate=refund)
    async def pay() -> str:
        log.append("pay")
        return "paid"

    @app.workflow()
    async def order() -> str:
        await pay()
        return await durably.wait_for_event("shipped")

    run = app.run(order)
    app.cancel(run.run_id, compensate=True)  # executed here: it returns, it raises nothing
    app.worker().run(until_idle=True)
    paused = app.get_run(run.run_id)
    assert (paused.status, paused.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert paused.waiting_for is not None
    assert paused.waiting_for["step_id"] == "compensate:pay#1"
    app.resolve_effect(run.run_id, "compensate:pay#1", "succeeded", result="refunded")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).status is RunStatus.CANCELLED
    assert log == ["pay", "refund"]
    statuses = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert statuses == {"pay#1": "compensated", "compensate:pay#1": "succeeded"}


def test_system_exit_from_a_step_or_the_workflow_fails_the_run_and_the_app_goes_on(
    make_app: MakeApp,
) -> None:
    """Raised in the App's own event loop thread, SystemExit would end it (asyncio re-raises
    it): every later call of the App would wait for ever."""
    app = make_app()

    @app.step(retry=durably.RetryPolicy(max_attempts=1))
    def parse(argv: list[str]) -> int:
        raise SystemExit(2)  # a wrapped command line's main

    @app.workflow()
    async def by_step() -> int:
        return await parse(["--bad"])

    @app.workflow()
    async def by_itself() -> int:
        raise SystemExit(3)

    @app.workflow()
    async def fine() -> int:
        return 1

    for wf, step_failed in ((by_step, True), (by_itself, False)):
        run = app.run(wf)
        assert run.status is RunStatus.FAILED, run
        assert run.error is not None
        assert run.error["type"] == ("StepFailed" if step_failed else "SystemExit"), run.error
    assert app.run(fine).result == 1


def test_system_exit_from_a_reconcile_function_leaves_the_call_for_a_person(
    make_app: MakeApp,
) -> None:
    """Every user function durably calls (bodies, reconcile=, authorize=, subscribers) goes
    through one door, where SystemExit becomes that call's failure."""
    app = make_app()

    def lookup(op: durably.Operation) -> durably.Reconciliation:
        raise SystemExit(1)

    @app.tool(reconcile=lookup, reconcile_for=timedelta(0))
    async def charge() -> str:
        raise TimeoutError("no answer")

    @app.workflow()
    async def agent() -> str:
        return await charge()

    run = app.run(agent)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "effect_state_unknown"), run
    assert app.describe(run.run_id)["effects"][0]["status"] in ("unknown", "reconciling")
