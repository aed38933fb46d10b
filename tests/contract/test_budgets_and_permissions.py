"""Budgets pause a run that overspends; authorize= is asked before every execution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]


def test_tool_call_budget_pauses_before_the_extra_call(make_app: MakeApp) -> None:
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True)
    def send(i: int) -> int:
        sent[str(i)] += 1
        return i

    @app.workflow(budget=durably.Budget(max_tool_calls=2))
    async def wf() -> list[int]:
        return [await send(i) for i in range(3)]

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "budget_exceeded"
    assert run.error is not None
    assert run.error["type"] == "BudgetExceeded"
    assert sent == Counter({"0": 1, "1": 1})
    again = app.resume(run.run_id)  # same budget: still over it, nothing more is sent
    assert again.status_reason == "budget_exceeded"
    assert sent == Counter({"0": 1, "1": 1})
    checkpoint = app.checkpoints(run.run_id)[0]
    assert checkpoint["budget_snapshot"]["tool_calls"] == 3


def test_charged_tokens_count_against_the_budget(make_app: MakeApp) -> None:
    app = make_app()

    @app.step()
    def draft(n: int) -> dict[str, Any]:
        return {"text": "..." * n, "tokens": 400}

    @app.workflow(budget=durably.Budget(max_tokens=1000))
    async def wf() -> int:
        for i in range(5):
            reply = await draft(i)
            await durably.charge(tokens=reply["tokens"], cost=0.01)
        return 5

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "budget_exceeded"
    assert [s["step_id"] for s in app.describe(run.run_id)["steps"]] == [
        "draft#1",
        "draft#2",
        "draft#3",
    ]
    snapshot = app.checkpoints(run.run_id)[0]["budget_snapshot"]
    assert snapshot["tokens"] == 1200


def test_permission_revoked_during_a_wait_stops_the_effect(make_app: MakeApp) -> None:
    app = make_app()
    granted = {"v": True}
    sent = Counter[str]()

    def still_allowed(op: durably.Operation) -> bool:
        return granted["v"]

    @app.tool(idempotent=True, authorize=still_allowed)
    def transfer(amount: int) -> dict[str, int]:
        sent["transfer"] += 1
        return {"amount": amount}

    @app.workflow()
    async def wf() -> Any:
        await durably.wait_for_event("go")
        return await transfer(100)

    run = app.run(wf)
    granted["v"] = False  # the user's grant is revoked while the run waits
    app.send_event(run.run_id, "go", None, event_id="go-1")
    paused = app.resume(run.run_id)
    assert paused.status is RunStatus.PAUSED
    assert paused.status_reason == "permission_denied"
    assert sent == Counter()
    granted["v"] = True
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert sent == Counter({"transfer": 1})
