"""Moving in-flight runs to new workflow code: ``migrates_from`` and ``durably.patched()``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]


def deploy(make_app: MakeApp, version: str, ran: Counter[str]) -> durably.App:
    app = make_app()

    @app.step()
    def plan(customer: str) -> str:
        ran["plan"] += 1
        return f"plan for {customer}"

    @app.tool(idempotent=True)
    def check_fraud(customer: str) -> bool:
        ran["check_fraud"] += 1
        return True

    @app.tool(idempotent=True)
    def ship(order: str) -> str:
        ran["ship"] += 1
        return f"shipped {order}"

    if version == "1":

        @app.workflow(name="order", version="1")
        async def order_v1(customer: str) -> Any:
            p = await plan(customer)
            await durably.wait_for_event("paid")
            return await ship(p)

    else:

        @app.workflow(name="order", version="2", migrates_from=["1"])
        async def order_v2(customer: str) -> Any:
            p = await plan(customer)
            if await durably.patched("fraud-check"):
                await check_fraud(customer)
            await durably.wait_for_event("paid")
            return await ship(p)

    return app


def test_a_waiting_run_moves_from_v1_to_v2(make_app: MakeApp) -> None:
    ran: Counter[str] = Counter()
    v1 = deploy(make_app, "1", ran)
    old = v1.run("order", "ann")
    assert old.status is RunStatus.WAITING_EXTERNAL

    v2 = deploy(make_app, "2", ran)
    new = v2.run("order", "bob")
    assert new.status is RunStatus.WAITING_EXTERNAL
    assert ran == Counter(plan=2, check_fraud=1), "the new run took the new path"

    for run in (old, new):
        v2.send_event(run.run_id, "paid", event_id=f"paid-{run.run_id}")
    assert v2.worker().run(until_idle=True) == 2  # v2 workers claim the v1 run too
    assert v2.get_run(old.run_id).status is RunStatus.COMPLETED
    assert v2.get_run(new.run_id).status is RunStatus.COMPLETED
    # The old run replayed the old path (no fraud check); the new one replayed its marker.
    assert ran == Counter(plan=2, check_fraud=1, ship=2)
    old_steps = [s["step_id"] for s in v2.describe(old.run_id)["steps"]]
    assert "durably.patch:fraud-check" not in old_steps
    assert "durably.patch:fraud-check" in [s["step_id"] for s in v2.describe(new.run_id)["steps"]]


def test_without_migrates_from_the_old_run_is_refused(make_app: MakeApp) -> None:
    ran: Counter[str] = Counter()
    old = deploy(make_app, "1", ran).run("order", "ann")
    v3 = make_app()

    @v3.workflow(name="order", version="3")
    async def order_v3(customer: str) -> None: ...

    v3.send_event(old.run_id, "paid", event_id="paid-1")  # due now: executing it is refused
    with pytest.raises(durably.ConfigurationError, match="migrates_from"):
        v3.resume(old.run_id)
