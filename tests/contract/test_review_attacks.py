"""Attacks found in review: parallel calls, swallowed errors, loops, tampering, replays."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import FailureCategory, Reconciliation, RetryPolicy, RunStatus
from tests.conftest import execute_sql

MakeApp = Callable[..., durably.App]
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=1))


def gate_tool(app: durably.App, state: dict[str, bool]) -> durably.Durable[[], None]:
    """A tool with neither key nor reconcile whose first calls time out: the run pauses."""

    @app.tool(name="gate")
    def gate() -> None:
        if not state["open"]:
            raise TimeoutError

    return gate


def test_parallel_calls_keep_the_journal_verifiable(make_app: MakeApp) -> None:
    """Results committed in parallel (separate connections on PostgreSQL) verify on resume."""
    app = make_app()
    state = {"open": False}
    gate = gate_tool(app, state)

    @app.step()
    async def square(i: int) -> int:
        await asyncio.sleep(0.001 * (i % 3))
        return i * i

    @app.tool(idempotent=True)
    async def send(i: int) -> int:
        await asyncio.sleep(0.001 * (i % 2))
        return i

    @app.workflow()
    async def wf() -> int:
        squares = await asyncio.gather(*(square(i) for i in range(8)))
        sent = await asyncio.gather(*(send(i) for i in range(4)))
        await gate()
        return sum(squares) + sum(sent)

    for _ in range(4):
        state["open"] = False
        run = app.run(wf)
        assert run.status is RunStatus.PAUSED
        state["open"] = True
        app.resolve_effect(run.run_id, "gate#1", "not_executed")  # verifies the journal
        done = app.resume(run.run_id)
        assert done.status is RunStatus.COMPLETED
        assert done.result == 140 + 6


def test_a_failing_parallel_call_does_not_orphan_its_siblings(make_app: MakeApp) -> None:
    app = make_app()

    @app.tool(idempotent=True)
    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "sent"

    @app.tool()
    async def declined() -> None:
        raise durably.ToolError("no", category=FailureCategory.BUSINESS_REJECTED)

    @app.workflow()
    async def wf() -> None:
        await asyncio.gather(slow(), declined())

    run = app.run(wf)
    assert run.status is RunStatus.FAILED
    statuses = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert statuses == {"slow#1": "succeeded", "declined#1": "failed"}


def test_swallowed_divergence_still_pauses_the_run(make_app: MakeApp) -> None:
    app = make_app()
    state = {"open": False}
    gate = gate_tool(app, state)
    amount = {"v": 10}

    @app.tool(idempotent=True)
    def charge(n: int) -> int:
        return n

    @app.workflow()
    async def wf() -> str:
        try:
            await charge(amount["v"])
        except Exception as exc:
            return f"swallowed {type(exc).__name__}"
        await gate()
        return "done"

    run = app.run(wf)
    amount["v"] = 99
    state["open"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "idempotency_conflict"


def test_reconcile_not_executed_is_bounded(make_app: MakeApp) -> None:
    """A tool that never answers and a service that never saw it: paused, not a hot loop.
    (A short reconcile grace: each "not executed" is trusted only after it.)"""
    app = make_app(reconcile_grace=timedelta(milliseconds=200))
    calls = Counter[str]()

    @app.tool(reconcile=lambda op: Reconciliation.not_executed(), retry=FAST)
    async def flaky() -> None:
        calls["flaky"] += 1
        raise TimeoutError

    @app.workflow()
    async def wf() -> None:
        await flaky()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "effect_state_unknown"
    assert calls["flaky"] == 3


def test_timeout_needs_an_async_tool(make_app: MakeApp) -> None:
    app = make_app()
    with pytest.raises(durably.ConfigurationError, match="async def"):

        @app.tool(timeout=timedelta(seconds=1))
        def blocking() -> None: ...


def test_a_raising_classifier_leaves_the_outcome_unknown(make_app: MakeApp) -> None:
    app = make_app()

    def broken(exc: BaseException) -> FailureCategory | None:
        raise KeyError("bug in classify")

    @app.tool(classify=broken)
    def send() -> None:
        raise ValueError("service said something")

    @app.workflow()
    async def wf() -> None:
        await send()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert app.describe(run.run_id)["effects"][0]["status"] == "unknown"


def test_reusing_an_explicit_step_id_is_refused(make_app: MakeApp) -> None:
    app = make_app()

    @app.step()
    def summarize(i: int) -> int:
        return i

    @app.workflow()
    async def wf() -> list[int]:
        return [await summarize.with_step_id("summary")(i) for i in range(2)]

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "non_determinism"
    assert run.error is not None
    assert "used twice" in run.error["message"]


def test_a_step_id_of_a_patch_marker_is_refused(make_app: MakeApp) -> None:
    """``durably.patch:<name>`` is the row of ``durably.patched(name)``: a step under that id
    would share it, so the id is refused before anything runs or is written."""
    app = make_app()
    ran: list[int] = []

    @app.step()
    def summarize(i: int) -> int:
        ran.append(i)
        return i

    @app.workflow()
    async def wf() -> list[object]:
        return [await summarize.with_step_id("durably.patch:x")(7), await durably.patched("x")]

    run = app.run(wf)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert "reserved" in run.error["message"]
    assert ran == []
    assert [s["step_id"] for s in app.describe(run.run_id)["steps"]] == []
    with pytest.raises(durably.ConfigurationError, match="reserved"):
        summarize.with_step_id("durably.patch:x")


def test_compensation_replays_identically(make_app: MakeApp) -> None:
    app = make_app()
    state = {"open": False}
    gate = gate_tool(app, state)
    undone: list[str] = []

    def cancel(op: durably.Operation) -> str:
        undone.append(op.step_id)
        return "cancelled"

    @app.tool(idempotent=True, compensate=cancel)
    def place(n: int) -> int:
        return n

    @app.tool()
    def charge() -> None:
        raise durably.ToolError("declined", category=FailureCategory.BUSINESS_REJECTED)

    @app.workflow()
    async def wf() -> list[str]:
        await place(1)
        try:
            await charge()
        except durably.StepFailed:
            compensated = await durably.compensate()
        await gate()
        await place(2)  # a later compensable effect must not be compensated on replay
        return compensated

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    state["open"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == ["place#1"]
    assert undone == ["place#1"]


def test_an_altered_tool_result_is_never_replayed(make_app: MakeApp, database_url: str) -> None:
    app = make_app()
    state = {"open": False}
    gate = gate_tool(app, state)

    @app.tool(idempotent=True)
    def quote() -> dict[str, int]:
        return {"amount": 10}

    @app.workflow()
    async def wf() -> dict[str, int]:
        q = await quote()
        await gate()
        return q

    run = app.run(wf)
    execute_sql(
        database_url,
        "UPDATE durably_tool_operations SET result_json = '{\"amount\":999999}' "
        "WHERE tool_name = 'quote'",
    )
    state["open"] = True
    with pytest.raises(durably.CheckpointCorrupted):
        app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "checkpoint_corrupted"


def test_resume_after_permission_retries_the_call(make_app: MakeApp) -> None:
    app = make_app()
    allowed = {"v": False}

    @app.tool()
    def export(report: str) -> str:
        if not allowed["v"]:
            raise durably.ToolError("token revoked", category=FailureCategory.PERMISSION)
        return f"exported {report}"

    @app.workflow()
    async def wf() -> str:
        return await export("q3")

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "permission_denied"
    allowed["v"] = True
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == "exported q3"


def test_start_checks_the_input_against_the_signature(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def greet(name: str) -> str:
        return name

    with pytest.raises(durably.InvalidInput, match="greet"):
        app.start(greet, nmae="x")
    result: Any = app.run(greet, name="x").result
    assert result == "x"
