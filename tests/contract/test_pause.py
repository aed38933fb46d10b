"""Operator pause and unpause, over both stores: at the next call boundary, never in the
middle of an effect; a wait paused is the same wait when unpaused."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]


def event_types(app: durably.App, run_id: str) -> list[str]:
    return [e.type for e in app.events(run_id)]


def test_a_queued_run_pauses_at_once_and_unpause_lets_a_worker_finish_it(
    make_app: MakeApp,
) -> None:
    app = make_app()
    calls = Counter[str]()

    @app.tool(idempotent=True)
    def send() -> str:
        calls["send"] += 1
        return "sent"

    @app.workflow()
    async def wf() -> str:
        return str(await send())

    run_id = app.start(wf)
    paused = app.pause(run_id, reason="checking the campaign", by="ana")
    assert paused.status is RunStatus.PAUSED
    assert paused.status_reason == "operator_pause"
    assert paused.pause_requested
    assert paused.error is not None
    assert paused.error["by"] == "ana"
    assert "checking the campaign" in paused.error["message"]
    assert app.worker().run(until_idle=True) == 0  # a paused run is not claimed
    sequence = app.describe(run_id)["last_event_sequence"]
    assert app.pause(run_id, by="bob") == paused  # twice: nothing changes, nothing recorded
    assert app.describe(run_id)["last_event_sequence"] == sequence

    queued = app.unpause(run_id, by="ana")
    assert queued.status is RunStatus.QUEUED
    assert not queued.pause_requested
    assert queued.error is None
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run_id).result == "sent"
    assert calls == Counter(send=1)
    assert event_types(app, run_id)[1:3] == ["run_paused", "run_unpaused"]


def test_a_running_run_pauses_at_its_next_boundary_after_the_effect_in_flight(
    make_app: MakeApp,
) -> None:
    app = make_app()
    operator = make_app()
    entered = threading.Event()
    release = threading.Event()
    calls = Counter[str]()

    @app.tool()
    def charge(amount: int) -> dict[str, int]:
        calls["charge"] += 1
        entered.set()
        release.wait(10)
        return {"charged": amount}

    @app.tool()
    def notify() -> None:
        calls["notify"] += 1

    @app.workflow()
    async def wf() -> Any:
        charged = await charge(42)
        await notify()
        return charged

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    try:
        assert entered.wait(10)
        asked = operator.pause(run_id, reason="fraud check")
        assert asked.status is RunStatus.RUNNING  # the worker holds it: only a request
        assert asked.pause_requested
        assert operator.pause(run_id).pause_requested  # asking again is harmless
    finally:
        release.set()
        worker.join(20)
    paused = app.get_run(run_id)
    assert paused.status is RunStatus.PAUSED
    assert paused.status_reason == "operator_pause"
    assert calls == Counter(charge=1)  # the effect in flight landed; the next never started
    (effect,) = app.describe(run_id)["effects"]
    assert (effect["status"], effect["result"]) == ("succeeded", {"charged": 42})
    types = event_types(app, run_id)
    assert types.count("pause_requested") == 1
    assert types.index("effect_succeeded") < types.index("run_paused")
    assert app.checkpoints(run_id)[0]["status"] == "paused"

    assert app.unpause(run_id).status is RunStatus.QUEUED
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run_id).result == {"charged": 42}
    assert calls == Counter(charge=1, notify=1)  # recorded once, never sent again


def test_a_run_of_steps_pauses_at_the_boundary_after_the_step_in_flight(
    make_app: MakeApp,
) -> None:
    """A step's commit (one round, no checkpoint) carries the request back like any other."""
    app = make_app()
    operator = make_app()
    entered = threading.Event()
    release = threading.Event()
    calls = Counter[str]()

    @app.step()
    def think(i: int) -> int:
        calls[f"think {i}"] += 1
        if i == 1:
            entered.set()
            release.wait(10)
        return i

    @app.workflow()
    async def wf() -> int:
        return sum([await think(i) for i in range(1, 4)])

    run_id = app.start(wf)
    worker = threading.Thread(target=lambda: app.worker().run(until_idle=True))
    worker.start()
    try:
        assert entered.wait(10)
        assert operator.pause(run_id).pause_requested
    finally:
        release.set()
        worker.join(20)
    assert app.get_run(run_id).status_reason == "operator_pause"
    assert calls == Counter({"think 1": 1})
    app.unpause(run_id)
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run_id).result == 6
    assert calls == Counter({"think 1": 1, "think 2": 1, "think 3": 1})


def test_a_paused_wait_for_an_event_waits_for_it_again_when_unpaused(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> Any:
        return await durably.wait_for_event("paid", timeout=3600)

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_EXTERNAL
    timeout_at = run.waiting_for and run.waiting_for["timeout_at"]
    paused = app.pause(run.run_id)
    assert paused.status is RunStatus.PAUSED
    assert paused.waiting_for == run.waiting_for  # shown while paused: what it waits for

    assert app.worker().run(until_idle=True) == 0
    assert app.unpause(run.run_id).status is RunStatus.QUEUED
    assert app.worker().run(until_idle=True) == 1
    again = app.get_run(run.run_id)
    assert again.status is RunStatus.WAITING_EXTERNAL
    assert again.waiting_for is not None
    assert again.waiting_for["timeout_at"] == timeout_at  # the same wait, not a new one

    # An event sent while paused is kept, and does not wake a paused run.
    app.pause(run.run_id)
    app.send_event(run.run_id, "paid", {"amount": 42}, event_id="e1")
    assert app.get_run(run.run_id).status is RunStatus.PAUSED
    assert app.worker().run(until_idle=True) == 0
    app.unpause(run.run_id)
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).result == {"amount": 42}


def test_a_paused_approval_is_the_same_approval_when_unpaused(make_app: MakeApp) -> None:
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True, requires_approval=True)
    def send_email(to: str) -> str:
        sent[to] += 1
        return to

    @app.workflow()
    async def wf() -> Any:
        return await send_email("lead@example.com")

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_APPROVAL
    assert app.pause(run.run_id).status is RunStatus.PAUSED
    app.approve(run.run_id, by="ana")  # decided while paused: recorded, the run stays paused
    assert app.get_run(run.run_id).status is RunStatus.PAUSED
    assert app.worker().run(until_idle=True) == 0
    assert sent == Counter()

    app.unpause(run.run_id)
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).result == "lead@example.com"
    (approval,) = app.describe(run.run_id)["approvals"]  # no second request
    assert approval["status"] == "consumed"
    assert sent == Counter({"lead@example.com": 1})


def test_pause_and_unpause_refuse_what_they_cannot_do(make_app: MakeApp) -> None:
    app = make_app()
    state = {"unknown": True}

    @app.tool()
    def charge() -> str:
        if state["unknown"]:
            raise durably.OutcomeUnknown("the gateway timed out")
        return "charged"

    @app.step()
    def receipt(charged: str) -> str:
        return f"receipt for {charged}"

    @app.workflow()
    async def wf() -> str:
        return str(await receipt(await charge()))

    @app.workflow()
    async def quick() -> int:
        return 1

    with pytest.raises(durably.RunNotFound):
        app.pause("no-such-run")
    with pytest.raises(durably.RunNotFound):
        app.unpause("no-such-run")
    with pytest.raises(durably.InvalidInput):
        app.pause("bad\x00id")

    done = app.run(quick)
    with pytest.raises(durably.InvalidTransition, match="final"):
        app.pause(done.run_id)
    with pytest.raises(durably.InvalidTransition, match="final"):
        app.unpause(done.run_id)

    queued = app.start(quick)
    with pytest.raises(durably.InvalidTransition, match="nothing to unpause"):
        app.unpause(queued)
    app.pause(queued)
    app.unpause(queued)
    with pytest.raises(durably.InvalidTransition, match="nothing to unpause"):
        app.unpause(queued)  # unpaused twice
    assert app.worker().run(until_idle=True) == 1

    unknown = app.run(wf)
    assert (unknown.status, unknown.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    with pytest.raises(durably.InvalidTransition, match="durably resolve"):
        app.unpause(unknown.run_id)
    # An operator pause asked meanwhile outlasts the other reason: settled, the run stops
    # at the operator's pause before its next call, and unpause continues it.
    still = app.pause(unknown.run_id, reason="hold it")
    assert (still.status_reason, still.pause_requested) == ("effect_state_unknown", True)
    with pytest.raises(durably.InvalidTransition, match="effect_state_unknown"):
        app.unpause(unknown.run_id)
    step_id = app.describe(unknown.run_id)["effects"][0]["step_id"]
    app.resolve_effect(unknown.run_id, step_id, "succeeded", result="charged")
    assert app.worker().run(until_idle=True) == 1
    held = app.get_run(unknown.run_id)
    assert (held.status, held.status_reason) == (RunStatus.PAUSED, "operator_pause")
    app.unpause(unknown.run_id)
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(unknown.run_id).result == "receipt for charged"


def test_resume_and_cancel_of_an_operator_paused_run(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> int:
        return 7

    resumed = app.start(wf)
    app.pause(resumed)
    assert app.resume(resumed).result == 7  # resume lifts the operator's pause first
    cancelled = app.start(wf)
    app.pause(cancelled)
    gone = app.cancel(cancelled)
    assert gone.status is RunStatus.CANCELLED
    assert not gone.pause_requested  # a finished run has no pause in force


def test_resolve_settles_only_what_the_workflow_has_not_seen_and_lifts_no_operator_pause(
    make_app: MakeApp,
) -> None:
    """A failure the workflow already raised and acted on is history: resolving it again
    (as succeeded) would rewrite what the run did next. And resolving queues the run, so it
    is refused while an operator's pause holds it."""
    app = make_app()
    calls = Counter[str]()

    @app.tool()
    async def charge() -> str:
        calls["charge"] += 1
        raise TimeoutError("no answer")  # unknown outcome: a person settles it

    @app.tool()
    async def audit() -> str:
        calls["audit"] += 1
        raise TimeoutError("no answer")

    @app.workflow()
    async def billing() -> str:
        try:
            return await charge()
        except durably.StepFailed:
            await audit()  # acted on the failure
            return "refunded"

    run = app.run(billing)
    assert (run.status, run.waiting_for["step_id"]) == (RunStatus.PAUSED, "charge#1")
    app.resolve_effect(run.run_id, "charge#1", "failed")
    run = app.resume(run.run_id)
    assert (run.status, run.waiting_for["step_id"]) == (RunStatus.PAUSED, "audit#1")
    with pytest.raises(durably.InvalidTransition, match=r"charge#1 .* has failed"):
        app.resolve_effect(run.run_id, "charge#1", "succeeded", result="charged")
    assert app.describe(run.run_id)["effects"][0]["status"] == "failed"

    app.resolve_effect(run.run_id, "audit#1", "succeeded", result="logged")
    held = app.start(billing, run_id="held")
    assert app.pause(held).status is RunStatus.PAUSED  # queued: paused at once
    with pytest.raises(durably.InvalidTransition, match="paused by an operator"):
        app.resolve_effect(held, "charge#1", "failed")
    assert app.get_run(held).status_reason == "operator_pause"
    assert calls == Counter(charge=1, audit=1)
