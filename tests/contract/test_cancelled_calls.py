"""A call cancelled by the code that awaits it still lands: frameworks and task groups
cancel a turn's other calls once one fails, and an effect cut between its intent and its
record would be left executing, its run running with nothing recorded."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

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
